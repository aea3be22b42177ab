"""Every command line's --help: each option has help, shows its default, and no reST markup leaks into it
(gpucoll-bench and its health check and report, gpucoll-topo, gpucoll-tune, python -m gpucoll explain/info, and the
scripts in bench/)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpucoll._help import default_text
from gpucoll.bench import args, check, cli, plot
from gpucoll.cli import explain, info, tune
from gpucoll.cli import topo as topo_cli
from gpucoll.cli import trace as trace_cli

ROOT = Path(__file__).resolve().parents[2]


def _script_parser(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._parser()


PARSERS = {
    "gpucoll-bench": args.build_parser,
    "gpucoll-bench --health-check": check._parser,
    "gpucoll-bench report": plot._report_parser,
    "gpucoll-topo": topo_cli._parser,
    "gpucoll-tune": tune._parser,
    "python -m gpucoll explain": explain._parser,
    "python -m gpucoll info": info._parser,
    "python -m gpucoll trace": trace_cli._parser,
    "bench/ddp_step.py": lambda: _script_parser("ddp_step"),
    "bench/compare_peers.py": lambda: _script_parser("compare_peers"),
    "bench/calibrate_host.py": lambda: _script_parser("calibrate_host"),
    "bench/trace_overhead.py": lambda: _script_parser("trace_overhead"),
}


def _all(parser):
    """The parser and its subcommands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all(sub)


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_option_has_help_and_shows_its_default(name):
    for parser in _all(PARSERS[name]()):
        text = parser.format_help()
        assert "`" not in text, f"{name}: reST markup in --help:\n{text}"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
                continue
            flag = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip(), f"{name}: {flag} has no help"
            shown = default_text(action.default)
            if action.option_strings and shown is not None:
                formatter = parser._get_formatter()
                assert "(default" in formatter._get_help_string(action), f"{name}: {flag} hides its default {shown}"


def test_bench_help_lists_the_health_check_options_with_their_defaults():
    text = args.build_parser().format_help()
    for option in ("--health-check", "--colls", "--require-gpu", "--tuning"):
        assert option in text.split("health check:", 1)[1], option
    assert "min size in bytes (default: 32M)" in text and "(default: float)" in text


def test_check_is_nccl_tests_count_wherever_it_is_and_a_missing_number_is_one_line(capsys):
    """-c/--check is one option with one rule: nccl-tests' count, which takes a number. Its help showed "-c [N]",
    a missing number after a collective printed argparse's ten-line usage block, and a bare --check ran the
    health check."""
    for argv in (["all_reduce", "--nranks", "2", "--check"], ["--check"], ["all_reduce", "-c", "-b", "8"],
                 ["all_reduce", "--che"]):
        assert cli.main(argv) == cli.EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("gpucoll-bench: error: -c/--check takes a number N"), (argv, err)
        assert "gpucoll-bench --health-check" in err
    usage = args.build_parser().format_usage()
    assert "[-c N]" in usage and "[-c [N]]" not in usage
    assert cli.main(["--check", "3"]) == cli.EXIT_USAGE  # a count, but no collective: argparse's one line says so
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "required: collective (one of all_reduce," in err
    assert cli.main(["all_reduce", "--colls", "all_reduce"]) == cli.EXIT_USAGE
    assert "--colls belong to the health check" in capsys.readouterr().err
    assert cli.parse_args(["all_reduce", "-c", "3"]).check == 3 and cli.parse_args(["all_reduce"]).check == 1


@pytest.mark.spawns
def test_health_check_json_to_stdout():
    """--health-check by its name, --json - : stdout is exactly the JSON list, the OK lines go to stderr."""
    cmd = [sys.executable, "-c", "import sys; from gpucoll.bench.cli import main; sys.exit(main())", "--health-check",
           "--backend", "host", "--nranks", "2", "--colls", "all_reduce,broadcast", "--json", "-"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, res.stderr
    docs = json.loads(res.stdout)
    assert [d["config"]["collective"] for d in docs] == ["all_reduce", "broadcast"]
    assert "check host   all_reduce      OK" in res.stderr and "check: OK" in res.stderr


@pytest.mark.spawns
def test_bench_json_and_csv_to_stdout(tmp_path):
    base = [sys.executable, "-c", "import sys; from gpucoll.bench.cli import main; sys.exit(main())", "all_reduce",
            "-b", "1K", "-e", "4K", "-f", "4", "-n", "1", "-w", "0"]
    res = subprocess.run([*base, "--json", "-"], capture_output=True, text=True, timeout=120, check=True)
    assert [r["size"] for r in json.loads(res.stdout)["results"]] == [1024, 4096]
    assert "# Avg bus bandwidth" in res.stderr  # the table moved to stderr
    res = subprocess.run([*base, "--csv", "-"], capture_output=True, text=True, timeout=120, check=True)
    assert res.stdout.startswith("# program: gpucoll-bench all_reduce") and "size," in res.stdout
    assert cli.main(["all_reduce", "--json", "-", "--csv", "-"]) == cli.EXIT_USAGE


@pytest.mark.parametrize("argv", [
    ["-m", "gpucoll", "topo", "--from-nvidia-smi", str(ROOT / "gpucoll" / "topo_examples" / "h100_8x_nvsmi.txt"),
     "--json"],
    ["-m", "gpucoll.algo", "explain", "all_reduce", "--nranks", "64", "--bytes", "1M", "--steps"],
    ["-m", "gpucoll", "info"],
    ["-m", "gpucoll.bench.cli", "all_reduce", "--nranks", "2", "-b", "8", "-e", "4M", "-f", "2"],
])
@pytest.mark.spawns
def test_a_reader_that_leaves_early_gets_no_traceback(argv):
    """`tool | head -1`: the tool ends (status 1) without a BrokenPipeError traceback of its own."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline()
    proc.stdout.close()  # the reader leaves
    err = proc.stderr.read().decode()
    assert proc.wait(120) in (0, 1), err  # 0: everything was written before the reader left
    assert "BrokenPipeError" not in err and "the run failed" not in err, err
