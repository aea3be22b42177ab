"""reduce: root ends with the op over all ranks' inputs; the other ranks' buffers stay as they were
(nccl-tests' reduce_perf, which checks the non-roots' receive buffers too)."""

from __future__ import annotations

from gpucoll.bench.colls import (
    CollTest,
    Counts,
    DataContext,
    Expect,
    fill,
    poison,
    rank_input,
    reduced_input,
    untouched,
)


def byte_counts(count: int, nranks: int) -> Counts:
    return Counts(send=count, recv=count, param=count, send_inplace_offset=0, recv_inplace_offset=0)


def init_data(ctx: DataContext):
    mine = rank_input(ctx.dtype, ctx.op, ctx.rank, ctx.nranks)
    poison(ctx.recv)
    fill(ctx.send, mine)  # in place, send is recv
    if ctx.rank == ctx.root:
        return [Expect(ctx.recv, reduced_input(ctx.dtype, ctx.op, ctx.nranks))]
    if ctx.in_place:
        return [Expect(ctx.recv, mine)]
    return untouched(ctx.recv, ctx.dtype)


def get_bw(count: int, itemsize: int, sec: float, nranks: int):
    algbw = count * itemsize / 1.0e9 / sec
    return algbw, algbw  # a pipelined chain: every byte crosses every link once


def run(comm, send, recv, ctx: DataContext):
    return comm.reduce(send, out=None if ctx.in_place else recv, op=ctx.op, root=ctx.root, algo=ctx.algo)


TEST = CollTest(name="reduce", coll_id=2, reduces=True, rooted=True, byte_counts=byte_counts,
                init_data=init_data, get_bw=get_bw, run=run)
