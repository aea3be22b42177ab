"""The GPUCOLL_* registry (csrc/core/config.cc) and its typed accessors (gpucoll.config).

The C++ core reads getenv at call time, so monkeypatching os.environ (which calls putenv) before a call is
enough; one test also checks a value set in a child process's environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpucoll import _C, config
from gpucoll.errors import InvalidArgument

TYPES = {"bool", "int", "bytes", "float", "string", "secret"}
REPO = Path(__file__).resolve().parents[2]
VARS = _C.config_vars()
NAMES = [v["name"] for v in VARS]


def _first_of_type(kind):
    for v in VARS:
        if v["type"] == kind:
            return v["name"]
    pytest.skip(f"no registered variable of type {kind}")


@pytest.fixture
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- the registry --------------------------------------------------------------------------------------------------

def test_registry_entries_are_complete():
    assert VARS, "the registry is empty"
    assert len(set(NAMES)) == len(NAMES), "duplicate names"
    for v in VARS:
        assert set(v) >= {"name", "type", "default", "description", "value", "is_set"}, v
        assert re.fullmatch(r"GPUCOLL_[A-Z0-9_]+", v["name"]), v["name"]
        assert v["type"] in TYPES, v
        assert isinstance(v["default"], str), v
        assert isinstance(v["description"], str) and len(v["description"].strip()) >= 20, v
        assert isinstance(v["is_set"], bool), v


def test_known_variables_are_registered():
    for name in ("GPUCOLL_LOG_LEVEL", "GPUCOLL_BACKEND", "GPUCOLL_HOST_BUFFER_BYTES", "GPUCOLL_HOST_SEGMENT_BYTES",
                 "GPUCOLL_HOST_SPIN_US", "GPUCOLL_DEBUG_CHECKS", "GPUCOLL_NCCL_LIBRARY"):
        assert name in NAMES


def test_python_view_matches_the_core():
    assert [v["name"] for v in config.variables()] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_default_parses_with_its_typed_accessor(clean_env, name):
    var = next(v for v in VARS if v["name"] == name)
    assert config.get(name) == var["default"]
    assert not config.is_set(name)
    kind = var["type"]
    if kind == "bool":
        assert isinstance(config.get_bool(name), bool)
    elif kind == "int":
        assert config.get_int(name) == int(var["default"])
    elif kind == "bytes":
        assert config.get_bytes(name) >= 0
    elif kind == "float":
        float(_C.config_float(name))


def test_values_reflect_the_environment_at_call_time(clean_env):
    name = _first_of_type("string")
    assert config.get(name) == next(v["default"] for v in VARS if v["name"] == name)
    clean_env.setenv(name, "some-value")
    assert config.get(name) == "some-value" and config.is_set(name)
    listed = next(v for v in _C.config_vars() if v["name"] == name)
    assert listed["value"] == "some-value" and listed["is_set"] is True
    clean_env.setenv(name, "")  # exported but empty counts as unset
    assert not config.is_set(name)
    assert config.get(name) == next(v["default"] for v in VARS if v["name"] == name)


def test_unknown_variable_is_an_invalid_argument_naming_it():
    for fn in (config.get, config.get_bool, config.get_int, config.get_bytes, config.is_set):
        with pytest.raises(InvalidArgument, match="GPUCOLL_NOT_A_VARIABLE"):
            fn("GPUCOLL_NOT_A_VARIABLE")


# -- typed accessors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("0", 0), ("64K", 64 << 10), ("64KiB", 64 << 10), ("1M", 1 << 20), ("16M", 16 << 20),
    ("2G", 2 << 30), ("256K", 256 << 10),
])
def test_bytes_accepts_documented_forms(clean_env, text, value):
    name = _first_of_type("bytes")
    clean_env.setenv(name, text)
    assert config.get_bytes(name) == value
    assert _C.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["abc", "12Q", "-1K", "-5", "K", "1MM", "12 ", "1K "])
def test_bytes_rejects_malformed_values_naming_the_variable(clean_env, text):
    name = _first_of_type("bytes")
    clean_env.setenv(name, text)
    with pytest.raises(InvalidArgument) as info:
        config.get_bytes(name)
    assert name in str(info.value) and text in str(info.value)
    with pytest.raises(InvalidArgument):
        _C.parse_bytes(text)


@pytest.mark.parametrize("text", ["nan", "inf", "1e30", "99999999999999999999"])
def test_bytes_rejects_non_finite_and_out_of_range_sizes(clean_env, text):
    name = _first_of_type("bytes")
    clean_env.setenv(name, text)
    with pytest.raises(InvalidArgument, match=name):
        config.get_bytes(name)


@pytest.mark.parametrize("text, value", [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("On", True),
    ("0", False), ("false", False), ("False", False), ("no", False), ("OFF", False),
])
def test_bool_accepts_common_spellings(clean_env, text, value):
    name = _first_of_type("bool")
    clean_env.setenv(name, text)
    assert config.get_bool(name) is value


@pytest.mark.parametrize("text", ["2", "maybe", "yess", "-1", "t"])
def test_bool_rejects_malformed_values_naming_the_variable(clean_env, text):
    name = _first_of_type("bool")
    clean_env.setenv(name, text)
    with pytest.raises(InvalidArgument) as info:
        config.get_bool(name)
    assert name in str(info.value)


@pytest.mark.parametrize("text, value", [("123", 123), ("-5", -5), ("0", 0), ("9223372036854775807", 2**63 - 1)])
def test_int_accepts_integers(clean_env, text, value):
    name = _first_of_type("int")
    clean_env.setenv(name, text)
    assert config.get_int(name) == value


@pytest.mark.parametrize("text", ["12x", "1.5", "abc", "0x10", "99999999999999999999", "12 ", "1K"])
def test_int_rejects_malformed_values_naming_the_variable(clean_env, text):
    name = _first_of_type("int")
    clean_env.setenv(name, text)
    with pytest.raises(InvalidArgument) as info:
        config.get_int(name)
    assert name in str(info.value) and text in str(info.value)


@pytest.mark.spawns
def test_value_set_in_a_child_process_environment():
    name = _first_of_type("bytes")
    code = f"from gpucoll import config; print(config.get_bytes({name!r}), config.is_set({name!r}))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOLL_")}
    env[name] = "1M"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(1 << 20), "True"]
    env[name] = "lots"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert bad.returncode != 0 and "InvalidArgument" in bad.stderr and name in bad.stderr


# -- the registry is the only reader ------------------------------------------------------------------------------

def _sources():
    for pattern in ("gpucoll/**/*.py", "csrc/**/*.cc", "csrc/**/*.h", "csrc/**/*.cu", "csrc/**/*.cuh"):
        yield from REPO.glob(pattern)


def test_every_quoted_variable_name_in_the_sources_is_registered():
    unknown = {}
    for path in _sources():
        for name in re.findall(r"[\"'](GPUCOLL_[A-Z0-9_]+)", path.read_text(errors="replace")):
            if name not in NAMES:
                unknown.setdefault(name, str(path.relative_to(REPO)))
    assert not unknown, f"GPUCOLL_* names used but not in the registry: {unknown}"


def test_no_direct_environment_reads_of_gpucoll_variables():
    offenders = []
    for path in _sources():
        if path.name == "config.cc":
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(r"(getenv|environ)\b.*GPUCOLL_", line) and not line.lstrip().startswith(("//", "#")):
                offenders.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not offenders, "read GPUCOLL_* through gpucoll.config instead:\n" + "\n".join(offenders)


def test_secret_values_are_never_shown(monkeypatch):
    monkeypatch.setenv("GPUCOLL_STORE_SECRET", "do-not-print-this-0123456789")
    (var,) = [v for v in config.variables() if v["name"] == "GPUCOLL_STORE_SECRET"]
    assert var["type"] == "secret" and var["is_set"] and var["value"] == "(hidden)", var
    from gpucoll.cli import info

    assert "do-not-print-this" not in info.format_text(info.collect())
    assert config.get("GPUCOLL_STORE_SECRET") == "do-not-print-this-0123456789"  # readable by gpucoll itself
