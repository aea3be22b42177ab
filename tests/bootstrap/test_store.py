"""TCPStore: key-value semantics, blocking/timeouts, threads and processes, hostile peers, binding, close."""

import multiprocessing as mp
import os
import socket
import struct
import threading
import time

import helpers
import pytest

from gpucoll.bootstrap import TCPStore
from gpucoll.bootstrap import _wire as w
from gpucoll.bootstrap.store import MAGIC, MAX_FRAME
from gpucoll.errors import CollectiveTimeout, InvalidArgument, InvalidUsage, RemoteError

HOST = "127.0.0.1"


@pytest.fixture(autouse=True)
def _job_secret(monkeypatch):
    """Every store of these tests belongs to one job: its secret is in the environment, as a launcher puts it."""
    monkeypatch.setenv("GPUCOLL_STORE_SECRET", "unit-test-secret-0123456789abcdef")


@pytest.fixture
def server():
    store = TCPStore(HOST, 0, is_server=True, timeout=5.0)
    yield store
    store.close()


@pytest.fixture
def later():
    """later(delay, fn): call fn on another thread after `delay` seconds. When the test ends every such thread is
    joined, and an exception it raised fails the test (a bare threading.Timer would only print a warning, and a
    thread still running would act during the next test)."""
    started = []

    def start(delay, fn):
        errors = []

        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread below
                errors.append(e)

        timer = threading.Timer(delay, run)
        timer.start()
        started.append((timer, errors))
        return timer

    yield start
    for timer, errors in started:
        timer.join(10)
        assert not timer.is_alive(), "a delayed action is still running"
        if errors:
            raise errors[0]


def client(server, timeout=5.0):
    return TCPStore(HOST, server.port, is_server=False, timeout=timeout)


# -- basics --------------------------------------------------------------------------------------------------------

def test_set_get_binary_values(server):
    for key, value in [("a", b"1"), ("empty", b""), ("nul", b"\x00\xff" * 3), ("ünï/cødé", b"x"),
                       ("big", bytes(range(256)) * 4096)]:
        server.set(key, value)
        assert server.get(key) == value
    server.set("a", bytearray(b"over"))
    assert server.get("a") == b"over"


def test_add_check_delete(server):
    assert server.add("n", 5) == 5
    assert server.add("n", -7) == -2
    assert server.get("n") == b"-2"  # counters are readable as ASCII decimal
    assert server.check(["n"]) and server.check("n") and not server.check(["n", "missing"])
    assert server.check([])
    assert server.delete("n") is True
    assert server.delete("n") is False
    assert not server.check("n")
    assert server.add("n", 1) == 1  # recreated at 0


def test_add_on_non_counter_is_invalid_argument(server):
    server.set("s", b"hello")
    with pytest.raises(InvalidArgument, match="'s'.*not a counter"):
        server.add("s", 1)
    assert server.get("s") == b"hello"  # the connection survived the error


def test_json_helpers(server):
    server.set_json("j", {"a": [1, 2], "b": None})
    assert server.get_json("j") == {"a": [1, 2], "b": None}


@pytest.mark.parametrize("call", [
    lambda s: s.set(1, b"x"), lambda s: s.set("k", "text"), lambda s: s.get("k", timeout=-1),
    lambda s: s.get("k", timeout=float("inf")), lambda s: s.add("k", 1.5), lambda s: s.add("k", 1 << 63),
    lambda s: s.check(5), lambda s: s.wait(["k", 2]), lambda s: s.barrier("b", 0, rank=0),
    lambda s: s.barrier("b", 2), lambda s: s.barrier("b", 2, rank=2),
])
def test_invalid_arguments(server, call):
    with pytest.raises(InvalidArgument):
        call(server)


def test_constructor_arguments():
    with pytest.raises(InvalidArgument, match="port=0"):
        TCPStore(HOST, 0, is_server=False)
    with pytest.raises(InvalidArgument, match="port"):
        TCPStore(HOST, 70000, is_server=True)
    with pytest.raises(InvalidArgument, match="timeout"):
        TCPStore(HOST, 0, is_server=True, timeout=0)


# -- blocking and timeouts -----------------------------------------------------------------------------------------

def test_get_blocks_until_set(server, later):
    c = client(server)
    later(0.2, lambda: server.set("late", b"v"))
    t0 = time.monotonic()
    assert c.get("late", timeout=5) == b"v"
    assert 0.15 < time.monotonic() - t0 < 2
    c.close()


def test_get_timeout_names_key_and_timeout(server):
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout) as e:
        server.get("never", timeout=0.5)
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 1.5
    assert "'never'" in str(e.value) and "0.5 s" in str(e.value)
    server.set("after", b"1")  # the client is still usable
    assert server.get("after") == b"1"


