"""all_to_all: block j of rank i lands as block i on rank j (nccl-tests' alltoall_perf).

Sizes as nccl-tests: the size column is the whole buffer, count the block (size / nranks rounded down to 16
bytes). In place is nccl-tests' too, one buffer for input and output, timed but not checked (nccl-tests does not
support in-place alltoall; gpucoll refuses it, so those columns read N/A).
"""

from __future__ import annotations

from gpucoll.bench.colls import CollTest, Counts, DataContext, Expect, fill, nccl_block, poison, sequence


def byte_counts(count: int, nranks: int, itemsize: int = 1) -> Counts:
    base = nccl_block(count, itemsize, nranks)
    return Counts(send=base * nranks, recv=base * nranks, param=base, send_inplace_offset=0, recv_inplace_offset=0)


def init_data(ctx: DataContext):
    data, n, p = sequence(ctx.dtype, ctx.nranks), ctx.counts.param, ctx.nranks
    poison(ctx.recv)
    fill(ctx.send, data, ctx.rank * p * n)  # block (i -> j) is the sequence at (i * p + j) * n
    return [Expect(ctx.recv[i * n:(i + 1) * n], data, (i * p + ctx.rank) * n) for i in range(p)]


def get_bw(count: int, itemsize: int, sec: float, nranks: int):
    algbw = count * nranks * itemsize / 1.0e9 / sec
    return algbw, algbw * (nranks - 1) / nranks  # the (n-1)/n of the buffer that leaves the rank


def run(comm, send, recv, ctx: DataContext):
    return comm.all_to_all(send, out=recv, algo=ctx.algo)


TEST = CollTest(name="all_to_all", coll_id=5, reduces=False, rooted=False, byte_counts=byte_counts,
                init_data=init_data, get_bw=get_bw, run=run, in_place_checked=False)
