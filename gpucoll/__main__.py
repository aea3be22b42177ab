"""``python -m gpucoll <command> [args]``.

A command is one entry of COMMANDS: name -> (module, function name, one-line help). The module is imported
only when its command runs, so adding a command never slows the others. Each function takes the remaining
arguments and returns an exit status.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "info": ("gpucoll.info", "main", "report build, CUDA, NCCL, NVML, GPUCOLL_* settings and package versions"),
}


def usage() -> str:
    lines = ["usage: python -m gpucoll <command> [args]", "", "commands:"]
    width = max(len(name) for name in COMMANDS)
    for name, (_, _, text) in COMMANDS.items():
        lines.append(f"  {name.ljust(width)}  {text}")
    lines.append("")
    lines.append("python -m gpucoll <command> --help shows a command's options.")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"gpucoll: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), function)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