def test_wait_and_wait_timeout_names_missing_keys(server, later):
    later(0.1, lambda: (server.set("w1", b""), server.set("w2", b"")))
    client(server).wait(["w1", "w2"], timeout=5)
    with pytest.raises(CollectiveTimeout, match=r"\['gone'\]"):
        server.wait(["w1", "gone"], timeout=0.2)


def test_default_timeout_is_the_store_timeout():
    with TCPStore(HOST, 0, is_server=True, timeout=0.3) as s:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="0.3 s"):
            s.get("x")
        assert time.monotonic() - t0 < 1.3


def test_client_retries_until_server_starts(later):
    probe = socket.socket()
    probe.bind((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()
    holder = {}
    later(0.3, lambda: holder.setdefault("srv", TCPStore(HOST, port, is_server=True, timeout=5)))
    c = TCPStore(HOST, port, is_server=False, timeout=5)
    c.set("k", b"v")
    assert holder["srv"].get("k") == b"v"
    c.close()
    holder["srv"].close()


def test_connect_timeout_names_host_and_port():
    probe = socket.socket()
    probe.bind((HOST, 0))
    port = probe.getsockname()[1]  # bound but not listening: connections are refused
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=rf"{HOST}:{port}"):
        TCPStore(HOST, port, is_server=False, timeout=0.4)
    assert time.monotonic() - t0 < 1.4
    probe.close()


# -- concurrency ---------------------------------------------------------------------------------------------------

def test_add_is_atomic_across_clients(server):
    clients = [client(server) for _ in range(6)]
    helpers.run_threads(6, lambda i: [clients[i].add("ctr", 1) for _ in range(50)])
    assert server.add("ctr", 0) == 300
    for c in clients:
        c.close()


def test_try_set_does_not_wait_behind_another_threads_wait(server, later):
    """The NCCL watchdog publishes its progress with try_set on the client the rank's main thread may be waiting
    on (a barrier can take the whole timeout): it must come back at once instead of stalling the watchdog."""
    c = client(server)
    waiter = later(0.0, lambda: c.get("released", timeout=5))
    deadline = time.monotonic() + 2
    while not c._lock.locked() and time.monotonic() < deadline:
        time.sleep(0.005)
    t0 = time.monotonic()
    assert c.try_set("progress", b"7") is False
    assert time.monotonic() - t0 < 0.5
    assert not server.check(["progress"])  # nothing was sent
    server.set("released", b"1")
    waiter.join(5)
    assert c.try_set("progress", b"8") is True
    assert server.get("progress") == b"8"
    with pytest.raises(InvalidArgument, match="bytes"):
        c.try_set("progress", "8")
    c.close()


def test_one_client_shared_by_threads(server):
    c = client(server)

    def work(i):
        for j in range(30):
            c.set(f"t{i}/{j}", f"{i}:{j}".encode())
            assert c.get(f"t{i}/{j}") == f"{i}:{j}".encode()
            c.add("shared", 1)

    helpers.run_threads(6, work)
    assert c.add("shared", 0) == 180
    c.close()


def test_barrier_across_threads_is_reusable(server):
    n = 4
    clients = [client(server) for _ in range(n)]
    order = []

    def work(rank):
        for step in range(3):
            order.append(step)
            clients[rank].barrier("b", n, timeout=5, rank=rank)

    helpers.run_threads(n, work)
    # Nobody entered step s+1 before everyone entered step s.
    assert order == sorted(order)
    for c in clients:
        c.close()


def test_barrier_timeout_names_missing_ranks(server):
    """Ranks 0 and 2 arrive, 1 and 3 never do: both arrived ranks raise, naming 1 and 3. Rank 2's outcome is
    brought back to this thread and checked here (a pytest.raises inside the thread could only warn)."""
    other = client(server)
    outcome = {}

    def rank2():
        try:
            other.barrier("bt", 4, 0.5, rank=2)
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome["error"] = exc

    t = threading.Thread(target=rank2)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout) as e:
        server.barrier("bt", 4, timeout=0.5, rank=0)
    assert time.monotonic() - t0 < 1.5
    t.join(10)
    assert not t.is_alive()
    for err in (e.value, outcome["error"]):
        assert isinstance(err, CollectiveTimeout), err
        assert err.ranks == (1, 3) and err.missing_ranks == (1, 3)
        assert "missing ranks: [1, 3]" in str(err) and "2 of 4" in str(err)
    other.close()


