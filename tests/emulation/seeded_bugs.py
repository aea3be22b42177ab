"""Seeded bugs: deliberate one-line breaks of the custom kernels' indexing, barriers, reductions and memory
ordering, each of which the emulated device must catch. A mutation is applied to a private copy of csrc/, the
virtual-ranks harness (native/vranks_harness.cc) is rebuilt from it and run, and the mutation counts as caught when
the harness reports wrong elements or a timeout, or (for the ordering bugs) ThreadSanitizer reports a data race.

    python tests/emulation/seeded_bugs.py            # every mutation (about 10 minutes on 2 cores)
    python tests/emulation/seeded_bugs.py --list
    python tests/emulation/seeded_bugs.py two_shot_barrier_1_deleted block_slice_one_short

Exit status 0 when every chosen mutation was caught. tests/emulation/test_seeded_bugs.py runs two of them in CI
(one per detector): deleting two_shot's barrier(s, 1) and making a block's slice one element short.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import native_build


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # under csrc/
    old: str
    new: str
    detector: str  # "data": wrong elements in the plain harness; "tsan": a ThreadSanitizer report
    args: tuple = ()
    why: str = ""


MUTATIONS = (
    Mutation("block_slice_one_short", "backends/custom/slices.h",
             "  return Range{chunk.begin + begin, end - begin};",
             "  return Range{chunk.begin + begin, end - begin - (end > begin ? 1 : 0)};",
             "data", ("--ranks=2,3", "--quick"),
             "every block leaves the last element of its slice alone: the sentinel stays there"),
    Mutation("chunk_begin_shifted", "algo/schedule.h",
             "  return count / nchunks * c + (c < count % nchunks ? c : count % nchunks);",
             "  return count / nchunks * c + (c < count % nchunks ? c + 1 : count % nchunks);",
             "data", ("--ranks=3", "--quick"),
             "chunks of a non-divisible count overlap and leave a gap (the host schedules share this function)"),
    Mutation("one_shot_skips_last_rank", "backends/custom/kernels/one_shot.cu", "  src.n = a.nranks;", "  src.n = a.nranks - 1;",
             "data", ("--ranks=2", "--quick", "--algos=oneshot"), "the reduction leaves one rank's input out"),
    Mutation("two_shot_reduces_wrong_chunk", "backends/custom/kernels/two_shot.cu",
             "  const Range mine = block_slice<T>(chunk_range(a.count, P, a.rank));",
             "  const Range mine = block_slice<T>(chunk_range(a.count, P, (a.rank + 1) % P));",
             "data", ("--ranks=3", "--quick", "--algos=twoshot"), "a rank reduces its neighbour's chunk"),
    Mutation("avg_divides_twice", "backends/custom/kernels/schedule_exec.cuh",
             "        block_reduce(dst, src, r.count, op, NoFinish{});",
             "        block_reduce(dst, src, r.count, op, fin);",
             "data", ("--ranks=3", "--quick", "--algos=ring"), "avg's division applied in every step, not once"),
    Mutation("two_shot_barrier_1_deleted", "backends/custom/kernels/two_shot.cu", "  barrier(s, 1);\n", "",
             "tsan", ("--ranks=2", "--tsan", "--algos=twoshot"),
             "the all-gather reads peers' reduced chunks before they are written (RAW)"),
    Mutation("one_shot_barrier_1_deleted", "backends/custom/kernels/one_shot.cu", "  barrier(s, 1);\n", "",
             "tsan", ("--ranks=2", "--tsan", "--algos=oneshot"),
             "a registered in-place rank overwrites its input while peers still read it (WAR)"),
    Mutation("schedule_barrier_numbering", "backends/custom/kernels/schedule_exec.cuh",
             "    if (!last) barrier(s, static_cast<uint32_t>(step + 1));",
             "    if (!last) barrier(s, static_cast<uint32_t>(step));",
             "tsan", ("--ranks=2", "--tsan", "--algos=ring"),
             "the barrier after step 0 reuses barrier 0's number, so it waits for nothing"),
    Mutation("staging_single_half", "backends/custom/kernels/peer_ops.cuh",
             "  return static_cast<char*>(a.bufs.ptr[q]) + (calls & 1u) * a.half_bytes;",
             "  return static_cast<char*>(a.bufs.ptr[q]);",
             "tsan", ("--ranks=2", "--tsan", "--algos=twoshot"),
             "back-to-back calls share one staging half: a call overwrites what a slow peer still reads"),
    Mutation("end_call_relaxed_count", "backends/custom/kernels/peer_sync.cuh",
             "    const uint32_t done = fetch_add_acq_rel(&s.self->blocks_done, 1u);",
             "    const uint32_t done = atomicAdd(&s.self->blocks_done, 1u);",
             "tsan", ("--ranks=2", "--tsan", "--algos=oneshot"),
             "the race ThreadSanitizer found in end_call (fixed): the last block's stores race other blocks"),
)

BY_NAME = {m.name: m for m in MUTATIONS}


def caught(m: Mutation, tree: native_build.Tree) -> tuple[bool, str]:
    """Applies `m` to `tree`, rebuilds, runs; (caught, what was seen)."""
    with tree.mutated(m.path, m.old, m.new):
        tree.build()
        extra = native_build.TSAN_DEVICE if m.detector == "tsan" else ()
        res = tree.run(*m.args, *extra, env=native_build.TSAN_ENV if m.detector == "tsan" else None)
    wrong = [line for line in res.stdout.splitlines() if line.startswith("FAIL")]
    reports = native_build.tsan_reports(res)
    if m.detector == "tsan":
        seen = f"{reports} ThreadSanitizer report(s), {len(wrong)} wrong case(s)"
        return reports > 0 or bool(wrong), seen
    seen = f"{len(wrong)} wrong case(s), exit {res.returncode}" + (f"; first: {wrong[0]}" if wrong else "")
    return res.returncode != 0 and bool(wrong), seen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:32} {m.detector:5} {m.why}")
        return 0
    chosen = [BY_NAME[n] for n in args.names] if args.names else list(MUTATIONS)
    trees = {}
    missed = []
    with tempfile.TemporaryDirectory(prefix="gpucoll-seeded-") as tmp:
        for m in chosen:
            if m.detector not in trees:
                trees[m.detector] = native_build.Tree(Path(tmp) / m.detector, tsan=m.detector == "tsan")
                trees[m.detector].build()  # the unmutated build, shared by every mutation on this tree
            t0 = time.time()
            ok, seen = caught(m, trees[m.detector])
            print(f"{'caught' if ok else 'MISSED'}  {m.name:32} {seen}  ({time.time() - t0:.0f} s)", flush=True)
            if not ok:
                missed.append(m.name)
    print(f"{len(chosen) - len(missed)} of {len(chosen)} seeded bugs caught" + (f"; missed: {missed}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
