"""The package's import graph stays a tree: no circles between gpucoll's files, and gpucoll's own modules imported at
module top (tests/project/import_graph.py measures both; optional heavy packages such as torch stay lazy)."""

from __future__ import annotations

import import_graph  # tests/project/import_graph.py, beside this file (pytest puts the folder on sys.path)


def test_no_import_circles():
    edges, _ = import_graph.graph()
    assert import_graph.circles(edges) == []


def test_no_function_level_imports_of_gpucoll_modules():
    _, nested = import_graph.graph()
    assert nested == []