def _proc_main(port, rank, world):
    """A rank in a spawned process: count in, publish, meet at a barrier, read everyone's value."""
    store = TCPStore(HOST, port, is_server=False, timeout=10)
    store.add("joined", 1)
    store.set(f"value/{rank}", f"from-{rank}".encode())
    store.barrier("procs", world, timeout=10, rank=rank)
    seen = [store.get(f"value/{r}", timeout=5).decode() for r in range(world)]
    store.set_json(f"result/{rank}", {"seen": seen, "joined": int(store.get("joined"))})
    store.close()


@pytest.mark.spawns
def test_across_processes(server):
    world = 4
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_proc_main, args=(server.port, r, world)) for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        _proc_main(server.port, 0, world)
        server.wait([f"result/{r}" for r in range(world)], timeout=10)
        expected = [f"from-{r}" for r in range(world)]
        for r in range(world):
            assert server.get_json(f"result/{r}") == {"seen": expected, "joined": world}
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * (world - 1)


# -- hostile peers (tests/bootstrap/test_store_attacks.py has the attacks under load) ---------------------------

def _raw(server):
    return socket.create_connection((HOST, server.port), timeout=5)


def _assert_dropped(sock):
    # The server closed this connection (after logging), possibly after a one-byte verdict. Closing with our junk
    # still unread makes the kernel send a reset instead of a FIN, so both count as "dropped".
    try:
        while sock.recv(100):
            pass
    except ConnectionResetError:
        pass
    sock.close()


def test_unauthenticated_peers_never_reach_the_keys(server, capfd):
    c = client(server)
    c.set("before", b"1")
    capfd.readouterr()
    s = _raw(server)
    assert s.recv(4) == w.HELLO_MAGIC  # the challenge comes first
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    _assert_dropped(s)
    s = _raw(server)  # a client-side frame, without the handshake: its magic is wrong at the fourth byte
    s.sendall(struct.pack("!4sI", MAGIC, 12) + b"\x01\x00\x00\x00\x01k\x00\x00\x00\x00")
    _assert_dropped(s)
    s = _raw(server)  # a well-formed answer computed with another secret
    hello = s.recv(w.HELLO_BYTES)
    nonce = bytes(32)
    s.sendall(w.HELLO_MAGIC + nonce + w.client_mac(w.derive_key(b"not the job's secret!"), hello[5:], nonce))
    assert s.recv(1) == bytes([w.AUTH_DENIED])
    _assert_dropped(s)
    assert not server.check("k") and c.get("before") == b"1"
    log = capfd.readouterr().err
    for text in ("bad magic b'GET '", "authentication failed"):  # one warning per kind per second
        assert text in log, (text, log)
    assert server.server_stats()["dropped"] == {"magic": 2, "auth": 1}


def test_wrong_secret_is_refused_with_a_clear_error(server):
    with pytest.raises(InvalidArgument, match="GPUCOLL_STORE_SECRET must be equal on every rank"):
        TCPStore(HOST, server.port, is_server=False, timeout=2.0, secret="another job's secret, long enough")


def test_a_secret_is_required(monkeypatch):
    monkeypatch.delenv("GPUCOLL_STORE_SECRET")
    with pytest.raises(InvalidArgument, match="GPUCOLL_STORE_SECRET"):
        TCPStore(HOST, 0, is_server=True, timeout=1.0)
    with pytest.raises(InvalidArgument, match="at least 16"):
        TCPStore(HOST, 0, is_server=True, timeout=1.0, secret="short")


def test_malformed_frames_of_a_member_drop_only_that_connection(server, capfd):
    c = client(server)
    c.set("before", b"1")
    capfd.readouterr()
    secret = os.environ["GPUCOLL_STORE_SECRET"]
    s = helpers.store_socket(server.port, secret)
    s.sendall(struct.pack("!4sI", MAGIC, 0xFFFFFFFF))
    _assert_dropped(s)
    s = helpers.store_socket(server.port, secret)
    s.sendall(struct.pack("!4sI", MAGIC, 100) + b"0123456789")  # half a frame, then hang up (FIN)
    s.shutdown(socket.SHUT_WR)
    _assert_dropped(s)
    for payload in (b"\x63", b"\x02\x00\x00\x00\x02\xff\xfe" + struct.pack("!d", 1.0), b"\x01\x00\x00",
                    b"\x01\x00\x00\x00\x01k\x00\x00\x00\x00trailing", b""):
        s = helpers.store_socket(server.port, secret)
        s.sendall(struct.pack("!4sI", MAGIC, len(payload)) + payload)
        _assert_dropped(s)
    assert c.get("before") == b"1"
    c2 = client(server)
    c2.set("after", b"2")
    assert server.get("after") == b"2"
    c.close()
    c2.close()
    log = capfd.readouterr().err
    for text in (f"exceeds {MAX_FRAME}", "unknown opcode", "UTF-8", "trailing bytes", "payload truncated"):
        assert text in log, (text, log)
    assert not server.check("k")  # the junk SET with trailing bytes was not applied


