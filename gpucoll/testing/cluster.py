"""Several "nodes" on one Linux machine, for the code paths that only run across machines.

Each node is a network namespace with its own address on a veth link to a bridge. Every process launched into a
node also gets the node's hostname (a UTS namespace) and an /etc/hosts that names every node (a mount namespace),
as a cluster's DNS would, and a HOME of the node's own unless the cluster shares one. The bridge sits in a namespace
of its own (the "switch"): nothing is added to the machine's own network, and deleting the cluster's namespaces
removes every link with them. Ranks see one another only over the veth network; loopback stays inside a node.

    with Cluster(nodes=2, ranks_per_node=2) as c:
        job = c.launch([sys.executable, "train.py"])   # 4 ranks with torchrun's variables; MASTER_ADDR is node 0
        c.cut(1)                                        # node 1's cable pulled; c.restore(1); c.flap(1, 2.0)
        for r in job.wait(timeout=60): print(r.rank, r.returncode, r.stdout)

    python -m gpucoll.testing.cluster --nodes 2 --ranks-per-node 2 -- python train.py

Ranks are placed node by node (rank = node * ranks_per_node + local rank), as srun's block distribution and
torchrun's do. ``launcher`` picks which launcher's variables they get: "torchrun" (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), "slurm" (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_NODEID, SLURM_TASKS_PER_NODE, SLURM_STEP_NODELIST: rank 0's address comes from the node list, as under srun)
or "openmpi" (OMPI_COMM_WORLD_*, with MASTER_ADDR).

Needs root (CAP_NET_ADMIN for the links, CAP_SYS_ADMIN for the namespaces), iproute2's ``ip`` and util-linux's
``unshare``; :func:`unavailable` says why a machine cannot. Namespaces are named ``gpucoll-<pid>-<tag>-*`` after the
process that made them, so that a cluster whose maker died (SIGKILL skips every cleanup) is removed by the next one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["Cluster", "Job", "RankResult", "leftovers", "unavailable"]

_PREFIX = "gpucoll-"
_SUBNET = "10.203.0."  # private, and only ever inside the cluster's own namespaces: any value would do
_PORT = 29500  # each cluster has its own network, so every cluster may use torchrun's default port

# Runs inside the node's fresh UTS and mount namespaces, then becomes the rank's program: the bind mount and the
# hostname never leave those namespaces. `exec` keeps the rank's pid the one Popen returned, so signals reach it.
_ENTER = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


@functools.cache
def unavailable() -> str | None:
    """Why this machine cannot host a cluster (None when it can): the reason a test skips with."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); this process is not root"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"the command {tool!r} is not installed (iproute2, util-linux)"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    try:
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"'ip netns add' failed: {made.stderr.strip() or made.returncode}"
        entered = _run("ip", "netns", "exec", probe, "unshare", "--uts", "--mount", "true", check=False)
        if entered.returncode != 0:
            return f"'unshare --uts --mount' inside a network namespace failed: {entered.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace `ns` (ranks, and whatever they started)."""
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete(names) -> None:
    for ns in names:
        _kill_inside(ns)
    for ns in names:
        _run("ip", "netns", "del", ns, check=False)


def leftovers(tag: str | None = None) -> list[str]:
    """gpucoll cluster namespaces that exist now: every one, or only the cluster `tag`'s."""
    mine = re.compile(rf"{_PREFIX}\d+-{re.escape(tag)}-" if tag else rf"{_PREFIX}\d+-[0-9a-f]+-")
    return [ns for ns in _namespaces() if mine.match(ns)]


def _remove_orphans() -> None:
    orphans = [ns for ns in leftovers() if not _alive(int(ns[len(_PREFIX):].split("-")[0]))]
    _delete(orphans)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


@dataclasses.dataclass
class RankResult:
    rank: int
    node: int
    returncode: int
    stdout: str
    stderr: str


