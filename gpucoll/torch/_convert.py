"""torch's reduce ops and dtypes in gpucoll's terms: the one place the torch backend and its hooks convert them.

torch's semantics: AVG on integers truncates toward zero (as NCCL does), complex tensors reduce as pairs of reals
(SUM, AVG, PREMUL_SUM only), PREMUL_SUM scales each input first. Dtypes gpucoll lacks move as bytes in the copying
collectives; reducing one, or an op gpucoll lacks, raises ``gpucoll.Unsupported`` naming it."""

from __future__ import annotations

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from gpucoll.backends.premul import premul_sum
from gpucoll.errors import Unsupported

# dtypes gpucoll reduces (its names are torch's without "torch."); every other dtype moves as bytes.
REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
             torch.int64)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_OPS = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg", "PREMUL_SUM": "premul_sum"}
_BITWISE = ("BAND", "BOR", "BXOR")


def dtype_name(dtype) -> str | None:
    """gpucoll's name of a torch dtype it reduces ("float32", ...), or None."""
    return str(dtype).replace("torch.", "") if dtype in REDUCIBLE else None


def op_name(op) -> str:
    """"SUM", "PREMUL_SUM", ... for a torch ReduceOp (object or enum value)."""
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", None)
    if name is None:  # older pybind enums: str() is "RedOpType.SUM"
        name = str(kind).rsplit(".", 1)[-1]
    return str(name).upper()


def premul_factor(op):
    """ReduceOp.PREMUL_SUM's scalar as a Python number, or None where torch does not tell it. torch 2.13 has the
    ``factor`` property; torch 2.11 (the GPU machines') and older have only the pickled state, ``(op, factor)``."""
    factor = getattr(op, "factor", None)
    if factor is None:
        try:
            state = op.__getstate__()
            factor = state[1] if isinstance(state, tuple) and len(state) == 2 else None
        except (AttributeError, RuntimeError, TypeError):
            return None
    if isinstance(factor, torch.Tensor):
        factor = factor.item()  # one element (torch checks); a CUDA factor syncs once here
    return factor


def _now_ops() -> dict:
    """The one-call path of a CPU all_reduce (ProcessGroupGpucoll.allreduce): gpucoll's op name for each torch
    ReduceOp that means the same on every dtype, keyed by hash(ReduceOp), which torch makes its RedOpType's value:
    the native call reads the op with one hash where Python compared it with each kind (0.13 us each; naming it
    through op_name is 5 us, more than the whole reduction). Empty, and the path off, where the hashes do not tell
    every kind apart (PREMUL_SUM included: taken for a SUM, it would be silently wrong)."""
    ops = {}
    for name, kind in c10d.ReduceOp.RedOpType.__members__.items():
        try:
            ops[name] = c10d.ReduceOp(kind) if name != "PREMUL_SUM" else dist._make_nccl_premul_sum(2.0)
        except (AttributeError, RuntimeError):  # UNUSED, or a torch without the premul maker: nothing is known
            if name != "UNUSED":
                return {}
    try:
        hashes = {hash(op): name for name, op in ops.items()}
    except TypeError:  # a torch whose ReduceOp is not hashable
        return {}
    if len(hashes) != len(ops):
        return {}
    return {h: _OPS[name] for h, name in hashes.items() if name in _OPS and name != "PREMUL_SUM"}


NOW_OPS = _now_ops()


def reals(t: torch.Tensor) -> torch.Tensor:
    """Contiguous `t` flat, a complex one as its pairs of reals."""
    return (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)


def moved(t: torch.Tensor) -> torch.Tensor:
    """A flat view of contiguous `t` in a dtype gpucoll moves: its own where gpucoll knows it, else bytes."""
    flat = reals(t)
    if flat.dtype in REDUCIBLE:
        return flat
    return flat.view(torch.uint8)


def reduction(what: str, op, t: torch.Tensor):
    """(flat contiguous view of `t` to reduce, gpucoll's op name, premul factor or None) for torch's ReduceOp."""
    name = op_name(op)
    if name in _BITWISE:
        raise Unsupported(f"{what}: ReduceOp.{name} is not supported by gpucoll (it reduces with SUM, PRODUCT, "
                          f"MIN, MAX, AVG and PREMUL_SUM)")
    gop = _OPS.get(name)
    if gop is None:
        raise Unsupported(f"{what}: ReduceOp.{name} is not supported by gpucoll")
    if t.is_complex():
        if gop not in ("sum", "avg", "premul_sum"):
            raise Unsupported(f"{what}: ReduceOp.{name} on complex tensors ({t.dtype}) is not defined; complex "
                              f"tensors reduce with SUM, AVG and PREMUL_SUM")
        t = torch.view_as_real(t)
    if t.dtype not in REDUCIBLE and not (t.is_cuda and t.dtype in _FP8):
        raise Unsupported(f"{what}: gpucoll cannot reduce {t.dtype} tensors (ReduceOp.{name}); it reduces "
                          f"{', '.join(str(d).replace('torch.', '') for d in REDUCIBLE)}"
                          + (" and fp8 on CUDA" if _FP8 else "") + "; cast the tensor first")
    factor = None
    if gop == "premul_sum":
        factor = premul_factor(op)
        if factor is None:
            raise Unsupported(f"{what}: this torch version ({torch.__version__}) does not expose "
                              f"ReduceOp.PREMUL_SUM's factor")
        if not t.is_floating_point():
            raise Unsupported(f"{what}: ReduceOp.PREMUL_SUM needs a floating-point tensor; got {t.dtype}")
    return t.reshape(-1), gop, factor


def gpucoll_op(gop: str, factor):
    """What a Communicator takes as `op` for reduction()'s op name and factor."""
    return gop if gop != "premul_sum" else premul_sum(float(factor))
