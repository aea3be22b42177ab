"""detect_launch: each launcher family, precedence between them and explicit arguments, and every error case."""

import os

import pytest

from gpucoll.bootstrap import LaunchInfo, detect_launch
from gpucoll.bootstrap.env import DEFAULT_PORT, _first_slurm_host, _parse_tasks_per_node
from gpucoll.errors import InvalidArgument

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node0", "MASTER_PORT": "12345"}
OMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}
PMI = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
SLURM = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_TASKS_PER_NODE": "4(x2)",
         "SLURM_NODEID": "1", "SLURM_NNODES": "2"}


def info(**kw):
    return LaunchInfo(**kw)


# -- each launcher family ----------------------------------------------------------------------------------------

def test_torchrun():
    assert detect_launch(env=TORCHRUN) == info(rank=3, world_size=8, local_rank=1, local_world_size=2,
                                               address="node0", port=12345, launcher="torchrun")


def test_openmpi_multi_node_needs_master_addr():
    with pytest.raises(InvalidArgument, match="address.*MASTER_ADDR"):
        detect_launch(env=OMPI)
    got = detect_launch(env={**OMPI, "MASTER_ADDR": "10.0.0.1"})
    assert got == info(rank=5, world_size=6, local_rank=2, local_world_size=3, address="10.0.0.1",
                       port=DEFAULT_PORT, launcher="openmpi")


def test_mpich_pmi_single_node_defaults_to_loopback():
    assert detect_launch(env=PMI) == info(rank=1, world_size=4, local_rank=1, local_world_size=4,
                                          address="127.0.0.1", port=29500, launcher="mpich")


def test_mpich_without_local_variables_guesses_locals_but_not_the_address():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4"}
    with pytest.raises(InvalidArgument, match="address"):
        detect_launch(env=env)
    got = detect_launch(env=env, address="h")
    assert (got.local_rank, got.local_world_size, got.launcher) == (2, 4, "mpich")


def test_slurm_compressed_tasks_per_node():
    got = detect_launch(env={**SLURM, "MASTER_ADDR": "n0"})
    assert got == info(rank=6, world_size=8, local_rank=2, local_world_size=4, address="n0", port=29500,
                       launcher="slurm")


def test_slurm_uneven_tasks_per_node_uses_node_id():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "3(x2),1",
           "SLURM_NODEID": "2", "MASTER_ADDR": "n0"}
    assert detect_launch(env=env).local_world_size == 1


def test_slurm_ntasks_per_node_wins_and_is_clamped_to_the_step():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "8",
           "SLURM_TASKS_PER_NODE": "garbage"}
    got = detect_launch(env=env)
    assert (got.local_world_size, got.address) == (2, "127.0.0.1")


def test_slurm_unparseable_tasks_per_node_is_unknown_not_an_error():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "x?"}
    with pytest.raises(InvalidArgument, match="address"):
        detect_launch(env=env)
    assert detect_launch(env={**env, "SLURM_NNODES": "1"}).address == "127.0.0.1"


def test_torchrun_agent_store_only_when_torchrun_says_so_and_the_address_is_its():
    agent = {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    got = detect_launch(env=agent)
    assert (got.agent_store, got.attempt, got.address, got.port) == (True, 2, "node0", 12345)
    assert detect_launch(env=TORCHRUN).agent_store is False  # torchrun without its agent store (older torch)
    assert detect_launch(env={**agent, "TORCHELASTIC_USE_AGENT_STORE": "False"}).agent_store is False
    # An explicit address or port is the caller's own store, not the agent's.
    assert detect_launch(port=2222, env=agent).agent_store is False
    assert detect_launch(address="127.0.0.1", env=agent).agent_store is False
    # Only torchrun's variables make it torchrun's store.
    assert detect_launch(env={**SLURM, "MASTER_ADDR": "a", "MASTER_PORT": "1",
                              "TORCHELASTIC_USE_AGENT_STORE": "True"}).agent_store is False


def test_slurm_multi_node_without_master_addr_serves_on_the_first_node_of_the_step():
    got = detect_launch(env={**SLURM, "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[01-09]"})
    assert (got.address, got.port, got.launcher) == ("gpu07", DEFAULT_PORT, "slurm")
    assert detect_launch(env={**SLURM, "SLURM_JOB_NODELIST": "gpu[01-09]"}).address == "gpu01"
    assert detect_launch(env={**SLURM, "SLURM_NODELIST": "a,b", "MASTER_ADDR": "10.1.1.1"}).address == "10.1.1.1"
    with pytest.raises(InvalidArgument, match="address is missing"):
        detect_launch(env={**SLURM, "SLURM_STEP_NODELIST": "bad["})


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("node1,node2", "node1"), ("gpu[07-09,12],login1", "gpu07"), ("n[001-004]", "n001"),
    ("a[1-2]-b[3-4]", "a1-b3"), ("rack1-n[2,5]x", "rack1-n2x"), (" host.example.org ", "host.example.org"),
    ("", None), ("bad[", None), ("[1-2]", "1"), ("n[]", None), ("a b", None)])
