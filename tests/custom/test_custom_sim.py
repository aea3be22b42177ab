"""A host simulation of the custom allreduce kernels' flag protocol (csrc/backends/custom/kernels/{one_shot,two_shot,ring,tree}.cu,
peer_sync.cuh), run on the CPU with every (rank, block) as an interleaved process, for the CPU-only suite.

What it checks: the kernels' *logic* - which barrier orders which read after which write, what a rank one call
ahead may overwrite (staging halves by call parity, registered inputs, in-place outputs), whether grids that change
size from call to call deadlock or read stale data - under many random interleavings with sequentially consistent
memory. Which block touches which elements is not a Python copy: it comes from the kernels' own slice arithmetic
(backends/custom/slices.h, bound as _C.custom_slice), and ring and tree run the real schedules of csrc/algo through
_C.schedule_ops, grouped the way schedule_exec.cuh groups them. The kernels themselves, with their real memory
ordering, run on gpucoll's emulated CUDA device (tests/custom/test_custom_gpu.py, tests/emulation/: bit-exact results,
ThreadSanitizer, seeded bugs).

Values: element e of rank q is (q + 1) * 1000 + e, distinct per element and rank, so a reduced element equals its
expected sum only if every rank contributed exactly its own element e (a shifted or rotated read changes it). Every
peer read also checks the generation (call number) of what it reads: data of an earlier call, or of a later call
that overwrote it too early, fails with the rank, block, call and element.
"""

from __future__ import annotations

import random

import pytest

from gpucoll import _C

ALL_REDUCE = 0
STRIDE = 64  # kBarrierStride


# -- the kernels' slice arithmetic (backends/custom/slices.h, through the binding) -------------------------------

def slice_elems(count: int, nchunks: int, c: int, nblocks: int, b: int, elems: int) -> range:
    begin, n = _C.custom_slice(count, nchunks, c, nblocks, b, elems)
    return range(begin, begin + n)


def value(rank: int, e: int) -> int:
    return (rank + 1) * 1000 + e


@pytest.mark.parametrize("elems", (1, 2, 4, 8))  # 16-byte packs of f64/i64, f32/i32, f16/bf16 (and scalar)
@pytest.mark.parametrize("nchunks", (1, 2, 3, 4, 8))
def test_slices_partition_every_chunk(nchunks, elems):
    for count in list(range(40)) + [127, 1000, 4099]:
        for nblocks in (1, 2, 3, 7, 64):
            seen = []
            for c in range(nchunks):
                cb, cn = _C.custom_slice(count, nchunks, c, 1, 0, 1)  # one block of unit packs: the whole chunk
                mine = []
                for b in range(nblocks):
                    begin, n = _C.custom_slice(count, nchunks, c, nblocks, b, elems)
                    assert n >= 0 and cb <= begin and begin + n <= cb + cn
                    # Slices start on a pack boundary relative to the chunk: pointers that agree on the chunk's
                    # alignment agree on every slice's, so pack_split finds the same head on every source.
                    assert n == 0 or (begin - cb) % elems == 0
                    mine += range(begin, begin + n)
                assert mine == list(range(cb, cb + cn)), (count, nchunks, c, nblocks)
                seen += mine
            assert seen == list(range(count))


def test_chunks_are_balanced_and_cover_small_counts():
    for P in (2, 3, 4, 8):
        for count in range(3 * P):
            sizes = [_C.custom_slice(count, P, c, 1, 0, 1)[1] for c in range(P)]
            assert sum(sizes) == count and max(sizes) - min(sizes) <= 1


# -- the simulated machine -------------------------------------------------------------------------------------------

class Race(AssertionError):
    pass


