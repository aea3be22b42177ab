"""Seeded bugs: deliberate one-line breaks of the custom kernels' indexing, barriers, reductions and memory
ordering, each of which the emulated device must catch. A mutation is applied to a private copy of csrc/, the
virtual-ranks harness (native/vranks_harness.cc) is rebuilt from it and run, and the mutation counts as caught when
the harness reports wrong elements or a timeout, or (for the ordering bugs) ThreadSanitizer reports a data race.

    python tests/emulation/seeded_bugs.py            # every mutation (about 10 minutes on 2 cores)
    python tests/emulation/seeded_bugs.py --list
    python tests/emulation/seeded_bugs.py two_shot_barrier_1_deleted block_slice_one_short
    python tests/emulation/seeded_bugs.py --runs 10 custom_drops_stream_dependency   # a catch rate, 10 seeds

The suite's mutations (detector "suite") break the Python layer instead, where a dropped stream dependency lives: a
copy of the installed gpucoll package (its built extension included) is mutated and put first on PYTHONPATH, and the
GPU tests named run against it on the emulated device, each run with another GPUCOLL_EMU_SEED (the emulator's
stream jitter, on in the GPU suite); the mutation counts as caught in a run when a named test fails. --runs N
reports how many of N runs caught it.

Exit status 0 when every chosen mutation was caught (in every run). tests/emulation/test_seeded_bugs.py runs three of
them in CI (one per detector): deleting two_shot's barrier(s, 1), making a block's slice one element short, and the
custom backend dropping the dependency on the caller's stream.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
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


ROOT = Path(__file__).resolve().parents[2]
# The stream-order tests the suite's mutations must fail (pytest node ids under the repository).
_CUSTOM_STREAM_TEST = "tests/custom/test_custom_gpu.py::test_processes_stream_order_and_async_work"
_NCCL_STREAM_TEST = "tests/nccl/test_nccl_gpu.py::test_collectives[ws2-stream-device_array]"

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
    Mutation("begin_call_barrier_deleted", "backends/custom/kernels/peer_sync.cuh",
             "    if (recording && !a.continuation && blockIdx.x == 0) open_record(rec, a.sig.seq + 1, a.nranks);\n"
             "  }\n  __syncthreads();\n",
             "    if (recording && !a.continuation && blockIdx.x == 0) open_record(rec, a.sig.seq + 1, a.nranks);\n"
             "  }\n",
             "data", ("--ranks=2", "--quick", "--algos=oneshot", "--shuffle=7"),
             "the block reads thread 0's shared `calls` and `skip` before thread 0 wrote them (a missing __syncthreads; "
             "in index order thread 0 always runs first and hides it)"),
    # Memory faults (runtime/access.cc): the emulated device checks every global access of the kernels for bounds
    # and alignment and turns a bad one into CUDA's sticky error, which the harness reports as a failed call.
    Mutation("block_copy_tail_one_past", "backends/custom/kernels/peer_ops.cuh",
             "    for (size_t i = split.head + split.packs * kElems + threadIdx.x; i < count; i += blockDim.x) {",
             "    for (size_t i = split.head + split.packs * kElems + threadIdx.x; i <= count; i += blockDim.x) {",
             "data", ("--ranks=2", "--quick", "--algos=twoshot"),
             "a copy's scalar tail reads (and writes) one element past its slice: right values inside a buffer, "
             "out of bounds at the end of the last slice"),
    Mutation("block_copy_head_one_past", "backends/custom/kernels/peer_ops.cuh",
             "    for (size_t i = threadIdx.x; i < split.head; i += blockDim.x) st_elem(dst + i, ld_cg(src + i));",
             "    for (size_t i = threadIdx.x; i <= split.head; i += blockDim.x) st_elem(dst + i, ld_cg(src + i));",
             "data", ("--ranks=2", "--algos=twoshot", "--dtypes=float32"),
             "a copy's scalar head takes one element more: the body's first element again (same value, no harm) or, "
             "when the whole range is scalar (misaligned input), one element past it: a read past the input's end "
             "that leaves every output right"),
    Mutation("pack_split_ignores_misalignment", "backends/custom/kernels/primitives.cuh",
             "  const size_t head = ((kPackBytes - mis) % kPackBytes) / sizeof(T);",
             "  const size_t head = 0;",
             "data", ("--ranks=2", "--quick", "--algos=twoshot"),
             "16-byte packs start at the range's first element, off their 16-byte boundary when a chunk begins "
             "mid-pack (an x86 CPU loads them anyway)"),
    # The suite's (path under the repository; args: the tests that must fail).
    Mutation("custom_drops_stream_dependency", "gpucoll/backends/custom.py",
             "        return _cuda_buffers.op_stream(self.ordinal, stream, src, dst if dst is not src else None)",
             "        return _cuda_buffers.op_stream(self.ordinal, None, src, dst if dst is not src else None)",
             "suite", (_CUSTOM_STREAM_TEST,),
             "the custom kernels ignore stream=: they run before the caller's fill queued there"),
    Mutation("nccl_drops_stream_dependency", "gpucoll/backends/nccl.py",
             "        s = _cuda_buffers.op_stream(self.ordinal, stream, src, dst if dst is not src else None)",
             "        s = _cuda_buffers.op_stream(self.ordinal, None, src, dst if dst is not src else None)",
             "suite", (_NCCL_STREAM_TEST,),
             "the nccl backend ignores stream=: NCCL runs before the caller's fill queued there"),
)

BY_NAME = {m.name: m for m in MUTATIONS}


def suite_catches(m: Mutation, runs: int = 1, seed0: int = 1) -> tuple[int, str]:
    """A suite mutation against the installed package (an emulated build): (runs that caught it, what was seen)."""
    import gpucoll  # the installed package, its extension built
    from gpucoll._native import _C

    if not _C.build_info().get("cuda_emulated"):
        raise RuntimeError("the suite's mutations run on the emulated device: install with GPUCOLL_CUDA=emulate")
    src = Path(gpucoll.__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="gpucoll-suite-") as tmp:
        pkg = Path(tmp) / "gpucoll"
        shutil.copytree(src, pkg, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        target = Path(tmp) / m.path
        text = target.read_text()
        if text.count(m.old) != 1:
            raise RuntimeError(f"{m.name}: the line to mutate is not in {m.path} exactly once")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH")) if p),
                   PYTHONDONTWRITEBYTECODE="1")
        # Run from the copy's folder: `python -m`/`-c` put the working folder first on sys.path, ahead of PYTHONPATH.
        where = subprocess.run([sys.executable, "-c", "import gpucoll; print(gpucoll.__file__)"], cwd=tmp, env=env,
                               capture_output=True, text=True, timeout=120, check=False).stdout.strip()
        if not where.startswith(str(pkg)):  # else the run would test the unmutated package and "miss"
            raise RuntimeError(f"{m.name}: the mutated copy is not what imports first (gpucoll from {where!r})")
        def run_tests(seed: int):
            env["GPUCOLL_EMU_SEED"] = str(seed)
            res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                                  *(str(ROOT / t) for t in m.args)], cwd=tmp, env=env, capture_output=True, text=True,
                                 timeout=900, check=False)
            summary = (res.stdout.strip().splitlines() or [""])[-1]
            return res.returncode == 1 and " failed" in summary, summary or (res.stderr.strip().splitlines() or [""])[-1]

        failed, summary = run_tests(seed0)  # the control: the copy, not yet mutated, passes
        if failed or " passed" not in summary:
            raise RuntimeError(f"{m.name}: the tests do not pass on the unmutated copy ({summary})")
        target.write_text(text.replace(m.old, m.new))
        caught_in, last = 0, ""
        for run in range(runs):
            failed, last = run_tests(seed0 + run)
            caught_in += failed
        return caught_in, f"{caught_in} of {runs} run(s) failed the tests; last: {last}"


def caught(m: Mutation, tree: native_build.Tree, seeds=()) -> tuple[bool, str]:
    """Applies `m` to `tree`, rebuilds, runs (once per seed of the emulator's thread order when `seeds` are given:
    --shuffle=SEED in place of the mutation's own); (caught in every run, what was seen)."""
    with tree.mutated(m.path, m.old, m.new):
        tree.build()
        extra = native_build.TSAN_DEVICE if m.detector == "tsan" else ()
        env = native_build.TSAN_ENV if m.detector == "tsan" else None
        base = [a for a in m.args if not (seeds and a.startswith("--shuffle="))]
        runs = [tree.run(*base, f"--shuffle={s}", *extra, env=env) for s in seeds] or [tree.run(*m.args, *extra, env=env)]
    hits, seen = 0, ""
    for res in runs:
        wrong = [line for line in res.stdout.splitlines() if line.startswith("FAIL")]
        reports = native_build.tsan_reports(res)
        if m.detector == "tsan":
            hit, seen = reports > 0 or bool(wrong), f"{reports} ThreadSanitizer report(s), {len(wrong)} wrong case(s)"
        else:
            hit = res.returncode != 0 and bool(wrong)
            seen = f"{len(wrong)} wrong case(s), exit {res.returncode}" + (f"; first: {wrong[0]}" if wrong else "")
        hits += hit
    if seeds:
        seen = f"{hits} of {len(runs)} seed(s) caught it; last: {seen}"
    return hits == len(runs), seen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--runs", type=int, default=1,
                   help="runs of each mutation, another seed each (the suite's: stream jitter and thread order; the "
                        "harness's: thread order, --shuffle=1..N)")
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
            if m.detector == "suite":
                t0 = time.time()
                n, seen = suite_catches(m, args.runs)
                ok = n == args.runs
                print(f"{'caught' if ok else 'MISSED'}  {m.name:32} {seen}  ({time.time() - t0:.0f} s)", flush=True)
                if not ok:
                    missed.append(m.name)
                continue
            if m.detector not in trees:
                trees[m.detector] = native_build.Tree(Path(tmp) / m.detector, tsan=m.detector == "tsan")
                trees[m.detector].build()  # the unmutated build, shared by every mutation on this tree
            t0 = time.time()
            ok, seen = caught(m, trees[m.detector], range(1, args.runs + 1) if args.runs > 1 else ())
            print(f"{'caught' if ok else 'MISSED'}  {m.name:32} {seen}  ({time.time() - t0:.0f} s)", flush=True)
            if not ok:
                missed.append(m.name)
    print(f"{len(chosen) - len(missed)} of {len(chosen)} seeded bugs caught" + (f"; missed: {missed}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
