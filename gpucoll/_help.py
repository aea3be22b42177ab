"""The --help of gpucoll's command lines (gpucoll-bench, gpucoll-topo, gpucoll-tune, python -m gpucoll.algo/info and
the scripts in bench/): every option shows its default, and descriptions keep the line breaks they were written with."""

from __future__ import annotations

import argparse


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