class Machine:
    """Memory of P ranks: staging halves, user inputs/outputs, signal areas; and the kernels as generators."""

    def __init__(self, P, count, algo, elems, registered=False, in_place=False, hold_fix=True):
        self.P, self.count, self.algo, self.elems = P, count, algo, elems
        self.registered, self.in_place, self.hold_fix = registered, in_place, hold_fix
        self.stage = [[[None] * count for _ in range(2)] for _ in range(P)]  # [rank][half][elem] = (call, value)
        self.inp = [[None] * count for _ in range(P)]
        self.out = self.inp if in_place else [[None] * count for _ in range(P)]
        self.flag = [[[0] * P for _ in range(_C.CUSTOM_MAX_BLOCKS)] for _ in range(P)]  # [rank][block][writer]
        self.calls = [0] * P
        self.blocks_done = [0] * P
        if algo in ("ring", "tree"):
            name = {"ring": "ring", "tree": "dbt"}[algo]
            self.sched = [_C.schedule_ops(name, ALL_REDUCE, P, 0, 0, r) for r in range(P)]

    # memory access with generation checks
    def read(self, where, n, who):
        gen, value = where
        if gen != n:
            raise Race(f"{who}: read data of call {gen} during call {n}")
        return value

    # peer_sync.cuh
    def barrier(self, r, b, n, k):
        value = n * STRIDE + k + 1
        for q in range(self.P):  # thread q: store into rank q's flag[b][r], then spin on our flag[b][q]
            self.flag[q][b][r] = value
            yield True
        for q in range(self.P):
            while self.flag[r][b][q] < value:
                yield False
            yield True

    def end_call(self, r, nblocks):
        self.blocks_done[r] += 1
        if self.blocks_done[r] == nblocks:
            self.blocks_done[r] = 0
            self.calls[r] += 1

    # the kernels, one block each
    def block(self, r, b, B, n):
        assert self.calls[r] == n, "begin_call read the wrong call number"
        h = n & 1
        run = {"oneshot": self.one_shot, "twoshot": self.two_shot}.get(self.algo, self.schedule)
        yield from run(r, b, B, n, h)
        self.end_call(r, B)

    def src(self, q, h, e, n, who):
        if self.registered and self.algo in ("oneshot", "twoshot"):
            return self.read(self.inp[q][e], n, who)
        return self.read(self.stage[q][h][e], n, who)

    def stage_in(self, r, b, B, n, h, nchunks):
        for c in range(nchunks):
            for e in slice_elems(self.count, nchunks, c, B, b, self.elems):
                self.stage[r][h][e] = (n, self.read(self.inp[r][e], n, f"rank {r} staging"))
                yield True

    def one_shot(self, r, b, B, n, h):
        staged = not self.registered
        if staged:
            yield from self.stage_in(r, b, B, n, h, 1)
        yield from self.barrier(r, b, n, 0)
        hold = not staged and self.in_place and self.hold_fix
        elems = slice_elems(self.count, 1, 0, B, b, self.elems)
        dst = self.stage[r][h] if hold else self.out[r]
        for e in elems:
            total = sum(self.src(q, h, e, n, f"rank {r} block {b} call {n} elem {e}") for q in range(self.P))
            dst[e] = (n, total)
            yield True
        yield from self.barrier(r, b, n, 1)
        if hold:
            for e in elems:
                self.out[r][e] = self.stage[r][h][e]
                yield True

    def two_shot(self, r, b, B, n, h):
        P = self.P
        if not self.registered:
            yield from self.stage_in(r, b, B, n, h, P)
        yield from self.barrier(r, b, n, 0)
        for e in slice_elems(self.count, P, r, B, b, self.elems):
            total = sum(self.src(q, h, e, n, f"rank {r} block {b} call {n} elem {e}") for q in range(P))
            self.stage[r][h][e] = (n, total)
            yield True
        yield from self.barrier(r, b, n, 1)
        for i in range(P):
            q = (r + 1 + i) % P
            for e in slice_elems(self.count, P, q, B, b, self.elems):
                self.out[r][e] = (n, self.read(self.stage[q][h][e], n, f"rank {r} gathers rank {q} elem {e}"))
                yield True

    def schedule(self, r, b, B, n, h):
        sched = self.sched[r]
        nchunks = sched["nchunks"]
        yield from self.stage_in(r, b, B, n, h, nchunks)
        yield from self.barrier(r, b, n, 0)
        work = self.stage[r][h]
        steps = sched["steps"]
        for t, ops in enumerate(steps):
            i = 0
            while i < len(ops):  # schedule_exec.cuh's grouping: a head, then reduces into the same chunk
                _peer, src_chunk, dst_chunk, action, space = ops[i]
                assert src_chunk == dst_chunk and space == "work"
                j = i + 1
                while j < len(ops) and ops[j][3] == "reduce" and ops[j][2] == dst_chunk and ops[j][1] == src_chunk:
                    j += 1
                for e in slice_elems(self.count, nchunks, dst_chunk, B, b, self.elems):
                    who = f"rank {r} block {b} call {n} step {t} elem {e}"
                    acc = self.read(work[e], n, who) if action == "reduce" else 0
                    acc += sum(self.read(self.stage[ops[k][0]][h][e], n, who) for k in range(i, j))
                    work[e] = (n, acc)
                    yield True
                i = j
            if t + 1 < len(steps):
                yield from self.barrier(r, b, n, t + 1)
        for c in range(nchunks):
            for e in slice_elems(self.count, nchunks, c, B, b, self.elems):
                self.out[r][e] = work[e]
                yield True


