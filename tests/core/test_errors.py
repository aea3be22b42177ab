"""gpucoll.errors: the C++ -> Python translation of every error code, the fields each error carries, the builtin
bases users catch them by, and pickling (errors cross process boundaries in gpucoll.spawn)."""

from __future__ import annotations

import builtins
import copy
import os
import pickle
import re

import pytest

import gpucoll
from gpucoll import _C, errors
from gpucoll.errors import (
    CollectiveTimeout,
    CudaError,
    GpucollError,
    InternalError,
    InvalidArgument,
    InvalidUsage,
    NcclError,
    RemoteError,
    SystemError,
    Unsupported,
)

# code (csrc/core/error.h) -> class, and the builtin exception users may catch it by
CODES = {
    1: (InvalidArgument, ValueError),
    2: (Unsupported, NotImplementedError),
    3: (InvalidUsage, RuntimeError),
    4: (CollectiveTimeout, TimeoutError),
    5: (RemoteError, RuntimeError),
    6: (NcclError, RuntimeError),
    7: (CudaError, RuntimeError),
    8: (SystemError, OSError),
    9: (InternalError, RuntimeError),
}
ALL_CLASSES = [GpucollError] + [cls for cls, _ in CODES.values()]
# Location of the throw in csrc/python/errors.cc: "<dir inside csrc>/file.cc:line"
LOCATION = re.compile(r"^python/errors\.cc:\d+$")


@pytest.mark.parametrize("code", sorted(CODES), ids=lambda c: CODES[c][0].__name__)
def test_each_code_raises_its_class_with_all_fields(code):
    cls, _ = CODES[code]
    with pytest.raises(GpucollError) as info:
        _C._raise_error(code, f"message for code {code}", call="someCall(arg)", ranks=[3, 1])
    exc = info.value
    assert type(exc) is cls
    assert exc.code == code
    assert exc.message == f"message for code {code}"
    assert exc.call == "someCall(arg)"
    assert LOCATION.match(exc.location), exc.location
    assert exc.ranks == (3, 1)
    assert exc.args == (exc.message,)
    text = str(exc)
    assert text.startswith(exc.message)
    assert "someCall(arg)" in text and exc.location in text


@pytest.mark.parametrize("code", sorted(CODES), ids=lambda c: CODES[c][0].__name__)
def test_defaults_without_call_or_ranks(code):
    with pytest.raises(CODES[code][0]) as info:
        _C._raise_error(code, "plain")
    exc = info.value
    assert exc.call == "" and exc.ranks == ()
    assert "[call:" not in str(exc)
    assert LOCATION.match(exc.location)


def test_message_text_survives_translation():
    message = "ünïcödé ✓ — " + "x" * 5000 + " 'quoted' \"double\" \n newline"
    with pytest.raises(InvalidArgument) as info:
        _C._raise_error(1, message, call="c")
    assert info.value.message == message


def test_unknown_code_is_still_a_gpucoll_error():
    with pytest.raises(GpucollError) as info:
        _C._raise_error(42, "from the future")
    assert info.value.message == "from the future"
    assert errors.error_class_for_code(42) is GpucollError
    assert errors.error_class_for_code(0) is GpucollError


def test_code_names_match_class_names():
    names = _C.error_code_names()
    assert sorted(names) == sorted(CODES)
    for code, (cls, _) in CODES.items():
        assert names[code] == cls.__name__
        assert errors.error_class_for_code(code) is cls
        assert cls.code == code


@pytest.mark.parametrize("cls, base", list(CODES.values()), ids=lambda v: getattr(v, "__name__", str(v)))
def test_builtin_bases(cls, base):
    assert issubclass(cls, GpucollError)
    assert issubclass(cls, base)
    assert issubclass(cls, Exception)


def test_systemerror_is_ours_not_the_builtin():
    assert SystemError is not builtins.SystemError
    assert not issubclass(SystemError, builtins.SystemError)
    exc = SystemError("open failed", call="open(x)")
    assert str(exc) == "open failed [call: open(x)]"  # GpucollError's format, not OSError's


def test_timeout_missing_ranks_alias():
    exc = CollectiveTimeout("t", ranks=[2, 5])
    assert exc.missing_ranks == (2, 5) == exc.ranks


def test_ranks_are_a_tuple_of_ints():
    import numpy as np

    exc = RemoteError("r", ranks=(r for r in [np.int64(1), np.int32(2), 3]))
    assert exc.ranks == (1, 2, 3) and all(type(r) is int for r in exc.ranks)


def _sample(cls):
    exc = cls("something failed: rank 2 said no", call="ncclAllReduce(buf)", location="core/x.cc:12",
              ranks=[2, 0])
    exc.rank = 1  # gpucoll.spawn attaches these
    exc.results = [None, 7]
    return exc


def _fields(exc):
    return (type(exc), exc.message, exc.call, exc.location, exc.ranks, exc.args, str(exc), exc.code)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip_keeps_type_and_fields(cls, protocol):
    exc = _sample(cls)
    back = pickle.loads(pickle.dumps(exc, protocol=protocol))
    assert _fields(back) == _fields(exc)
    assert back.rank == 1 and back.results == [None, 7]


@pytest.mark.parametrize("code", sorted(CODES), ids=lambda c: CODES[c][0].__name__)
def test_pickle_round_trip_of_translated_errors(code):
    with pytest.raises(GpucollError) as info:
        _C._raise_error(code, "translated", call="f()", ranks=[4])
    back = pickle.loads(pickle.dumps(info.value))
    assert _fields(back) == _fields(info.value)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_copy_and_deepcopy(cls):
    exc = _sample(cls)
    for dup in (copy.copy(exc), copy.deepcopy(exc)):
        assert _fields(dup) == _fields(exc)


def test_real_core_error_carries_its_location():
    with pytest.raises(InvalidArgument) as info:
        _C.config_raw("GPUCOLL_NO_SUCH_VARIABLE")
    exc = info.value
    assert "GPUCOLL_NO_SUCH_VARIABLE" in exc.message
    assert exc.call == "config"
    assert re.match(r"^core/config\.cc:\d+$", exc.location), exc.location


def test_real_os_failure_is_a_system_error():
    """Attaching to a region handle whose descriptor does not exist: the core's kSystem path with strerror/errno."""
    handle = (os.getpid(), 999_999, 0, 0)
    with pytest.raises(SystemError) as info:
        _C.HostComm(1, 2, 1.0, handle)
    exc = info.value
    assert isinstance(exc, OSError)
    assert exc.call == f"open(/proc/{os.getpid()}/fd/999999)", exc.call
    assert "No such file or directory" in exc.message and "errno 2" in exc.message
    assert exc.location.startswith("backends/host/")


def test_package_reexports_the_same_classes():
    for name in errors.__all__:
        assert hasattr(errors, name), name
    for cls in ALL_CLASSES:
        if cls is not SystemError:
            assert getattr(gpucoll, cls.__name__) is cls
        assert getattr(errors, cls.__name__) is cls
