"""What gpucoll's command lines (gpucoll-bench, gpucoll-topo, gpucoll-tune, python -m gpucoll explain/info and the
scripts in bench/) share: a --help where every option shows its default and descriptions keep the line breaks they
were written with, and a quiet exit when the reader of their output leaves (``| head``)."""

from __future__ import annotations

import argparse
import functools
import os
import sys


def default_text(default) -> str | None:
    """How an option's default reads in --help, or None when there is nothing to show (no default, a flag)."""
    if default is None or default is False or default is argparse.SUPPRESS or default == "":
        return None
    if isinstance(default, (list, tuple)):
        return ",".join(map(str, default)) or None
    return str(default)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter with "(default: X)" after the help of every option that has a default."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = default_text(action.default)
        if not action.option_strings or shown is None or "(default" in text or text is argparse.SUPPRESS:
            return text
        return f"{text} (default: {shown.replace('%', '%%')})"


def reader_may_leave(main):
    """`main` ending with status 1 and no traceback when its standard output's reader has gone (``| head``)."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()  # inside the try: buffered output may be what meets the closed pipe
            return status
        except BrokenPipeError:
            # stdout now points at /dev/null, so that the interpreter's own final flush does not fail again (the
            # recipe of the signal module's documentation).
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    return run