def simulate(P, algo, grids, seed, count=13, elems=2, **kw) -> Machine:
    """len(grids) back-to-back calls (grids[n] blocks in call n) on every rank, interleaved at random; each rank's
    next kernel starts only when its previous one finished (one stream per rank), and its user input for call n
    is written then (stream order), so a peer still reading call n-1's input is caught."""
    m = Machine(P, count, algo, elems, **kw)
    rng = random.Random(seed)
    nxt = [0] * P  # next call per rank
    live = {}  # (rank, block) -> generator
    idle = 0

    def start(r):
        n = nxt[r]
        nxt[r] += 1
        for e in range(count):
            m.inp[r][e] = (n, value(r, e))
        for b in range(grids[n]):
            live[(r, b)] = m.block(r, b, grids[n], n)

    def check_call(r, n):
        for e in range(count):
            want = sum(value(q, e) for q in range(P))
            gen, got = m.out[r][e]
            assert (gen, got) == (n, want), f"{algo} P={P}: rank {r} call {n} elem {e}: {(gen, got)}, want {want}"

    for r in range(P):
        start(r)
    while live:
        key = rng.choice(list(live))
        try:
            progressed = next(live[key])
        except StopIteration:
            del live[key]
            r = key[0]
            if not any(k[0] == r for k in live):
                check_call(r, nxt[r] - 1)
                if nxt[r] < len(grids):
                    start(r)
            progressed = True
        idle = 0 if progressed else idle + 1
        assert idle < 200 * (len(live) + 1), f"{algo} P={P}: deadlock with {sorted(live)} waiting"
    assert m.calls == [len(grids)] * P
    return m


GRIDS = [1, 3, 2, 4, 1, 4, 3]  # the grid changes every call: rows of flags go stale and come back


@pytest.mark.parametrize("algo", ("oneshot", "twoshot", "ring", "tree"))
@pytest.mark.parametrize("P", (1, 2, 3, 4))
def test_back_to_back_calls_with_changing_grids(P, algo):
    for seed in range(6):
        simulate(P, algo, GRIDS, seed)


@pytest.mark.parametrize("algo", ("oneshot", "twoshot", "ring", "tree"))
def test_eight_ranks(algo):
    simulate(8, algo, [2, 1, 3], seed=1, count=11, elems=1)


@pytest.mark.parametrize("count", (0, 1, 2, 5))
@pytest.mark.parametrize("algo", ("oneshot", "twoshot", "ring", "tree"))
def test_counts_smaller_than_ranks_and_blocks(algo, count):
    for seed in range(3):
        simulate(4, algo, [4, 3, 4], seed, count=count, elems=4)


@pytest.mark.parametrize("in_place", (False, True))
@pytest.mark.parametrize("algo", ("oneshot", "twoshot"))
def test_registered_inputs(algo, in_place):
    for P in (2, 3, 4):
        for seed in range(6):
            simulate(P, algo, GRIDS, seed, registered=True, in_place=in_place)


@pytest.mark.parametrize("algo", ("oneshot", "twoshot", "ring", "tree"))
def test_in_place_staged(algo):
    for seed in range(4):
        simulate(3, algo, GRIDS, seed, in_place=True)


def test_the_simulation_catches_a_registered_in_place_one_shot_writing_out_early():
    # The bug the hold path of one_shot.cu fixes: a rank writes its reduced slice over its own registered input
    # while a slower peer's block still has to read it.
    caught = 0
    for seed in range(40):
        try:
            simulate(3, "oneshot", GRIDS, seed, registered=True, in_place=True, hold_fix=False)
        except AssertionError:  # a Race, or the peer summed our already reduced value
            caught += 1
    assert caught > 0


def test_32_bit_epochs_would_have_let_a_stale_row_through():
    # Why the flags are 64-bit: a row last written 2^25 calls ago, compared as the old signed 32-bit difference,
    # looks AHEAD of the value waited for; compared as 64-bit integers it is behind, as it must be.
    last_call, now_call = 5, 5 + (1 << 25) + 1
    stale, value = last_call * STRIDE + 1, now_call * STRIDE + 1

    def signed32(x: int) -> int:
        x &= 0xFFFFFFFF
        return x - (1 << 32) if x >= 1 << 31 else x

    assert signed32(stale - value) >= 0  # the old wait would have passed
    assert stale < value  # the 64-bit wait does not


def test_a_shifted_read_is_caught():
    # With one value per rank (the old 1 << q) every element of a rank looked alike, so reading a peer's element
    # e + 1 instead of e passed; with a distinct value per element it cannot.
    class Shifted(Machine):
        def src(self, q, h, e, n, who):
            return super().src(q, h, min(e + 1, self.count - 1), n, who)

    original = globals()["Machine"]
    globals()["Machine"] = Shifted
    try:
        with pytest.raises(AssertionError, match="want"):
            simulate(3, "oneshot", [1, 2], seed=0, count=13)
    finally:
        globals()["Machine"] = original
