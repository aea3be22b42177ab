"""reduce_scatter: the op over all ranks' inputs, rank r keeping block r (nccl-tests' reduce_scatter_perf).

Sizes as nccl-tests: the size column is the input, count is the per-rank output block (size / nranks rounded
down to 16 bytes). In place the output is this rank's block of the input buffer.
"""

from __future__ import annotations

from gpucoll.bench.colls import (
    CollTest,
    Counts,
    DataContext,
    Expect,
    fill,
    nccl_block,
    poison,
    rank_input,
    reduced_input,
)


def byte_counts(count: int, nranks: int, itemsize: int = 1) -> Counts:
    base = nccl_block(count, itemsize, nranks)
    return Counts(send=base * nranks, recv=base, param=base, send_inplace_offset=0, recv_inplace_offset=base)


def init_data(ctx: DataContext):
    poison(ctx.recv)
    fill(ctx.send, rank_input(ctx.dtype, ctx.op, ctx.rank, ctx.nranks))
    return [Expect(ctx.recv, reduced_input(ctx.dtype, ctx.op, ctx.nranks), ctx.rank * ctx.counts.param)]


def get_bw(count: int, itemsize: int, sec: float, nranks: int):
    algbw = count * itemsize * nranks / 1.0e9 / sec
    return algbw, algbw * (nranks - 1) / nranks  # each rank sends the (n-1)/n of its input it does not keep


def run(comm, send, recv, ctx: DataContext):
    return comm.reduce_scatter(send, out=recv, op=ctx.op, algo=ctx.algo)


TEST = CollTest(name="reduce_scatter", coll_id=4, reduces=True, rooted=False, byte_counts=byte_counts,
                init_data=init_data, get_bw=get_bw, run=run)
