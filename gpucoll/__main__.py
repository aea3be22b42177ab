"""``python -m gpucoll <command> [args]``.

A command is one entry of COMMANDS: name -> (module, function name, one-line help). The module is imported
only when its command runs, so adding a command never slows the others. Each function takes the remaining
arguments and returns an exit status.
"""

from __future__ import annotations

import importlib
import sys

# Every tool gpucoll installs is here, under the name its console script or module also has: `--help` is where a
# new user looks for what there is, and the console scripts need the environment's bin on PATH, this does not.
COMMANDS = {
    "info": ("gpucoll.cli.info", "main", "report build, CUDA, NCCL, NVML, GPUCOLL_* settings and package versions"),
    "bench": ("gpucoll.bench.cli", "main", ("benchmark and check collectives with nccl-tests' flags and table; "
                                            "--health-check checks every collective (also: gpucoll-bench)")),
    "topo": ("gpucoll.cli.topo", "main", ("the GPU wiring and what gpucoll would run on it; --from-nvidia-smi FILE "
                                          "explains another machine (also: gpucoll-topo)")),
    "tune": ("gpucoll.cli.tune", "main", "fit the cost model to gpucoll-bench --json runs (also: gpucoll-tune)"),
    "trace": ("gpucoll.cli.trace", "main", ("merge the flight-recorder dumps of a failed collective: where every "
                                            "rank was, the last collectives, stragglers; --plot draws the ranks")),
    "explain": ("gpucoll.cli.explain", "explain_main", ("compare the algorithms for one collective call "
                                                       "(also: python -m gpucoll.algo explain)")),
}


def usage() -> str:
    lines = ["usage: python -m gpucoll <command> [args]", "", "commands:"]
    width = max(len(name) for name in COMMANDS)
    for name, (_, _, text) in COMMANDS.items():
        lines.append(f"  {name.ljust(width)}  {text}")
    lines.append("")
    lines.append("python -m gpucoll <command> --help shows a command's options, e.g. python -m gpucoll bench --help.")
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
