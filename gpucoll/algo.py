"""``python -m gpucoll.algo explain ...``: the first spelling of ``python -m gpucoll explain ...``, kept for the
commands people saved. The tool is gpucoll/cli/explain.py."""

import sys

from gpucoll.cli.explain import explain, main

__all__ = ["explain", "main"]

if __name__ == "__main__":
    sys.exit(main())
