"""The body of .ci/gpu (see that script for the command line). Runs the phases a GPU runner checks, each step under
its own deadline inside one budget, and writes what happened to --out:

    summary.json   phases, pass/fail/skip counts, the first failures with their tracebacks, skip reasons, what the
                   budget trimmed, the figures, the GPU, driver, NCCL, torch and CuPy versions (.ci/gpu_summary.schema.json)
    junit.xml      every test step's JUnit XML, merged
    build.log, test.log, sanitize.log, bench.log
    bench.json, bench.png   the figures' rows (gpucoll-bench --json) and their plot

Budget: the steps run in priority order (build; the custom kernels; NCCL; torch; CuPy; graphs, the watchdog,
groups and elasticity; the sanitizer; the figures). Before each step the lowest-priority steps that no longer fit
(every kept step's minimum share) are dropped, and the step gets its minimum plus its weight's part of what is
left over (share()): a step cannot starve the next ones, and one that ends early or overruns (tests already
running finish) moves the surplus or the cost along, so a cost always lands on the lowest priority. Tests that would
start past a step's deadline skip with a reason (tests/conftest.py --deadline) and are counted as trimmed, a step
whose share is gone is trimmed whole, and a step that overruns its deadline by its grace is killed and fails.

CUDA MPS: processes that share one GPU without it time-slice (4.5 ms a call on an H200), which makes the
figures of ranks in processes meaningless (28 us a call under MPS, 2026-11-28). Where nvidia-cuda-mps-control
exists and no daemon runs, the bench phase runs under a daemon of this run's own (pipe and log folders in
--out/.mps), stopped at the end (and before the sanitizer, which does not run MPS clients). --mps all runs the tests
under it too: faster process tests, but on 2026-11-27 (before the custom backend capped its grid by the ranks on
a GPU) process tests under MPS stalled, and that is not rerun yet; --mps off uses none.

Written for Python 3.9+ and only the standard library: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_summary  # (.ci/ is not a package: its folder went on sys.path above)

PHASES = ("build", "test", "sanitize", "bench")
DEFAULT_BUDGET = 540.0  # 9 minutes: a 15-minute GPU loan with room for the machine's start and one rerun
OVER_BUDGET = "not started: past the time budget of this run"  # tests/conftest.py's reason

# Test steps in priority order. Each run is (pytest arguments, -k expression or None). Graphs, the watchdog,
# aborts, groups and elasticity are their own (last) step wherever their tests live; CuPy is its own step too.
_LATE = "graph or watchdog or abort or missing or times_out or split or shrink or subgroup or elastic"
_STEP_FILES = {
    "custom": ["tests/custom/test_custom_gpu.py", "tests/custom/test_custom_call_check.py"],
    "nccl": ["tests/nccl/test_nccl_gpu.py", "tests/nccl/test_nccl_call_check.py", "tests/nccl/test_nccl_emulated.py"],
    "torch": ["tests/torch_backend/test_torch_backend_gpu.py", "tests/torch_backend/test_torch_modern_gpu.py"],
}
_OWNED = [f for files in _STEP_FILES.values() for f in files]
# The emulated device is two CPU cores running every rank's every block: there each step takes a slice that shows
# the script and the step work (the whole GPU suite runs in .ci/run's `pytest -m gpu`).
_EMU_K = {
    "custom": "virtual_every_kernel_dtype_op_size and 2-device or processes_on_one_gpu and 2-device or older_than",
    "nccl": "ws2 and reduce/float32/sum-device or ws2-move/int32-device or old_nccl",
    "torch": None,
    "cupy": None,
    "late": "split_and_subgroup and custom or graph_replays and 2 or ws2_watchdog or auto_is_the_host",
}


# The weight of a step: about what it takes whole on one GPU with 8 pytest workers (seconds; the 2026-11-28 H200 run
# needed more than 250 s for the custom kernels' step alone), which splits a short budget's surplus.
_WEIGHTS = {"custom": 300, "nccl": 120, "torch": 40, "cupy": 40, "late": 200}
_SANITIZE_MIN, _BENCH_MIN = 40, 25  # seconds a tail phase needs to start at all
_SANITIZE_WEIGHT, _BENCH_WEIGHT = 60, 60


def share(left: float, minimums: list, weights: list) -> tuple:
    """(how many of the remaining steps still fit, the first one's share): the lowest-priority steps go until the
    rest's minimums fit in `left`; the first then gets its minimum plus its weight's part of the surplus."""
    keep = len(minimums)
    while keep and sum(minimums[:keep]) > left:
        keep -= 1
    if keep == 0:
        return 0, max(left, 0.0)
    surplus = left - sum(minimums[:keep])
    return keep, minimums[0] + surplus * weights[0] / max(sum(weights[:keep]), 1e-9)


def _steps(emulated: bool):
    """[(name, title, runs, minimum share in seconds, grace in seconds)]."""
    def k(name, expr):
        emu = _EMU_K.get(name) if emulated else None
        if emu:
            return f"({expr}) and ({emu})" if expr else emu
        return expr

    return [
        ("custom", "the custom kernels (processes and virtual ranks, P = 2 ... 8)",
         [(_STEP_FILES["custom"], k("custom", f"not cupy and not ({_LATE}) and not sanitizers"))], 30, 120),
        ("nccl", "the NCCL communicator (2 and 3 ranks on one GPU)",
         [(_STEP_FILES["nccl"], k("nccl", f"not cupy and not ({_LATE})"))], 25, 90),
        ("torch", "the torch backend and the modern stack on CUDA tensors",
         [(_STEP_FILES["torch"], k("torch", f"not cupy and not ({_LATE})"))], 20, 90),
        ("cupy", "CuPy arrays", [(_OWNED, k("cupy", "cupy"))], 15, 60),
        ("late", "graphs, the watchdog, groups and elasticity, and every other GPU test",
         [(_OWNED, k("late", f"({_LATE}) and not cupy and not sanitizers")),
          (["tests/", "--ignore=tests/emulation"] + [f"--ignore={f}" for f in _OWNED], k("late", None))], 20, 120),
    ]


# -- running commands -------------------------------------------------------------------------------------------------

def run(cmd, log: Path, timeout: float, env=None, title: str = ""):
    """Runs `cmd` with stdout and stderr appended to `log`; (exit code or None on timeout, seconds, output)."""
    t0 = time.time()
    with open(log, "a") as f:
        f.write(f"\n===== {title or ' '.join(map(str, cmd))}\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            rc = None
        f.write(out or "")
        f.write(f"\n===== exit {rc if rc is not None else 'timeout'} after {time.time() - t0:.1f} s\n")
    return rc, time.time() - t0, out or ""


def py(code: str, timeout: float = 120.0, env=None) -> dict:
    """Runs Python `code` (which prints one JSON object last) in the environment under test."""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": (res.stderr or res.stdout).strip()[-2000:] or f"exit {res.returncode}"}
    return json.loads(lines[-1])


_PROBE = """
import json
from gpucoll import _C, _nccl
b, p = dict(_C.build_info()), dict(_C.cuda_probe())
n = {}
try:
    n = dict(_nccl.load())
except Exception as e:
    n = {"error": str(e)}
print(json.dumps({"build": {k: v for k, v in b.items() if isinstance(v, (str, int, float, bool))},
                  "probe": p, "nccl": {k: n.get(k) for k in ("version", "version_string", "path", "error")}},
                 default=str))
"""


# -- the machine ------------------------------------------------------------------------------------------------------

def gpus() -> tuple:
    """([{name, driver, compute_capability, memory_mib}], why none)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return [], "nvidia-smi is not on PATH"
    try:
        res = subprocess.run([smi, "--query-gpu=name,driver_version,compute_cap,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60,
                             check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return [], f"nvidia-smi failed: {e}"
    rows = [[c.strip() for c in ln.split(",")] for ln in res.stdout.splitlines() if ln.strip()]
    if res.returncode != 0 or not rows:
        return [], f"nvidia-smi lists no GPU ({(res.stderr or res.stdout).strip()[:200] or 'exit ' + str(res.returncode)})"
    return [{"name": r[0], "driver": r[1], "compute_capability": r[2],
             "memory_mib": int(float(r[3])) if len(r) > 3 and re.match(r"^[\d.]+$", r[3]) else None}
            for r in rows], ""


def packages() -> dict:
    code = ("import importlib.metadata as m, json\nout = {}\n"
            "for n in ('torch', 'cupy-cuda13x', 'cupy-cuda12x', 'nvidia-nccl-cu13', 'nvidia-nccl-cu12', 'numpy',"
            " 'pytest', 'pytest-xdist'):\n"
            "    try:\n        out[n] = m.version(n)\n    except m.PackageNotFoundError:\n        pass\n"
            "print(json.dumps(out))")
    return py(code, timeout=60)


# -- phases -----------------------------------------------------------------------------------------------------------

class Check:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        for name in ("build.log", "test.log", "sanitize.log", "bench.log", "junit.xml", "bench.json", "bench.png",
                     "summary.json"):
            (self.out / name).unlink(missing_ok=True)
        self.t0 = time.time()
        self.end = self.t0 + args.budget
        self.emulated = args.emulated
        self.summary = {
            "schema": gpu_summary.SCHEMA_ID, "mode": "emulated" if self.emulated else "gpu",
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": args.budget, "phases_requested": list(args.phases), "status": "running", "exit_code": None,
            "duration_s": None, "machine": {}, "phases": {}, "trimmed": [], "files": [],
        }
        self.junit_parts = []
        self.mps_env = {}  # CUDA_MPS_* of this run's daemon while it runs
        self.skips = {}  # skip reason -> how many tests gave it

    def left(self) -> float:
        return self.end - time.time()

    def env(self, **extra) -> dict:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.pop("PYTEST_ADDOPTS", None)  # .ci/run's --require-deps is for the CPU suite
        env.update(self.mps_env)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    # CUDA MPS (see the module docstring)
    def mps_start(self, phase: str) -> None:
        m = self.summary["machine"]
        wanted = self.args.mps == "all" or (self.args.mps == "bench" and phase == "bench")
        if self.mps_env or self.emulated or not wanted or m.get("mps", "").startswith("not used"):
            return
        ctl = shutil.which("nvidia-cuda-mps-control")
        if ctl is None:
            m["mps"] = "not used: nvidia-cuda-mps-control is not on PATH"
            return
        if os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control")):
            m["mps"] = "not used: a daemon of the machine's own runs (its clients are used as they are)"
            return
        base = self.out / ".mps"
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(base / "log")}
        for d in env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        try:
            res = subprocess.run([ctl, "-d"], env=dict(os.environ, **env), capture_output=True, text=True,
                                 timeout=30, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            m["mps"] = f"not used: nvidia-cuda-mps-control -d failed: {e}"
            return
        if res.returncode != 0:
            m["mps"] = f"not used: nvidia-cuda-mps-control -d exit {res.returncode}: {(res.stderr or res.stdout)[:300]}"
            return
        self.mps_env = env
        m["mps"] = f"a daemon of this run's own ({'tests and figures' if self.args.mps == 'all' else 'figures'})"

    def mps_stop(self) -> None:
        if not self.mps_env:
            return
        env = dict(os.environ, **self.mps_env)
        self.mps_env = {}
        ctl = shutil.which("nvidia-cuda-mps-control")
        try:
            subprocess.run([ctl], input="quit\n", env=env, capture_output=True, text=True,
                           timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
        # quit returns at once; the server leaves once its clients have: wait for the pipe to go (bounded)
        pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "control"
        for _ in range(50):
            if not pipe.exists():
                break
            time.sleep(0.1)

    # machine
    def preflight(self) -> None:
        m = self.summary["machine"]
        m.update({"python": platform.python_version(), "cpus": os.cpu_count(), "hostname": platform.node(),
                  "platform": platform.platform()})
        found, why = gpus()
        m["gpus"] = found
        if not self.emulated and not found:
            self.fail_fast(f"no NVIDIA GPU here: {why} (run .ci/gpu on a GPU machine, or .ci/gpu --emulated)")

    def fail_fast(self, line: str) -> None:
        """Exit 2 with one line: no GPU, or a build that does not see it (summary.json says the same)."""
        self.summary.update(status="no-gpu", exit_code=2, reason=line)
        self.finish(2, quiet=True)
        print(f".ci/gpu: {line}", flush=True)
        sys.exit(2)

    def probe(self) -> dict:
        info = py(_PROBE, env=self.env())
        m = self.summary["machine"]
        if "error" in info:
            return info
        m["cuda"] = {k: info["probe"].get(k) for k in ("driver_version_string", "runtime_version_string",
                                                        "device_count", "emulated", "reason")}
        m["nccl"] = info["nccl"].get("version_string") or info["nccl"].get("error")
        m["build"] = {k: info["build"].get(k) for k in ("cuda_built", "cuda_emulated", "cuda_archs", "version")
                      if k in info["build"]}
        m["packages"] = packages()
        return info

    def build(self) -> bool:
        ph = self.summary["phases"]["build"] = {"status": "running"}
        mode = "emulate" if self.emulated else "on"
        extra = {"GPUCOLL_CUDA": mode, "CMAKE_BUILD_PARALLEL_LEVEL": os.cpu_count() or 2}
        archs = sorted({g["compute_capability"].replace(".", "") for g in self.summary["machine"]["gpus"]})
        if not self.emulated and archs:
            extra["GPUCOLL_CUDA_ARCHS"] = ";".join(archs)  # only the GPU that is here
        cmd = [sys.executable, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "-e", "."]
        ph["command"] = " ".join(f"{k}={v}" for k, v in extra.items()) + " " + " ".join(cmd[1:])
        rc, secs, out = run(cmd, self.out / "build.log", timeout=max(60.0, self.left()), env=self.env(**extra),
                            title="build")
        ph.update(seconds=round(secs, 1), warnings=len(re.findall(r"\bwarning:", out)))
        if rc != 0:
            tail = [ln for ln in out.splitlines() if re.search(r"error|Error|ERROR", ln)][-5:]
            ph.update(status="failed", reason=f"the build failed (exit {rc}): " + " | ".join(tail)[-1500:])
            return False
        info = self.probe()
        if "error" in info:
            ph.update(status="failed", reason=f"gpucoll._C does not import after the build: {info['error'][-800:]}")
            return False
        built = info["build"]
        if not built.get("cuda_built") or bool(built.get("cuda_emulated")) != self.emulated:
            ph.update(status="failed", reason=f"the build does not see CUDA (GPUCOLL_CUDA={mode}): {built}")
            self.fail_fast(ph["reason"])
        if not info["probe"].get("device_count"):
            ph.update(status="failed", reason=f"gpucoll sees no CUDA device: {info['probe'].get('reason')}")
            self.fail_fast(ph["reason"])
        ph["status"] = "passed"
        return True

    def test(self) -> None:
        ph = self.summary["phases"]["test"] = {"status": "running", "steps": [], "counts": {}, "failures": [],
                                               "skip_reasons": []}
        t0 = time.time()
        steps = _steps(self.emulated)
        # Every step's minimum, then the later phases' (lower priority); re-planned before each step (share()).
        tail_min, tail_w = self.after_tests()
        minimums = [s[3] for s in steps] + tail_min
        weights = [_WEIGHTS[s[0]] for s in steps] + tail_w
        workers = self.workers()
        trimmed = False
        for i, (name, title, runs, minimum, grace) in enumerate(steps):
            keep, mine = share(self.left(), minimums[i:], weights[i:])
            entry = {"name": name, "title": title, "status": "running", "seconds": 0.0,
                     "counts": {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "trimmed": 0}}
            ph["steps"].append(entry)
            if trimmed or keep == 0:  # nothing runs after a trimmed step: priority order holds
                trimmed = True
                entry.update(status="trimmed", reason=f"{max(self.left(), 0):.0f} s of the budget left after the "
                                                      f"steps before it (needs {minimum} s)")
                self.summary["trimmed"].append(f"test step {name}: {entry['reason']}")
                continue
            deadline = time.time() + mine
            entry["share_s"] = round(mine, 1)
            for j, (files, kexpr) in enumerate(runs):
                xml = self.out / f".junit-{name}-{j}.xml"
                cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rN",
                       f"--junitxml={xml}", f"--deadline={deadline:.0f}", *files]
                if kexpr:
                    cmd += ["-k", kexpr]
                if workers > 1:
                    cmd += ["-n", str(workers)]
                rc, secs, out = run(cmd, self.out / "test.log", timeout=deadline - time.time() + grace,
                                    env=self.env(), title=f"test step {name} ({title})")
                entry["seconds"] = round(entry["seconds"] + secs, 1)
                self.collect(entry, xml, rc, out)
            if entry["status"] == "running":
                entry["status"] = "failed" if entry["counts"]["failed"] + entry["counts"]["errors"] else "passed"
        ph["seconds"] = round(time.time() - t0, 1)
        for key in ("passed", "failed", "errors", "skipped", "trimmed"):
            ph["counts"][key] = sum(s["counts"][key] for s in ph["steps"])
        ph["skip_reasons"] = sorted(({"reason": r, "count": c} for r, c in self.skips.items()),
                                    key=lambda d: -d["count"])[:40]
        ran = [s for s in ph["steps"] if s["status"] != "trimmed"]
        ph["status"] = ("failed" if any(s["status"] == "failed" for s in ran) else
                        "passed" if ran else "trimmed")

    def collect(self, entry: dict, xml: Path, rc, out: str) -> None:
        if rc is None:
            entry["status"] = "failed"
            entry["reason"] = "killed: it ran past its deadline and grace (a hang?)"
            self.summary["phases"]["test"]["failures"].append(
                {"test": f"step {entry['name']}", "step": entry["name"], "message": entry["reason"],
                 "text": out[-6000:]})
        if not xml.exists():
            if rc not in (None, 0, 5):
                entry["status"] = "failed"
                entry.setdefault("reason", f"pytest exited {rc} without a report: {out[-1500:]}")
            return
        self.junit_parts.append(xml)
        failures = self.summary["phases"]["test"]["failures"]
        for case in ET.parse(xml).getroot().iter("testcase"):
            test = f"{(case.get('classname') or '').replace('.', '/')}.py::{case.get('name')}"
            kids = [c for c in case if c.tag in ("failure", "error", "skipped")]
            if not kids:
                entry["counts"]["passed"] += 1
                continue
            kid = kids[0]
            message = kid.get("message") or ""
            if kid.tag == "skipped":
                if OVER_BUDGET in message:
                    entry["counts"]["trimmed"] += 1
                    continue
                entry["counts"]["skipped"] += 1
                reason = re.sub(r"^Skipped: ", "", message)[:300]
                self.skips[reason] = self.skips.get(reason, 0) + 1
                continue
            entry["counts"]["failed" if kid.tag == "failure" else "errors"] += 1
            failures.append({"test": test, "step": entry["name"], "message": message[:1000],
                             "text": (kid.text or "")[-8000:] if len(failures) < 5 else ""})
        if entry["counts"]["trimmed"]:
            note = f"test step {entry['name']}: {entry['counts']['trimmed']} tests not started (past its deadline)"
            if note not in self.summary["trimmed"]:
                self.summary["trimmed"] = [t for t in self.summary["trimmed"]
                                           if not t.startswith(f"test step {entry['name']}:")] + [note]

    def workers(self) -> int:
        if self.emulated:  # two cores run every rank already
            return 1
        try:
            import importlib.util
            if importlib.util.find_spec("xdist") is None:
                return 1
        except ImportError:
            return 1
        return max(1, min(8, (os.cpu_count() or 2) // 2))

    def after_tests(self) -> tuple:
        """The minimums and weights of the phases after the tests."""
        mins, weights = [], []
        if "sanitize" in self.args.phases and not self.emulated:
            mins.append(_SANITIZE_MIN)
            weights.append(_SANITIZE_WEIGHT)
        if "bench" in self.args.phases:
            mins.append(_BENCH_MIN)
            weights.append(_BENCH_WEIGHT)
        return mins, weights

    def sanitize(self) -> None:
        ph = self.summary["phases"]["sanitize"] = {"status": "running"}
        if self.emulated:
            ph.update(status="skipped", reason="compute-sanitizer needs a real GPU (the emulated device has "
                                               "ThreadSanitizer instead: tests/emulation/test_tsan.py)")
            return
        if shutil.which("compute-sanitizer") is None:
            ph.update(status="failed", reason="compute-sanitizer is not on PATH (the CUDA toolkit's bin/)")
            return
        bench = "bench" in self.args.phases
        keep, mine = share(self.left(), [_SANITIZE_MIN] + ([_BENCH_MIN] if bench else []),
                           [_SANITIZE_WEIGHT] + ([_BENCH_WEIGHT] if bench else []))
        if keep == 0:  # the sanitizer before the figures: the bench goes first
            ph.update(status="trimmed", reason=f"{self.left():.0f} s of the budget left for it "
                                               f"(needs {_SANITIZE_MIN} s)")
            self.summary["trimmed"].append(f"sanitize: {ph['reason']}")
            return
        self.mps_stop()  # compute-sanitizer refuses MPS clients
        rc, secs, out = run([sys.executable, "tests/custom/sanitize_custom.py", "--timeout", f"{mine / 2 - 5:.0f}"],
                            self.out / "sanitize.log",
                            timeout=mine, env=self.env(), title="compute-sanitizer memcheck and racecheck")
        tools = [{"tool": m.group(1), "status": "passed" if m.group(2) == "clean" else "failed",
                  "detail": m.group(0)[:300]}
                 for m in re.finditer(r"^(memcheck|racecheck): (clean|FAILED)[^\n]*", out, re.MULTILINE)]
        ph.update(seconds=round(secs, 1), tools=tools)
        if rc == 0:
            ph["status"] = "passed"
        else:
            ph.update(status="failed", reason="timed out" if rc is None else f"exit {rc}", text=out[-6000:])

    def bench(self) -> None:
        ph = self.summary["phases"]["bench"] = {"status": "running"}
        left = self.left()
        if left < _BENCH_MIN:
            ph.update(status="trimmed", reason=f"{left:.0f} s of the budget left for it (needs {_BENCH_MIN} s)")
            self.summary["trimmed"].append(f"bench: {ph['reason']}")
            return
        res_file = self.out / ".bench-result.json"
        res_file.unlink(missing_ok=True)
        cmd = [sys.executable, ".ci/gpu_bench.py", "--out", self.out, "--result", res_file, "--seconds",
               f"{left - 10:.0f}"] + (["--emulated"] if self.emulated else [])
        self.mps_start("bench")
        rc, secs, out = run(cmd, self.out / "bench.log", timeout=left, env=self.env(), title="figures")
        ph["seconds"] = round(secs, 1)
        result = json.loads(res_file.read_text()) if res_file.exists() else {}
        res_file.unlink(missing_ok=True)
        ph["figures"] = result.get("figures", {})
        ph["problems"] = result.get("problems", [])
        if rc == 0 and not ph["problems"]:
            ph["status"] = "passed"
        else:
            ph.update(status="failed", reason="timed out" if rc is None else (f"exit {rc}" if rc else "problems"),
                      text=out[-4000:])

    # results
    def merge_junit(self) -> None:
        if not self.junit_parts:
            return
        root = ET.Element("testsuites")
        for part in self.junit_parts:
            tree = ET.parse(part).getroot()
            suites = [tree] if tree.tag == "testsuite" else list(tree)
            for suite in suites:
                suite.set("name", f"{part.stem.replace('.junit-', '')}")
                root.append(suite)
            part.unlink()
        ET.ElementTree(root).write(self.out / "junit.xml", encoding="utf-8", xml_declaration=True)

    def finish(self, code: int, quiet: bool = False) -> None:
        self.mps_stop()
        self.merge_junit()
        for stray in self.out.glob(".junit-*.xml"):
            stray.unlink()
        s = self.summary
        s["duration_s"] = round(time.time() - self.t0, 1)
        if s["exit_code"] is None:
            s["exit_code"] = code
            s["status"] = "passed" if code == 0 else "failed"
        s["files"] = sorted(p.name for p in self.out.iterdir() if p.is_file() and not p.name.startswith("."))
        if "summary.json" not in s["files"]:
            s["files"].append("summary.json")
        problems = gpu_summary.validate(s)
        if problems:  # the script's own bug: say so loudly, still write what there is
            s["schema_problems"] = problems
        (self.out / "summary.json").write_text(json.dumps(s, indent=1, default=str) + "\n")
        if not quiet:
            self.report()
        if problems:
            print(".ci/gpu: summary.json does not match .ci/gpu_summary.schema.json: " + "; ".join(problems[:5]))
            code = code or 1
        if quiet and not problems:
            return  # the caller prints its one line, then exits
        sys.exit(code)

    def report(self) -> None:
        s = self.summary
        print(f"\n.ci/gpu ({s['mode']}): {s['status'].upper()} in {s['duration_s']} s of a {s['budget_s']:.0f} s "
              f"budget; results in {self.out}")
        for name in PHASES:
            ph = s["phases"].get(name)
            if not ph:
                continue
            extra = ph.get("reason", "")
            if name == "test" and ph.get("counts"):
                extra = ", ".join(f"{v} {k}" for k, v in ph["counts"].items())
            print(f"  {name:9s} {ph['status']:8s} {ph.get('seconds', '')!s:>6} s  {extra}")
            for step in ph.get("steps", []):
                c = step["counts"]
                print(f"    {step['name']:7s} {step['status']:8s} {step['seconds']:>6} s  {c['passed']} passed, "
                      f"{c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped, {c['trimmed']} trimmed"
                      f"{'  (' + step['reason'] + ')' if step.get('reason') else ''}")
        failures = s["phases"].get("test", {}).get("failures", [])
        for f in failures[:3]:
            print(f"\n----- FAILED {f['test']} [{f['step']}]\n{f['text'] or f['message']}")
        if len(failures) > 3:
            print(f"\n----- and {len(failures) - 3} more failures:")
            for f in failures[3:40]:
                print(f"  {f['test']}: {f['message'][:160]}")
        for t in s["trimmed"]:
            print(f"  trimmed: {t}")
        figures = s["phases"].get("bench", {}).get("figures", {})
        for key, fig in figures.items():
            print(f"  figure {key}: {fig.get('summary') or fig.get('skipped') or ''}")

    def main(self) -> None:
        self.preflight()
        phases = self.args.phases
        if "build" in phases:
            if not self.build():
                self.summary["status"] = "failed"
                self.finish(1)
        else:
            info = self.probe()
            if "error" in info:
                self.fail_fast(f"gpucoll is not built here (run with --phase build first): {info['error'][-300:]}")
            if not info["probe"].get("device_count") or bool(info["build"].get("cuda_emulated")) != self.emulated:
                self.fail_fast(f"the installed gpucoll does not match this run: build {info['build']}, "
                               f"device_count {info['probe'].get('device_count')}")
        if "test" in phases:
            self.mps_start("test")
            self.test()
        if "sanitize" in phases:
            self.sanitize()
        if "bench" in phases:
            self.bench()
        self.mps_stop()
        ran = [p for p in self.summary["phases"].values() if p["status"] not in ("skipped", "trimmed")]
        self.finish(1 if any(p["status"] == "failed" for p in ran) else 0)


def parse(argv=None):
    p = argparse.ArgumentParser(prog=".ci/gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for everything, the build included")
    p.add_argument("--out", default="gpu-check", help="folder for summary.json, junit.xml, logs and figures")
    p.add_argument("--phase", default="all", help="build, test, sanitize, bench or all; several with commas")
    p.add_argument("--emulated", action="store_true", help="on gpucoll's emulated CUDA device (no GPU needed)")
    p.add_argument("--mps", choices=("bench", "all", "off"), default="bench",
                   help="which phases run under a CUDA MPS daemon of this run's own where none runs (see above)")
    args = p.parse_args(argv)
    chosen = [x.strip() for x in args.phase.split(",") if x.strip()]
    bad = [x for x in chosen if x not in PHASES + ("all",)]
    if bad or not chosen:
        p.error(f"--phase: expected build, test, sanitize, bench or all (comma-separated); got {args.phase!r}")
    args.phases = PHASES if "all" in chosen else tuple(x for x in PHASES if x in chosen)
    if args.budget <= 0:
        p.error("--budget must be positive")
    return args


if __name__ == "__main__":
    check = Check(parse())
    try:
        check.main()
    finally:
        check.mps_stop()  # also on an interrupt: never leave a daemon behind