class Job:
    """The ranks of one launch: a process per rank, output in files (a full pipe would stall a rank)."""

    def __init__(self, cluster: Cluster, procs, logs):
        self.cluster = cluster
        self.procs = procs  # by rank
        self._logs = logs  # by rank: (stdout path, stderr path)

    def pids(self, node: int | None = None) -> list[int]:
        return [p.pid for r, p in enumerate(self.procs) if node is None or self.cluster.node_of(r) == node]

    def kill_node(self, node: int, sig: int = signal.SIGKILL) -> None:
        """Signal every rank of `node` (SIGKILL: the node dies without a word). A SIGKILL is preceded by SIGSTOP to
        all of them, so that no rank of the node sees another die and reacts before its own turn."""
        pids = self.pids(node)
        for s in ((signal.SIGSTOP, sig) if sig == signal.SIGKILL else (sig,)):
            for pid in pids:
                try:
                    os.kill(pid, s)
                except ProcessLookupError:
                    pass

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def wait(self, timeout: float, *, abandon=()) -> list[RankResult]:
        """Every rank's result. A rank still running after `timeout` seconds is killed, and its result says so
        (returncode -9 and a line on stderr) rather than the wait raising: the other ranks' output is evidence.
        Ranks in `abandon` (a node cut off, whose ranks wait forever on the far side) are not waited for: they are
        killed as soon as every other rank has ended."""
        deadline = time.monotonic() + timeout
        late = set()
        order = [r for r in range(len(self.procs)) if r not in abandon] + sorted(set(abandon))
        for r in order:
            p = self.procs[r]
            try:
                p.wait(timeout=0.0 if r in abandon else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                late.add(r)
                p.kill()
                p.wait()
        results = []
        for r, p in enumerate(self.procs):
            out, err = (_read(path) for path in self._logs[r])
            if r in late:
                err += (f"\n[gpucoll.testing.cluster: rank {r} still running "
                        f"{'when the others had ended' if r in abandon else f'after {timeout:g} s'}; killed]\n")
            results.append(RankResult(r, self.cluster.node_of(r), p.returncode, out, err))
        return results

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class Cluster:
    """K nodes x R ranks on this machine; a context manager (``up()``/``down()`` by hand otherwise)."""

    def __init__(self, nodes: int = 2, ranks_per_node: int = 1, *, shared_home: bool = False,
                 launcher: str = "torchrun", workdir: str | None = None):
        if not isinstance(nodes, int) or not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be an integer in [1, 200], got {nodes!r}")
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if launcher not in ("torchrun", "slurm", "openmpi"):
            raise ValueError(f"launcher must be 'torchrun', 'slurm' or 'openmpi', got {launcher!r}")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.shared_home, self.launcher = shared_home, launcher
        self.tag = secrets.token_hex(3)
        self._ns_base = f"{_PREFIX}{os.getpid()}-{self.tag}"
        self.switch = f"{self._ns_base}-sw"
        self.hostnames = [f"node{i}-{self.tag}" for i in range(nodes)]
        self.addresses = [f"{_SUBNET}{i + 1}" for i in range(nodes)]
        self._workdir_arg = workdir
        self.workdir: str | None = None
        self._jobs: list[Job] = []
        self._lock = threading.Lock()
        self._up = False

    # -- names -------------------------------------------------------------------------------------------------

    def netns(self, node: int) -> str:
        return f"{self._ns_base}-n{node}"

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def home(self, node: int) -> str:
        return os.path.join(self.workdir, "home" if self.shared_home else f"home{node}")

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    # -- life --------------------------------------------------------------------------------------------------

    def up(self) -> Cluster:
        why = unavailable()
        if why is not None:
            raise RuntimeError(f"cannot make a cluster on this machine: {why}")
        _remove_orphans()
        self.workdir = tempfile.mkdtemp(prefix=f"gpucoll-cluster-{self.tag}-", dir=self._workdir_arg)
        self._up = True  # from here on down() has something to undo, whatever fails below
        try:
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            hosts = ["127.0.0.1 localhost"] + [f"{a} {h}" for a, h in zip(self.addresses, self.hostnames)]
            with open(os.path.join(self.workdir, "hosts"), "w") as f:
                f.write("\n".join(hosts) + "\n")
            for i in range(self.nodes):
                ns = self.netns(i)
                _run("ip", "netns", "add", ns)
                # Both ends are made inside their namespaces: no interface ever appears on the machine's own.
                _run("ip", "link", "add", f"n{i}", "netns", self.switch, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)
                _run("ip", "-n", self.switch, "link", "set", f"n{i}", "master", "br0", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                os.makedirs(self.home(i), mode=0o700, exist_ok=True)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill every process in the cluster, delete its namespaces (and with them its links) and its files.
        Safe to call twice, and after a failed ``up()``."""
        if not self._up:
            return
        for job in self._jobs:
            job.kill()
        _delete([self.netns(i) for i in range(self.nodes)] + [self.switch])
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self._up = False

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- the network -------------------------------------------------------------------------------------------

    def cut(self, node: int) -> None:
        """Pull node `node`'s cable: its switch port goes down (the node's own link loses carrier)."""
        _run("ip", "-n", self.switch, "link", "set", f"n{node}", "down")

    def restore(self, node: int) -> None:
        _run("ip", "-n", self.switch, "link", "set", f"n{node}", "up")

    def flap(self, node: int, down_s: float, *, background: bool = False) -> threading.Thread | None:
        """Cut node `node` for `down_s` seconds, then restore it; in a thread when `background`."""
        def go():
            self.cut(node)
            time.sleep(down_s)
            self.restore(node)
        if not background:
            go()
            return None
        t = threading.Thread(target=go, name=f"flap-node{node}", daemon=True)
        t.start()
        return t

    # -- processes ---------------------------------------------------------------------------------------------

    def rank_env(self, rank: int, port: int = _PORT, nodes: int | None = None) -> dict:
        """The launcher variables rank `rank` starts with, in a job on the first `nodes` nodes (default: all)."""
        node, local = divmod(rank, self.ranks_per_node)
        k, r = nodes or self.nodes, self.ranks_per_node
        world = k * r
        if self.launcher == "torchrun":
            return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(r), "GROUP_RANK": str(node), "MASTER_ADDR": self.master_addr,
                    "MASTER_PORT": str(port)}
        if self.launcher == "slurm":
            return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(local),
                    "SLURM_NODEID": str(node), "SLURM_NNODES": str(k), "SLURM_TASKS_PER_NODE": f"{r}(x{k})",
                    "SLURM_STEP_NODELIST": ",".join(self.hostnames[:k]), "MASTER_PORT": str(port)}
        return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
                "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(r),
                "OMPI_COMM_WORLD_NODE_RANK": str(node), "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(port)}

    def spawn(self, node: int, argv, env: dict | None = None, stdout=None, stderr=None) -> subprocess.Popen:
        """One process on node `node`, with the node's hostname, /etc/hosts and HOME."""
        if not self._up:
            raise RuntimeError("the cluster is not up")
        full = dict(os.environ)
        # The launching machine's launcher variables would describe the wrong job: a node starts clean of them.
        for name in list(full):
            if name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                        "MASTER_PORT") or name.startswith(("SLURM_", "OMPI_COMM_WORLD_", "PMI_", "TORCHELASTIC_")):
                del full[name]
        full["HOME"] = self.home(node)
        # A rank that dies of a signal (an abort in native code) prints every thread's Python stack: the evidence a
        # rare crash in CI leaves.
        full.setdefault("PYTHONFAULTHANDLER", "1")
        full.update(env or {})
        cmd = ["ip", "netns", "exec", self.netns(node), "unshare", "--uts", "--mount", "--", "sh", "-c", _ENTER,
               "sh", os.path.join(self.workdir, "hosts"), self.hostnames[node], *map(str, argv)]
        return subprocess.Popen(cmd, env=full, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def launch(self, argv, env: dict | None = None, rank_env=None, port: int = _PORT, nodes: int | None = None) -> Job:
        """Start `argv` on every rank, or on the ranks of the first `nodes` nodes (the others stay free, for a
        process that joins later). `env` is added for all ranks; `rank_env(rank)`, when given, returns more
        variables for one rank (None for none)."""
        if nodes is not None and not 1 <= nodes <= self.nodes:
            raise ValueError(f"nodes must be in [1, {self.nodes}], got {nodes!r}")
        procs, logs = [], []
        with self._lock:
            n = len(self._jobs)
            try:
                for rank in range((nodes or self.nodes) * self.ranks_per_node):
                    out = os.path.join(self.workdir, f"job{n}.rank{rank}.out")
                    err = os.path.join(self.workdir, f"job{n}.rank{rank}.err")
                    variables = {**self.rank_env(rank, port, nodes), **(env or {}),
                                 **((rank_env and rank_env(rank)) or {})}
                    with open(out, "w") as fo, open(err, "w") as fe:
                        procs.append(self.spawn(self.node_of(rank), argv, variables, stdout=fo, stderr=fe))
                    logs.append((out, err))
            except BaseException:
                for p in procs:
                    p.kill()
                raise
            job = Job(self, procs, logs)
            self._jobs.append(job)
        return job

    def run(self, argv, timeout: float = 120.0, env: dict | None = None, rank_env=None) -> list[RankResult]:
        return self.launch(argv, env=env, rank_env=rank_env).wait(timeout)

    def mpi_launcher(self) -> str:
        """A script for MPICH's hydra (``mpiexec -launcher ssh -launcher-exec SCRIPT -hosts NODES``) that starts its
        proxy on a node the way ``spawn`` starts a rank, where hydra would ssh: mpiexec, run on a node itself
        (``exec(0, ["mpiexec", ...])``), then launches ranks across the nodes as on a cluster."""
        path = os.path.join(self.workdir, "mpi_launcher.sh")
        hosts = os.path.join(self.workdir, "hosts")
        lines = ["#!/bin/sh", "# hydra calls: SCRIPT [ssh options] HOST COMMAND...",
                 'while [ "${1#-}" != "$1" ]; do shift; done', 'host=$1; shift']
        for i, name in enumerate(self.hostnames):
            lines.append(f'[ "$host" = "{name}" ] && exec ip netns exec {self.netns(i)} unshare --uts --mount -- '
                         f'sh -c \'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec sh -c "$*"\' '
                         f'sh {hosts} {name} "$@"')
        lines.append('echo "mpi_launcher: no node is called $host" >&2; exit 1')
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(path, 0o755)
        return path

    def mpiexec(self, argv, env: dict | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """`argv` on every rank through MPICH's mpiexec (run on node 0; ranks placed node by node)."""
        cmd = ["mpiexec", "-launcher", "ssh", "-launcher-exec", self.mpi_launcher(), "-hosts",
               ",".join(self.hostnames), "-n", str(self.world_size), "-ppn", str(self.ranks_per_node), *argv]
        if env:
            cmd = ["env", *(f"{k}={v}" for k, v in env.items()), *cmd]
        return self.exec(0, cmd, timeout=timeout)

    def exec(self, node: int, argv, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """A command on node `node` (its network, hostname and HOME), to completion."""
        p = self.spawn(node, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        return subprocess.CompletedProcess(p.args, p.returncode, out.decode(errors="replace"),
                                           err.decode(errors="replace"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpucoll.testing.cluster",
        description="Run CMD on every rank of a small cluster made on this machine (network and hostname "
                    "namespaces; needs root), then tear it down. Each line of output is prefixed with its rank.")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--shared-home", action="store_true", help="one HOME for every node (default: one each)")
    parser.add_argument("--launcher", choices=("torchrun", "slurm", "openmpi"), default="torchrun",
                        help="whose environment variables the ranks get (default: torchrun)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is killed")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given: python -m gpucoll.testing.cluster [options] -- CMD [ARGS...]")
    why = unavailable()
    if why is not None:
        print(f"gpucoll.testing.cluster: cannot make a cluster here: {why}", file=sys.stderr)
        return 2
    with Cluster(args.nodes, args.ranks_per_node, shared_home=args.shared_home, launcher=args.launcher) as c:
        results = c.run(cmd, timeout=args.timeout)
    worst = 0
    for r in results:
        for stream, text in ((sys.stdout, r.stdout), (sys.stderr, r.stderr)):
            for line in text.splitlines():
                print(f"[{r.rank}] {line}", file=stream)
        if r.returncode != 0:
            print(f"[{r.rank}] exited with status {r.returncode}", file=sys.stderr)
            worst = worst or (r.returncode if r.returncode > 0 else 128 - r.returncode)
    return worst


if __name__ == "__main__":
    sys.exit(main())
