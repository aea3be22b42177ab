"""gather: root ends with all ranks' inputs concatenated in rank order; the other ranks' receive buffers stay
as they were (nccl-tests' gather_perf, which checks them too).

Sizes as nccl-tests: the size column is root's receive buffer, count the per-rank input (size / nranks rounded
down to 16 bytes). In place the input is this rank's slice of its receive buffer, on every rank.
"""

from __future__ import annotations

from gpucoll.bench.colls import CollTest, Counts, DataContext, Expect, fill, nccl_block, poison, sequence, untouched


def byte_counts(count: int, nranks: int, itemsize: int = 1) -> Counts:
    base = nccl_block(count, itemsize, nranks)
    return Counts(send=base, recv=base * nranks, param=base, send_inplace_offset=base, recv_inplace_offset=0)


def init_data(ctx: DataContext):
    data, n = sequence(ctx.dtype, ctx.nranks), ctx.counts.param
    poison(ctx.recv)
    fill(ctx.send, data, ctx.rank * n)
    if ctx.rank == ctx.root:
        return [Expect(ctx.recv, data)]
    return untouched(ctx.recv, ctx.dtype, (ctx.rank * n, n, data, ctx.rank * n) if ctx.in_place else None)


def get_bw(count: int, itemsize: int, sec: float, nranks: int):
    algbw = count * nranks * itemsize / 1.0e9 / sec
    return algbw, algbw * (nranks - 1) / nranks  # root receives the (n-1)/n it did not have


def run(comm, send, recv, ctx: DataContext):
    # Every rank passes its receive buffer, as nccl-tests does; gpucoll writes it on root only.
    return comm.gather(send, out=recv, root=ctx.root, algo=ctx.algo)


TEST = CollTest(name="gather", coll_id=6, reduces=False, rooted=True, byte_counts=byte_counts,
                init_data=init_data, get_bw=get_bw, run=run)