def test_first_slurm_host(nodelist, first):
    assert _first_slurm_host(nodelist) == first


def test_parse_tasks_per_node():
    assert _parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert _parse_tasks_per_node("4") == [4]
    assert _parse_tasks_per_node("") is None
    assert _parse_tasks_per_node("2(x") is None


# -- precedence ----------------------------------------------------------------------------------------------------

def test_family_order_torchrun_over_mpi_over_pmi_over_slurm():
    assert detect_launch(env={**SLURM, **PMI, **OMPI, **TORCHRUN}).launcher == "torchrun"
    assert detect_launch(env={**SLURM, **PMI, **OMPI, "MASTER_ADDR": "a"}).launcher == "openmpi"
    assert detect_launch(env={**SLURM, **PMI}).launcher == "mpich"


def test_explicit_arguments_win_over_environment():
    got = detect_launch(rank=0, world_size=2, address="h", port=1, local_rank=0, env=TORCHRUN)
    assert got == info(rank=0, world_size=2, local_rank=0, local_world_size=2, address="h", port=1,
                       launcher="explicit")


def test_explicit_rank_and_size_ignore_inherited_launcher_locals():
    # Children started by the caller inherit e.g. SLURM_LOCALID=0; that must not become their local rank.
    got = detect_launch(rank=3, world_size=4, env=SLURM)
    assert (got.local_rank, got.local_world_size, got.address, got.launcher) == (3, 4, "127.0.0.1", "explicit")


def test_partial_explicit_arguments_fill_in_from_launcher():
    got = detect_launch(rank=0, env=TORCHRUN)
    assert (got.rank, got.world_size, got.local_rank, got.launcher) == (0, 8, 1, "torchrun")


def test_master_addr_and_port_apply_to_any_launcher_and_arguments_beat_them():
    env = {**PMI, "MASTER_ADDR": "head", "MASTER_PORT": "4000"}
    assert (detect_launch(env=env).address, detect_launch(env=env).port) == ("head", 4000)
    assert detect_launch(rank=0, world_size=1, env=env).address == "head"
    got = detect_launch(address="other", port=5000, env=env)
    assert (got.address, got.port) == ("other", 5000)


def test_no_launcher_single_process_and_explicit_local():
    assert detect_launch(rank=0, world_size=1, env={}) == info(rank=0, world_size=1, local_rank=0,
                                                               local_world_size=1, address="127.0.0.1",
                                                               port=29500, launcher="explicit")


def test_empty_variables_count_as_unset():
    assert detect_launch(env={"RANK": "", "WORLD_SIZE": " ", **PMI}).launcher == "mpich"


def test_whitespace_around_integers_is_accepted():
    assert detect_launch(env={"RANK": " 1\n", "WORLD_SIZE": "2 ", "LOCAL_WORLD_SIZE": "2"}).rank == 1


def test_defaults_to_os_environ(monkeypatch):
    for name in list(os.environ):
        monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "x")
    assert detect_launch().rank == 1


class _Recording(dict):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = set()

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


