"""Shared native builds of tests/emulation/: one plain and one ThreadSanitizer copy of csrc/, each built once per
session and shared by the checks that run on it (mutations rebuild only what they touch)."""

from __future__ import annotations

import native_build
import pytest


@pytest.fixture(scope="session")
def plain_tree(tmp_path_factory):
    why = native_build.missing_tools()
    if why:
        pytest.skip(why)
    tree = native_build.Tree(tmp_path_factory.mktemp("emu-plain"))
    try:
        tree.build(("vranks_harness", "runtime_checks"))
    except native_build.BuildError as e:
        pytest.fail(str(e))
    return tree


@pytest.fixture(scope="session")
def tsan_tree(tmp_path_factory):
    why = native_build.tsan_problem()
    if why:
        pytest.skip(why)
    tree = native_build.Tree(tmp_path_factory.mktemp("emu-tsan"), tsan=True)
    try:
        tree.build()
    except native_build.BuildError as e:
        pytest.fail(str(e))
    return tree
