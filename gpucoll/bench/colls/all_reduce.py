"""all_reduce: every rank ends with the op over all ranks' inputs (nccl-tests' all_reduce_perf)."""

from __future__ import annotations

from gpucoll.bench.colls import CollTest, Counts, DataContext, Expect, fill, poison, rank_input, reduced_input


def byte_counts(count: int, nranks: int) -> Counts:
    return Counts(send=count, recv=count, param=count, send_inplace_offset=0, recv_inplace_offset=0)


def init_data(ctx: DataContext):
    fill(ctx.send, rank_input(ctx.dtype, ctx.op, ctx.rank, ctx.nranks))  # in place, send is recv
    if not ctx.in_place:
        poison(ctx.recv)
    return [Expect(ctx.recv, reduced_input(ctx.dtype, ctx.op, ctx.nranks))]


def get_bw(count: int, itemsize: int, sec: float, nranks: int):
    algbw = count * itemsize / 1.0e9 / sec
    # Each rank's bytes cross the busiest link 2(n-1)/n times in a ring reduce-scatter + all-gather.
    return algbw, algbw * (2.0 * (nranks - 1) / nranks)


def run(comm, send, recv, ctx: DataContext):
    if ctx.compress:
        return comm.all_reduce(send, out=None if ctx.in_place else recv, op=ctx.op, compress=ctx.compress)
    return comm.all_reduce(send, out=None if ctx.in_place else recv, op=ctx.op, algo=ctx.algo)


TEST = CollTest(name="all_reduce", coll_id=0, reduces=True, rooted=False, byte_counts=byte_counts,
                init_data=init_data, get_bw=get_bw, run=run)
