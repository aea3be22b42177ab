"""Who am I? Rank, world size and rendezvous address from explicit arguments or the launcher's environment.

Explicit arguments always win. Otherwise the first launcher family whose rank or size variable is set supplies
the values, in this order: torchrun, Open MPI, MPICH/PMI, Slurm. torchrun comes first because it is often run
*inside* an ``srun``/``mpirun`` allocation, where the outer launcher's variables describe the wrong processes.

This module reads only the launcher variables named below and never a ``GPUCOLL_*`` variable: those belong to
``gpucoll.config`` (the C++ core is their one reader).
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re
from collections.abc import Mapping

from gpucoll.errors import InvalidArgument

__all__ = ["DEFAULT_PORT", "LOCAL_ADDRESS", "LaunchInfo", "detect_launch"]

DEFAULT_PORT = 29500  # torch.distributed's default, so MASTER_PORT-less scripts behave the same with both
LOCAL_ADDRESS = "127.0.0.1"


@dataclasses.dataclass
class LaunchInfo:
    """Where this process sits in the job and where rank 0's rendezvous store listens."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    address: str
    port: int
    launcher: str  # "torchrun", "openmpi", "mpich", "slurm" or "explicit" (no launcher variables used)
    # torchrun's agent already serves the rendezvous store at address:port (TORCHELASTIC_USE_AGENT_STORE=True, and
    # both came from MASTER_ADDR/MASTER_PORT): the ranks meet there as clients, rank 0 included. `attempt` is
    # torchrun's restart count, so that a restarted job never reads the keys of the attempt before it.
    agent_store: bool = False
    attempt: int = 0


@dataclasses.dataclass(frozen=True)
class _Family:
    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str | None  # None: computed (Slurm has no single variable for it)