def test_never_reads_gpucoll_variables():
    env = _Recording({"GPUCOLL_RANK": "0", "GPUCOLL_WORLD_SIZE": "1", **SLURM, "MASTER_ADDR": "a"})
    detect_launch(env=env)
    with pytest.raises(InvalidArgument):
        detect_launch(env=_Recording({"GPUCOLL_RANK": "0"}))
    assert not [k for k in env.seen if k.startswith("GPUCOLL_")]


# -- errors --------------------------------------------------------------------------------------------------------

def test_missing_rank_names_argument_and_variables():
    with pytest.raises(InvalidArgument) as e:
        detect_launch(env={})
    msg = str(e.value)
    assert "rank is missing" in msg
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        assert var in msg


def test_missing_world_size_names_argument_and_variables():
    with pytest.raises(InvalidArgument) as e:
        detect_launch(rank=0, env={})
    msg = str(e.value)
    assert "world_size is missing" in msg
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        assert var in msg


def test_launcher_detected_but_its_size_missing():
    with pytest.raises(InvalidArgument, match=r"world_size is missing.*torchrun.*WORLD_SIZE"):
        detect_launch(env={"RANK": "0"})


@pytest.mark.parametrize("ws", [0, -3])
def test_world_size_below_one(ws):
    with pytest.raises(InvalidArgument, match=r"world_size=.*expected an integer >= 1"):
        detect_launch(rank=0, world_size=ws, env={})


def test_world_size_below_one_from_env_names_variable():
    with pytest.raises(InvalidArgument, match=r"world_size=0 \(from OMPI_COMM_WORLD_SIZE\)"):
        detect_launch(env={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"})


@pytest.mark.parametrize("rank", [-1, 4, 100])
def test_rank_out_of_range(rank):
    with pytest.raises(InvalidArgument, match=r"rank=.*0 <= rank < world_size=4"):
        detect_launch(rank=rank, world_size=4, env={})


def test_rank_out_of_range_from_env_names_variable():
    with pytest.raises(InvalidArgument, match=r"rank=4 \(from PMI_RANK\)"):
        detect_launch(env={"PMI_RANK": "4", "PMI_SIZE": "4"})


@pytest.mark.parametrize("var", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"])
def test_non_integer_env_value_names_variable(var):
    env = {**TORCHRUN, var: "two"}
    with pytest.raises(InvalidArgument, match=rf"{var}='two' is not an integer"):
        detect_launch(env=env)


@pytest.mark.parametrize("name,kw", [("rank", {"rank": "0"}), ("world_size", {"world_size": 2.0}),
                                     ("local_rank", {"local_rank": True}), ("port", {"port": "80"})])
def test_non_integer_arguments(name, kw):
    args = {"rank": 0, "world_size": 2, **kw}
    with pytest.raises(InvalidArgument, match=rf"{name} must be an integer"):
        detect_launch(env={}, **args)


def test_local_rank_out_of_range():
    with pytest.raises(InvalidArgument, match=r"local_rank=2 \(from LOCAL_RANK\).*local_world_size=2"):
        detect_launch(env={**TORCHRUN, "LOCAL_RANK": "2"})
    with pytest.raises(InvalidArgument, match=r"local_rank=5 is out of range"):
        detect_launch(rank=0, world_size=2, local_rank=5, env={})


def test_local_world_size_larger_than_world():
    with pytest.raises(InvalidArgument, match=r"local_world_size=9 \(from LOCAL_WORLD_SIZE\)"):
        detect_launch(env={**TORCHRUN, "LOCAL_WORLD_SIZE": "9"})


@pytest.mark.parametrize("port", [-1, 65536])
def test_port_out_of_range(port):
    with pytest.raises(InvalidArgument, match=r"port=.*0 <= port <= 65535"):
        detect_launch(rank=0, world_size=1, port=port, env={})
    with pytest.raises(InvalidArgument, match=r"from MASTER_PORT"):
        detect_launch(rank=0, world_size=1, env={"MASTER_PORT": str(port)})


@pytest.mark.parametrize("address", ["", "  ", 5])
def test_bad_address(address):
    with pytest.raises(InvalidArgument, match="address must be"):
        detect_launch(rank=0, world_size=1, address=address, env={})


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        detect_launch(env={})
