"""_C.call_sig / _C.call_mismatch: the host backend's call signature and mismatch message, bound for the NCCL
backend's explicit check (gpucoll/_call_check.py); the check itself runs in tests/nccl/test_nccl_call_check.py."""

from __future__ import annotations

import pytest

from gpucoll.errors import InvalidArgument


def test_call_sig_binding_matches_the_host_backends_words():
    from gpucoll import _C

    a = _C.call_sig(4, 0, int(_C.DType.float32), int(_C.RedOp.sum), False, 0, 8)
    b = _C.call_sig(4, 0, int(_C.DType.float32), int(_C.RedOp.sum), True, 0, 8)
    assert len(a) == 24 and _C.call_mismatch([a, a, a]) is None
    message, odd = _C.call_mismatch([a, b, a])
    assert odd == [1] and "premul_sum" in message and "collective #4" in message
    with pytest.raises(InvalidArgument, match="24"):
        _C.call_mismatch([a, b"short"])
