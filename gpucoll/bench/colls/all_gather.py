"""all_gather: every rank ends with all ranks' inputs concatenated in rank order (nccl-tests' all_gather_perf).

Sizes as nccl-tests: the size column is the gathered (receive) buffer, count is the per-rank input (size /
nranks rounded down to 16 bytes). In place the input is this rank's slice of the output buffer.
"""

from __future__ import annotations

from gpucoll.bench.colls import CollTest, Counts, DataContext, Expect, fill, nccl_block, poison, sequence


def byte_counts(count: int, nranks: int, itemsize: int = 1) -> Counts:
    base = nccl_block(count, itemsize, nranks)
    return Counts(send=base, recv=base * nranks, param=base, send_inplace_offset=base, recv_inplace_offset=0)


def init_data(ctx: DataContext):
    data, n = sequence(ctx.dtype, ctx.nranks), ctx.counts.param
    poison(ctx.recv)
    fill(ctx.send, data, ctx.rank * n)  # rank r holds elements [r*n, (r+1)*n) of the sequence
    return [Expect(ctx.recv, data)]


def get_bw(count: int, itemsize: int, sec: float, nranks: int):
    algbw = count * itemsize * nranks / 1.0e9 / sec
    # Each rank receives the (n-1)/n of the result it did not have.
    return algbw, algbw * (nranks - 1) / nranks


def run(comm, send, recv, ctx: DataContext):
    return comm.all_gather(send, out=recv, algo=ctx.algo)


TEST = CollTest(name="all_gather", coll_id=3, reduces=False, rooted=False, byte_counts=byte_counts,
                init_data=init_data, get_bw=get_bw, run=run)
