"""The per-user rendezvous secret (gpucoll/bootstrap/secret_file.py): what mpirun and srun jobs use when no
GPUCOLL_STORE_SECRET is set. Made once, private, the same for every rank that races to make it; refused when other
users could read it; and a rank whose node holds another file is refused by the store with an error naming both
the file and GPUCOLL_STORE_SECRET."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat

import pytest

from gpucoll._spawn import free_port
from gpucoll.bootstrap import external, secret_file
from gpucoll.bootstrap.env import LaunchInfo
from gpucoll.bootstrap.store import new_secret
from gpucoll.errors import InvalidArgument


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("GPUCOLL_STORE_SECRET", raising=False)
    return tmp_path


def test_made_once_private_and_then_kept(home):
    first = secret_file.read_or_create(new_secret())
    path = home / ".gpucoll" / "store_secret"
    assert secret_file.default_path() == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(first) == 64 and secret_file.read_or_create(new_secret()) == first
    assert sorted(p.name for p in path.parent.iterdir()) == ["store_secret"]  # no temporary file left


def _make(path, queue):
    queue.put(secret_file.read_or_create(new_secret(), path))


@pytest.mark.spawns
def test_ranks_racing_to_make_it_all_get_the_winners(tmp_path):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    path = tmp_path / "shared_home" / ".gpucoll" / "store_secret"
    procs = [ctx.Process(target=_make, args=(path, queue)) for _ in range(8)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
    assert len(set(got)) == 1 and got[0] == path.read_text().strip()


def test_a_file_other_users_can_read_is_refused(home):
    secret_file.read_or_create(new_secret())
    path = secret_file.default_path()
    os.chmod(path, 0o644)
    with pytest.raises(InvalidArgument, match=r"open to other users \(mode 644\).*chmod 600.*GPUCOLL_STORE_SECRET"):
        secret_file.read_or_create(new_secret())


def test_a_short_or_unusable_file_says_how_to_set_the_secret(home):
    path = secret_file.default_path()
    path.parent.mkdir(mode=0o700)
    path.write_text("short\n")
    os.chmod(path, 0o600)
    with pytest.raises(InvalidArgument, match="holds 5 characters.*GPUCOLL_STORE_SECRET"):
        secret_file.read_or_create(new_secret())
    blocked = home / "not_a_dir"
    blocked.write_text("")
    with pytest.raises(InvalidArgument, match="cannot be used.*GPUCOLL_STORE_SECRET"):
        secret_file.read_or_create(new_secret(), blocked / "store_secret")


def _launch(rank, port):
    return LaunchInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, address="127.0.0.1", port=port,
                      launcher="slurm")


def test_ranks_without_a_shared_home_are_refused_naming_the_file(tmp_path, monkeypatch, home):
    """Two nodes that do not share $HOME each make their own file: the store refuses the other node's rank, and the
    error says where its secret came from and to set GPUCOLL_STORE_SECRET. With the same file, it is admitted."""
    port = free_port()
    server = external.launcher_store(_launch(0, port), timeout=5.0)
    try:
        other = tmp_path / "node_b"
        other.mkdir()
        monkeypatch.setenv("HOME", str(other))
        with pytest.raises(InvalidArgument, match=r"refused this rank.*per-user file .*node_b/\.gpucoll/store_secret"
                                                  r".*GPUCOLL_STORE_SECRET"):
            external.launcher_store(_launch(1, port), timeout=5.0)
        monkeypatch.setenv("HOME", str(home))
        client = external.launcher_store(_launch(1, port), timeout=5.0)
        client.set("k", b"v")
        assert server.get("k") == b"v"
        client.close()
    finally:
        server.close()


def test_a_set_secret_is_used_and_no_file_is_made(home, monkeypatch):
    monkeypatch.setenv("GPUCOLL_STORE_SECRET", new_secret())
    port = free_port()
    server = external.launcher_store(_launch(0, port), timeout=5.0)
    server.close()
    assert not (home / ".gpucoll").exists()
