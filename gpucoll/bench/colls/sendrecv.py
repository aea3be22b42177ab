"""sendrecv: a ring of point-to-point transfers, each rank sending its buffer to rank+1 and receiving rank-1's
(nccl-tests' sendrecv_perf), both in one group so they progress together.

In place is nccl-tests' too, one buffer sent from and received into, timed but not checked: the result of
receiving over data still being sent is not defined (nccl-tests reports N/A there as well).
"""

from __future__ import annotations

from gpucoll.bench.colls import CollTest, Counts, DataContext, Expect, fill, poison, sequence


def byte_counts(count: int, nranks: int) -> Counts:
    return Counts(send=count, recv=count, param=count, send_inplace_offset=0, recv_inplace_offset=0)


def init_data(ctx: DataContext):
    data, n = sequence(ctx.dtype, ctx.nranks), ctx.counts.param
    poison(ctx.recv)
    fill(ctx.send, data, ctx.rank * n)
    return [Expect(ctx.recv, data, (ctx.rank - 1) % ctx.nranks * n)]


def get_bw(count: int, itemsize: int, sec: float, nranks: int):
    algbw = count * itemsize / 1.0e9 / sec
    return algbw, algbw  # one link per transfer


def run(comm, send, recv, ctx: DataContext):
    with comm.group():
        comm.send(send, (ctx.rank + 1) % ctx.nranks)
        comm.recv(recv, (ctx.rank - 1) % ctx.nranks)


TEST = CollTest(name="sendrecv", coll_id=-1, reduces=False, rooted=False, byte_counts=byte_counts,
                init_data=init_data, get_bw=get_bw, run=run, in_place_checked=False, min_ranks=2)