# -- liveness of registered ranks -----------------------------------------------------------------------------------

def _registered_then_sleep(port, rank):
    s = TCPStore(HOST, port, is_server=False, timeout=5, rank=rank)
    s.set(f"up/{rank}", b"1")
    time.sleep(60)


@pytest.mark.spawns
def test_a_registered_rank_that_dies_is_named_at_once(server):
    p = mp.get_context("spawn").Process(target=_registered_then_sleep, args=(server.port, 3), daemon=True)
    p.start()
    try:
        server.get("up/3", timeout=30)
        assert server.lost() == {}  # asked without waiting
        threading.Timer(0.2, os.kill, args=(p.pid, 9)).start()
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout) as e:
            server.get("never", timeout=30)
        assert time.monotonic() - t0 < 5, "named only at the timeout"
        assert e.value.ranks == (3,) and "rank 3 left the job" in str(e.value) and "has exited" in str(e.value)
        lost = server.lost()
        assert list(lost) == [3] and "has exited" in lost[3], lost
        with pytest.raises(CollectiveTimeout, match="rank 3"):  # later waits too, at once
            server.wait(["never"], timeout=30)
        assert server.get("up/3") == b"1"  # what is there is still served
    finally:
        p.kill()
        p.join()


def test_clean_close_is_not_a_death_but_abandon_is(server):
    TCPStore(HOST, server.port, is_server=False, timeout=5, rank=1).close()
    with pytest.raises(CollectiveTimeout) as e:
        server.get("never", timeout=0.5)
    assert e.value.ranks == ()  # an ordinary timeout
    TCPStore(HOST, server.port, is_server=False, timeout=5, rank=2).abandon()
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="rank 2 left the job: it gave up after an error") as e:
        server.get("never", timeout=30)
    assert e.value.ranks == (2,) and time.monotonic() - t0 < 5


# -- binding and shutdown ------------------------------------------------------------------------------------------

def test_binds_only_to_the_given_address(server):
    assert server.bound_address[0] == "127.0.0.1"
    assert server.bound_address[1] == server.port != 0
    assert client(server).bound_address is None


def test_close_is_idempotent_and_frees_the_port():
    s = TCPStore(HOST, 0, is_server=True, timeout=2)
    c = TCPStore(HOST, s.port, is_server=False, timeout=2)
    port = s.port
    c.close()
    c.close()
    s.close()
    s.close()
    assert s.closed and c.closed
    with pytest.raises(InvalidUsage):
        s.get("k")
    with pytest.raises(InvalidUsage):
        c.set("k", b"")
    again = TCPStore(HOST, port, is_server=True, timeout=2)  # listening socket really closed
    again.close()


def test_server_close_wakes_a_blocked_remote_get(later):
    s = TCPStore(HOST, 0, is_server=True, timeout=5)
    c = TCPStore(HOST, s.port, is_server=False, timeout=5)
    later(0.2, s.close)
    t0 = time.monotonic()
    with pytest.raises(RemoteError):
        c.get("never", timeout=30)
    assert time.monotonic() - t0 < 3
    c.close()


def test_client_close_unblocks_its_own_waiting_thread(server, later):
    c = client(server)
    later(0.2, c.close)
    t0 = time.monotonic()
    with pytest.raises(InvalidUsage):
        c.get("never", timeout=30)
    assert time.monotonic() - t0 < 3


def test_a_clean_close_of_the_server_waits_for_ranks_still_leaving(later):
    """Rank 0's communicator closes its store with wait_for_others: a rank still connected (e.g. just behind it
    through the last barrier, its request not sent yet) is served until it closes, at most that long."""
    server = TCPStore(HOST, 0, is_server=True, timeout=5.0, rank=0)
    client = TCPStore(HOST, server.port, is_server=False, timeout=5.0, rank=1)
    server.set("done", b"1")

    def late_rank():
        client.wait(["done"], timeout=5.0)  # would find nobody listening without the wait
        client.close()

    later(0.3, late_rank)
    t0 = time.monotonic()
    server.close(wait_for_others=3.0)
    assert 0.25 < time.monotonic() - t0 < 2.5
    # Bounded: a rank that stays connected does not hold the server's close beyond it.
    server = TCPStore(HOST, 0, is_server=True, timeout=5.0, rank=0)
    stays = TCPStore(HOST, server.port, is_server=False, timeout=5.0, rank=1)
    t0 = time.monotonic()
    server.close(wait_for_others=0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0
    stays.close()
