"""broadcast: every rank ends with root's buffer (nccl-tests' broadcast_perf).

gpucoll's broadcast works in place only. Out of place (nccl-tests: root's sendbuff into every recvbuff) is what a
user of that API writes to get NCCL's semantics: root copies its input into its output, then the output is
broadcast. The copy is part of the timed call, as it is part of NCCL's out-of-place broadcast on the root.
"""

from __future__ import annotations

from gpucoll.bench.colls import CollTest, Counts, DataContext, Expect, fill, poison, sequence


def byte_counts(count: int, nranks: int) -> Counts:
    return Counts(send=count, recv=count, param=count, send_inplace_offset=0, recv_inplace_offset=0)


def init_data(ctx: DataContext):
    data = sequence(ctx.dtype, ctx.nranks)
    poison(ctx.recv)
    if ctx.rank == ctx.root:
        fill(ctx.send, data)  # in place, send is recv
    elif not ctx.in_place:
        poison(ctx.send)  # not read: a backend that reads a non-root's input gets poison
    return [Expect(ctx.recv, data)]


def get_bw(count: int, itemsize: int, sec: float, nranks: int):
    algbw = count * itemsize / 1.0e9 / sec
    # A pipelined chain sends every byte over every link once.
    return algbw, algbw


def run(comm, send, recv, ctx: DataContext):
    if not ctx.in_place and ctx.rank == ctx.root:
        ctx.copy(recv, send)
    return comm.broadcast(recv, root=ctx.root, algo=ctx.algo)


TEST = CollTest(name="broadcast", coll_id=1, reduces=False, rooted=True, byte_counts=byte_counts,
                init_data=init_data, get_bw=get_bw, run=run)