_FAMILIES = (
    _Family("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    _Family("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE"),
    _Family("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    _Family("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)

_RANK_VARS = ", ".join(f.rank for f in _FAMILIES)
_SIZE_VARS = ", ".join(f.size for f in _FAMILIES)


def _is_set(env: Mapping[str, str], name: str) -> bool:
    # An exported-but-empty variable (`RANK=`) counts as unset: shells and job scripts produce those often.
    value = env.get(name)
    return value is not None and value.strip() != ""


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    if not _is_set(env, name):
        return None
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise InvalidArgument(f"environment variable {name}={raw!r} is not an integer") from None


def _arg_int(value, name: str) -> int:
    # bool is an int subclass, but rank=True is always a mistake.
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def _parse_tasks_per_node(text: str) -> list[int] | None:
    """Expand Slurm's compressed per-node task counts: "2(x3),1" -> [2, 2, 2, 1]. None when malformed."""
    counts: list[int] = []
    for part in text.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        repeat = int(m.group(2) or 1)
        if repeat > 1_000_000:  # a guard against a corrupt value allocating a huge list
            return None
        counts.extend([int(m.group(1))] * repeat)
    return counts or None


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    # "when parseable": these variables describe the allocation and can be odd; an unparseable one just means
    # "unknown", it is not the user's error.
    raw = env.get("SLURM_NTASKS_PER_NODE", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    counts = _parse_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", ""))
    if counts is None:
        return None
    if len(set(counts)) == 1:
        return counts[0]
    node = env.get("SLURM_NODEID", "").strip()  # uneven counts: pick this node's entry
    if node.isdigit() and int(node) < len(counts):
        return counts[int(node)]
    return None


def _first_slurm_host(nodelist: str) -> str | None:
    """The first host of a Slurm host list ("gpu[07-09,12],login1" -> "gpu07"; "a[1-2]-b[3-4]" -> "a1-b3"), or None
    when malformed. Task 0 of a step runs on the first node of SLURM_STEP_NODELIST (block and cyclic distributions
    alike), so that is where rank 0 serves the store."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for i, ch in enumerate(text):  # the first host ends at the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    first = text[:end]

    def pick(m):  # the first entry of a bracket range list, zero padding kept: "[07-09,12]" -> "07"
        return m.group(1).split(",")[0].split("-")[0] or "[]"  # "[]" stays and fails the check below

    host = re.sub(r"\[([^\[\]]*)\]", pick, first)
    return host if host and re.fullmatch(r"[A-Za-z0-9._-]+", host) else None


def _slurm_nodelist(env: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if _is_set(env, name):
            return env[name]
    return ""


def _pick_family(env: Mapping[str, str]) -> _Family | None:
    for family in _FAMILIES:
        if _is_set(env, family.rank) or _is_set(env, family.size):
            return family
    return None


def detect_launch(rank=None, world_size=None, address=None, port=None, local_rank=None,
                  env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Resolve this process's rank, world size, local rank and the rendezvous address.

    ``env`` defaults to ``os.environ`` (tests pass a dict). Raises ``gpucoll.errors.InvalidArgument`` naming the
    missing or wrong argument (or environment variable) and what was expected.
    """
    env = os.environ if env is None else env
    sources = {}  # field -> where its value came from, so errors can say "rank=5 (from RANK)"

    if rank is not None:
        rank = _arg_int(rank, "rank")
        sources["rank"] = "argument"
    if world_size is not None:
        world_size = _arg_int(world_size, "world_size")
        sources["world_size"] = "argument"
    if local_rank is not None:
        local_rank = _arg_int(local_rank, "local_rank")
        sources["local_rank"] = "argument"

    # With both rank and world_size given the caller started the processes itself (gpucoll.spawn, a custom
    # script). Those children inherit the parent's environment, e.g. SLURM_LOCALID=0 in every child of one srun
    # task, so launcher variables would be wrong for them: consult none.
    family = None if (rank is not None and world_size is not None) else _pick_family(env)
    local_world_size = None
    launcher = "explicit"
    if family is not None:
        launcher = family.name
        if rank is None:
            rank = _env_int(env, family.rank)
            sources["rank"] = family.rank
        if world_size is None:
            world_size = _env_int(env, family.size)
            sources["world_size"] = family.size
        if local_rank is None:
            local_rank = _env_int(env, family.local_rank)
            sources["local_rank"] = family.local_rank
        if family.local_size is not None:
            local_world_size = _env_int(env, family.local_size)
            sources["local_world_size"] = family.local_size
        else:
            local_world_size = _slurm_local_size(env)
            sources["local_world_size"] = "SLURM_NTASKS_PER_NODE/SLURM_TASKS_PER_NODE"
            if local_world_size is None and env.get("SLURM_NNODES", "").strip() == "1":
                local_world_size = world_size  # one node: every task is local, whatever the counts say
            elif local_world_size is not None and world_size is not None and world_size >= 1:
                # The per-node counts describe the allocation; a step (srun -n 2) may run fewer tasks than that.
                local_world_size = min(local_world_size, world_size)

    for name, value, looked in (("rank", rank, _RANK_VARS), ("world_size", world_size, _SIZE_VARS)):
        if value is not None:
            continue
        if family is None:
            raise InvalidArgument(
                f"{name} is missing: pass {name}= or start the program with a launcher (torchrun, mpirun, srun); "
                f"looked at the environment variables {looked} and none is set")
        var = family.rank if name == "rank" else family.size
        raise InvalidArgument(
            f"{name} is missing: the {family.name} launcher was detected but {var} is not set; pass {name}= "
            f"or set {var}")

    def _src(field):
        where = sources.get(field, "argument")
        return "" if where == "argument" else f" (from {where})"

    if world_size < 1:
        raise InvalidArgument(f"world_size={world_size}{_src('world_size')} is invalid: expected an integer >= 1")
    if not 0 <= rank < world_size:
        raise InvalidArgument(
            f"rank={rank}{_src('rank')} is out of range: expected 0 <= rank < world_size={world_size}")

    # Locality. Without a launcher the caller started every process on this host (see above). With a launcher
    # that does not say, guess "one node" for local_rank/local_world_size (harmless for device selection) but
    # do not let that guess pick 127.0.0.1 as the rendezvous address: a wrong guess would hang other nodes.
    if family is None and local_world_size is None:
        local_world_size = world_size
    locality_known = local_world_size is not None or world_size == 1
    if local_world_size is None:
        local_world_size = world_size
        sources.pop("local_world_size", None)
    if not 1 <= local_world_size <= world_size:
        raise InvalidArgument(
            f"local_world_size={local_world_size}{_src('local_world_size')} is invalid: expected "
            f"1 <= local_world_size <= world_size={world_size}")
    if local_rank is None:
        local_rank = rank if family is None else rank % local_world_size  # block placement, the launchers' default
    if not 0 <= local_rank < local_world_size:
        raise InvalidArgument(
            f"local_rank={local_rank}{_src('local_rank')} is out of range: expected "
            f"0 <= local_rank < local_world_size={local_world_size}")

    address_from_env = False
    if address is not None:
        if not isinstance(address, str) or not address.strip():
            raise InvalidArgument(f"address must be a non-empty host name or IP address string, got {address!r}")
        address = address.strip()
    elif _is_set(env, "MASTER_ADDR"):
        address, address_from_env = env["MASTER_ADDR"].strip(), True
    elif locality_known and local_world_size == world_size:
        address = LOCAL_ADDRESS
    elif launcher == "slurm" and (first := _first_slurm_host(_slurm_nodelist(env))):
        address = first  # several nodes: rank 0's node, from the step's node list
    else:
        raise InvalidArgument(
            f"address is missing: {world_size} ranks may span several hosts ({launcher} launcher, local world size "
            f"unknown or smaller); pass address= (rank 0's host) or set MASTER_ADDR")

    port_from_env = False
    if port is not None:
        port = _arg_int(port, "port")
        port_src = ""
    elif _is_set(env, "MASTER_PORT"):
        port, port_from_env = _env_int(env, "MASTER_PORT"), True
        port_src = " (from MASTER_PORT)"
    else:
        port, port_src = DEFAULT_PORT, ""
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"port={port}{port_src} is out of range: expected 0 <= port <= 65535")

    agent = (launcher == "torchrun" and address_from_env and port_from_env
             and env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true")
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    return LaunchInfo(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                      address=address, port=port, launcher=launcher, agent_store=agent,
                      attempt=int(attempt) if agent and attempt.isdigit() else 0)
