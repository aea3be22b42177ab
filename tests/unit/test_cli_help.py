"""Every command line's --help: each option has help, shows its default, and no reST markup leaks into it
(gpucoll-bench and its health check and report, gpucoll-topo, gpucoll-tune, python -m gpucoll.algo/info, and the
scripts in bench/)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpucoll import algo, info, topo_cli, tune
from gpucoll._help import default_text
from gpucoll.bench import args, check, cli, plot

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
    "python -m gpucoll.algo": algo._parser,
    "python -m gpucoll info": info._parser,
    "bench/ddp_step.py": lambda: _script_parser("ddp_step"),
    "bench/compare_peers.py": lambda: _script_parser("compare_peers"),
    "bench/calibrate_host.py": lambda: _script_parser("calibrate_host"),
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


def test_check_after_a_collective_is_nccl_tests_count_and_says_where_the_health_check_is(capsys):
    assert cli.main(["all_reduce", "--check"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "-c/--check takes a number" in err and "gpucoll-bench --health-check" in err
    assert "expected one argument" not in err
    assert cli.main(["all_reduce", "--colls", "all_reduce"]) == cli.EXIT_USAGE
    assert "--colls belong to the health check" in capsys.readouterr().err
    assert cli.parse_args(["all_reduce", "-c", "3"]).check == 3 and cli.parse_args(["all_reduce"]).check == 1


def test_health_check_json_to_stdout():
    """--health-check by its name, --json - : stdout is exactly the JSON list, the OK lines go to stderr."""
    cmd = [sys.executable, "-c", "import sys; from gpucoll.bench.cli import main; sys.exit(main())", "--health-check",
           "--backend", "host", "--nranks", "2", "--colls", "all_reduce,broadcast", "--json", "-"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, res.stderr
    docs = json.loads(res.stdout)
    assert [d["config"]["collective"] for d in docs] == ["all_reduce", "broadcast"]
    assert "check host   all_reduce      OK" in res.stderr and "check: OK" in res.stderr


def test_bench_json_and_csv_to_stdout(tmp_path):
    base = [sys.executable, "-c", "import sys; from gpucoll.bench.cli import main; sys.exit(main())", "all_reduce",
            "-b", "1K", "-e", "4K", "-f", "4", "-n", "1", "-w", "0"]
    res = subprocess.run([*base, "--json", "-"], capture_output=True, text=True, timeout=120, check=True)
    assert [r["size"] for r in json.loads(res.stdout)["results"]] == [1024, 4096]
    assert "# Avg bus bandwidth" in res.stderr  # the table moved to stderr
    res = subprocess.run([*base, "--csv", "-"], capture_output=True, text=True, timeout=120, check=True)
    assert res.stdout.startswith("# program: gpucoll-bench all_reduce") and "size," in res.stdout
    assert cli.main(["all_reduce", "--json", "-", "--csv", "-"]) == cli.EXIT_USAGE
