"""scatter: rank r ends with block r of root's input (nccl-tests' scatter_perf).

Sizes as nccl-tests: the size column is root's input, count the per-rank block (size / nranks rounded down to
16 bytes). gpucoll wants the input array on every rank (only root's is read): non-roots' inputs hold poison. In
place the output is this rank's block of its input buffer.
"""

from __future__ import annotations

from gpucoll.bench.colls import CollTest, Counts, DataContext, Expect, fill, nccl_block, poison, sequence


def byte_counts(count: int, nranks: int, itemsize: int = 1) -> Counts:
    base = nccl_block(count, itemsize, nranks)
    return Counts(send=base * nranks, recv=base, param=base, send_inplace_offset=0, recv_inplace_offset=base)


def init_data(ctx: DataContext):
    data, n = sequence(ctx.dtype, ctx.nranks), ctx.counts.param
    poison(ctx.recv)
    if ctx.rank == ctx.root:
        fill(ctx.send, data)
    else:
        poison(ctx.send)
    return [Expect(ctx.recv, data, ctx.rank * n)]


def get_bw(count: int, itemsize: int, sec: float, nranks: int):
    algbw = count * nranks * itemsize / 1.0e9 / sec
    return algbw, algbw * (nranks - 1) / nranks  # root sends the (n-1)/n it does not keep


def run(comm, send, recv, ctx: DataContext):
    return comm.scatter(send, out=recv, root=ctx.root, algo=ctx.algo)


TEST = CollTest(name="scatter", coll_id=7, reduces=False, rooted=True, byte_counts=byte_counts,
                init_data=init_data, get_bw=get_bw, run=run)
