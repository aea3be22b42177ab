"""Point-to-point send/recv on the host backend, checked byte for byte.

Grouped rings in both orders (every send issued before the receives, and the other way round), all-pairs
exchanges, messages several MiB long (larger than a p2p slot of at most 1 MiB, so a transfer takes several pieces
and, in a group, sends and receives to several peers must progress together), zero-length messages, two
messages to the same peer in one group (they match in issue order), standalone (ungrouped) chains, torch tensors
on either side, a group that also holds a collective, nested groups, and bad peers (typed errors; the
communicator still works after each). Many messages to one peer in one group are covered by
test_many_messages_to_one_peer_in_one_group.

One gpucoll.spawn per world size (2, 3, 4); each worker runs every case and returns its failures as text.
"""

from __future__ import annotations

import time

import helpers
import numpy as np
import pytest

import gpucoll

pytestmark = [pytest.mark.spawns, *helpers.timeout_mark(300)]

WORLD_SIZES = (2, 3, 4)
BIG = 5 * 2**20 + 3  # bytes: six pieces of a 1 MiB p2p slot, with a ragged last one
SIZES = (0, 1, 28, BIG)
TIMEOUT = 60.0


def _payload(src: int, dst: int, tag: int, nbytes: int) -> np.ndarray:
    """The bytes rank src sends to rank dst as message `tag` (distinct for every (src, dst, tag))."""
    # Period 251 (prime): a piece landing at a wrong offset shows, as the slot size is no multiple of 251.
    base = ((np.arange(251, dtype=np.uint32) * 131 + (src * 7 + dst * 13 + tag * 29 + 1)) % 251).astype(np.uint8)
    return np.resize(base, nbytes)


def _recv_buf(nbytes: int) -> np.ndarray:
    return np.full(nbytes, 0xA5, dtype=np.uint8)


class Report:
    def __init__(self):
        self.failures = []
        self.checked = {}

    def check(self, section: str, label: str, got: np.ndarray, want: np.ndarray) -> None:
        self.checked[section] = self.checked.get(section, 0) + 1
        err = helpers.mismatch(np.asarray(got).reshape(-1), np.asarray(want).reshape(-1))
        if err:
            self.failures.append((section, f"{label}: {err}"))

    def fail(self, section: str, label: str, text: str) -> None:
        self.failures.append((section, f"{label}: {text}"))


_FATAL = (gpucoll.errors.InvalidUsage, gpucoll.errors.CollectiveTimeout, gpucoll.errors.RemoteError)


# -- cases ----------------------------------------------------------------------------------------------------

def ring(comm, rep, send_first: bool, nbytes: int, tag: int) -> None:
    W, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    got = _recv_buf(nbytes)
    with comm.group():
        if send_first:
            comm.send(_payload(r, nxt, tag, nbytes), nxt)
            comm.recv(got, prv)
        else:
            comm.recv(got, prv)
            comm.send(_payload(r, nxt, tag, nbytes), nxt)
    rep.check("ring", f"ring {'send' if send_first else 'recv'} first, {nbytes} bytes", got,
              _payload(prv, r, tag, nbytes))


def all_pairs(comm, rep, send_first: bool, nbytes: int, tag: int) -> None:
    """Round d: send to r+d, receive from r-d (every ordered pair once over the rounds); and a group that
    exchanges with every peer at once."""
    W, r = comm.world_size, comm.rank
    for d in range(1, W):
        to, frm = (r + d) % W, (r - d) % W
        got = _recv_buf(nbytes)
        with comm.group():
            if send_first:
                comm.send(_payload(r, to, tag + d, nbytes), to)
                comm.recv(got, frm)
            else:
                comm.recv(got, frm)
                comm.send(_payload(r, to, tag + d, nbytes), to)
        rep.check("pairs", f"shift {d}, {nbytes} bytes, {'send' if send_first else 'recv'} first", got,
                  _payload(frm, r, tag + d, nbytes))
    peers = [p for p in range(W) if p != r]
    bufs = {p: _recv_buf(nbytes) for p in peers}
    with comm.group():
        for p in (peers if send_first else reversed(peers)):
            if send_first:
                comm.send(_payload(r, p, tag, nbytes), p)
            comm.recv(bufs[p], p)
            if not send_first:
                comm.send(_payload(r, p, tag, nbytes), p)
    for p in peers:
        rep.check("pairs", f"exchange with every peer, from {p}, {nbytes} bytes", bufs[p], _payload(p, r, tag, nbytes))


def same_peer_in_order(comm, rep) -> None:
    """Two messages to the same peer in one group match in issue order (equal sizes, so only the payload tells
    them apart; and an empty one first), also interleaved with two messages each way to/from the other
    neighbour. A barrier first, and at most two pieces per (sender, receiver) pair in a group: with more, the
    library's race (test_many_messages_to_one_peer_in_one_group) would make this test flaky."""
    W, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    for sizes, tag in (((7, 7), 100), ((0, 5), 110), ((3, 2 * 2**10), 120)):
        comm.barrier()
        got = [_recv_buf(n) for n in sizes]
        with comm.group():
            for k, n in enumerate(sizes):
                comm.send(_payload(r, nxt, tag + k, n), nxt)
                comm.recv(got[k], prv)
        for k, n in enumerate(sizes):
            rep.check("order", f"message {k} of {sizes} from {prv}", got[k], _payload(prv, r, tag + k, n))
    comm.barrier()
    got = [_recv_buf(7) for _ in range(2)]
    with comm.group():
        for k in range(2):
            comm.recv(got[k], prv)
        for k in range(2):
            comm.send(_payload(r, nxt, 200 + k, 7), nxt)
    for k in range(2):
        rep.check("order", f"recvs first: message {k} from {prv}", got[k], _payload(prv, r, 200 + k, 7))
    if W >= 3:
        # Interleave: messages to next and to previous alternate; each stream keeps its own order.
        comm.barrier()
        up = [_recv_buf(9) for _ in range(2)]
        down = [_recv_buf(9) for _ in range(2)]
        with comm.group():
            for k in range(2):
                comm.send(_payload(r, nxt, 300 + k, 9), nxt)
                comm.recv(down[k], nxt)
                comm.send(_payload(r, prv, 400 + k, 9), prv)
                comm.recv(up[k], prv)
        for k in range(2):
            rep.check("order", f"interleaved: message {k} from {prv}", up[k], _payload(prv, r, 300 + k, 9))
            rep.check("order", f"interleaved: message {k} from {nxt}", down[k], _payload(nxt, r, 400 + k, 9))


def zero_length(comm, rep) -> None:
    W, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    empty_f32 = np.zeros(0, np.float32)
    # Standalone: even ranks send first, odd ones receive first (zero-length sends never block).
    try:
        if r % 2 == 0:
            comm.send(empty_f32, nxt)
            comm.recv(np.zeros(0, np.float32), prv)
        else:
            comm.recv(np.zeros(0, np.float32), prv)
            comm.send(empty_f32, nxt)
        rep.checked["zero"] = rep.checked.get("zero", 0) + 1
    except Exception as exc:
        rep.fail("zero", "standalone zero-length send/recv", f"raised {type(exc).__name__}: {exc}")
        if isinstance(exc, _FATAL):
            raise
    # In a group, before and after a non-empty message to the same peer: order must still hold.
    for first_empty in (True, False):
        comm.barrier()
        a = _recv_buf(5)
        with comm.group():
            if first_empty:
                comm.send(np.zeros(0, np.uint8), nxt)
            comm.send(_payload(r, nxt, 1 + first_empty, 5), nxt)
            if not first_empty:
                comm.send(np.zeros(0, np.uint8), nxt)
            if first_empty:
                comm.recv(np.zeros(0, np.uint8), prv)
            comm.recv(a, prv)
            if not first_empty:
                comm.recv(np.zeros(0, np.uint8), prv)
        rep.check("zero", f"5 bytes {'after' if first_empty else 'before'} an empty message", a,
                  _payload(prv, r, 1 + first_empty, 5))
    # Only empty messages in a group, to every peer.
    with comm.group():
        for p in range(W):
            if p != r:
                comm.recv(np.zeros(0, np.int64), p)
                comm.send(np.zeros(0, np.int64), p)
    rep.checked["zero"] += 1


def chain(comm, rep, nbytes: int) -> None:
    """Standalone (ungrouped) send/recv: rank 0 -> 1 -> ... -> W-1, each forwarding what it got."""
    W, r = comm.world_size, comm.rank
    buf = _payload(0, W - 1, 7, nbytes) if r == 0 else _recv_buf(nbytes)
    if r > 0:
        comm.recv(buf, r - 1)
        rep.check("chain", f"chain of {W}, {nbytes} bytes, at rank {r}", buf, _payload(0, W - 1, 7, nbytes))
    if r < W - 1:
        comm.send(buf, r + 1)


def torch_tensors(comm, rep) -> None:
    import torch

    W, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    n = 1000
    # float32: numpy -> torch and torch -> numpy; bfloat16 and int64 torch -> torch; a multi-piece float64.
    want_f32 = (np.arange(n, dtype=np.float32) * 3 + prv).astype(np.float32)
    got_t = torch.full((n,), -1.0, dtype=torch.float32)
    with comm.group():
        comm.send(np.arange(n, dtype=np.float32) * 3 + r, nxt)
        comm.recv(got_t, prv)
    rep.check("torch", "numpy float32 -> torch float32", got_t.numpy(), want_f32)
    got_np = np.full(n, -1.0, np.float32)
    with comm.group():
        comm.recv(got_np, prv)
        comm.send(torch.arange(n, dtype=torch.float32) * 3 + r, nxt)
    rep.check("torch", "torch float32 -> numpy float32", got_np, want_f32)
    bf = torch.arange(n, dtype=torch.float32).to(torch.bfloat16) * (r + 1)
    got_bf = torch.zeros(n, dtype=torch.bfloat16)
    with comm.group():
        comm.send(bf, nxt)
        comm.recv(got_bf, prv)
    want_bf = torch.arange(n, dtype=torch.float32).to(torch.bfloat16) * (prv + 1)
    rep.check("torch", "torch bfloat16", got_bf.view(torch.int16).numpy(), want_bf.view(torch.int16).numpy())
    got_2d = torch.zeros((10, 100), dtype=torch.int64)
    with comm.group():
        comm.recv(got_2d, prv)
        comm.send(torch.arange(n, dtype=torch.int64).reshape(10, 100) * 7 - r, nxt)
    rep.check("torch", "torch int64 (10, 100)", got_2d.numpy(), np.arange(n, dtype=np.int64).reshape(10, 100) * 7 - prv)
    big = BIG // 8
    got_big = torch.zeros(big, dtype=torch.float64)
    with comm.group():
        comm.send(torch.arange(big, dtype=torch.float64) + r * 0.5, nxt)
        comm.recv(got_big, prv)
    rep.check("torch", f"torch float64, {big * 8} bytes", got_big.numpy(), np.arange(big, dtype=np.float64) + prv * 0.5)
    t = torch.zeros(3)
    with comm.group():
        res = comm.recv(t, prv)
        comm.send(torch.ones(3), nxt)
    if res is not t:
        rep.fail("torch", "recv return value", f"returned {type(res).__name__}, expected the tensor passed in")


def group_with_collective(comm, rep) -> None:
    """p2p queued in a group run before a collective issued inside the same group; nested groups are one group."""
    W, r = comm.world_size, comm.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    got = _recv_buf(BIG)
    x = np.full(4, r + 1, np.int64)
    with comm.group():
        comm.recv(got, prv)
        comm.send(_payload(r, nxt, 9, BIG), nxt)
        comm.all_reduce(x)
    rep.check("group", "ring then all_reduce in one group: message", got, _payload(prv, r, 9, BIG))
    rep.check("group", "ring then all_reduce in one group: all_reduce", x, np.full(4, W * (W + 1) // 2, np.int64))
    got = _recv_buf(BIG)
    with comm.group():
        with comm.group():
            comm.recv(got, prv)
        with comm.group():
            comm.send(_payload(r, nxt, 10, BIG), nxt)
    rep.check("group", "nested groups", got, _payload(prv, r, 10, BIG))


def bad_peer_cases(comm) -> list:
    W, r = comm.world_size, comm.rank
    nxt = (r + 1) % W
    buf = np.zeros(4, np.float32)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    cases = []
    for peer in (r, -1, W, W + 5):
        for op in ("send", "recv"):
            cases.append((f"{op} peer={peer} (self or out of range)",
                          lambda o=op, p=peer: getattr(comm, o)(buf, p), ["peer", str(peer)]))
    for peer in (True, "1", 1.0, None):
        cases.append((f"send peer={peer!r}", lambda p=peer: comm.send(buf, p), ["peer", repr(peer)]))

    def in_group_after_valid_send():
        # The valid send queued before the mistake must be dropped with the group on every rank, not left
        # behind to be matched by a later receive.
        with comm.group():
            comm.send(np.full(4, 99.0, np.float32), nxt)
            comm.recv(buf, r)

    cases.append(("recv from self inside a group after a valid send", in_group_after_valid_send, ["peer", str(r)]))
    cases.append(("recv into a read-only array", lambda: comm.recv(ro, nxt), ["x", "writable"]))
    cases.append(("send a list", lambda: comm.send([1.0, 2.0], nxt), ["x", "list"]))
    return cases


def bad_peers(comm, rep) -> None:
    from gpucoll.errors import InvalidArgument

    W, r = comm.world_size, comm.rank
    for label, thunk, fragments in bad_peer_cases(comm):
        try:
            thunk()
            rep.fail("bad", label, "did not raise")
        except InvalidArgument as exc:
            missing = [f for f in fragments if f not in str(exc)]
            if missing:
                rep.fail("bad", label, f"message {str(exc)!r} lacks {missing}")
        except Exception as exc:
            rep.fail("bad", label, f"raised {type(exc).__name__}: {exc}, expected InvalidArgument")
            if isinstance(exc, _FATAL):
                raise
        rep.checked["bad"] = rep.checked.get("bad", 0) + 1
        err = helpers.still_works(comm)
        if err:
            rep.fail("bad", f"after {label}", err)
            return
    # The dropped send must not be received by the next exchange: it gets the new message.
    nxt, prv = (r + 1) % W, (r - 1) % W
    got = np.zeros(4, np.float32)
    with comm.group():
        comm.send(np.full(4, float(r), np.float32), nxt)
        comm.recv(got, prv)
    rep.check("bad", "exchange after the failed group", got, np.full(4, float(prv), np.float32))


def size_mismatch(comm, rep) -> None:
    """Last, because it breaks the communicator: rank 1 expects 16 bytes, rank 0 sends 8."""
    from gpucoll.errors import InvalidArgument

    if comm.rank == 0:
        comm.send(np.zeros(2, np.float32), 1)
    elif comm.rank == 1:
        try:
            comm.recv(np.zeros(4, np.float32), 0)
            rep.fail("mismatch", "recv of 16 bytes from a send of 8", "did not raise")
        except InvalidArgument as exc:
            missing = [f for f in ("16", "8", "rank 0") if f not in str(exc)]
            if missing:
                rep.fail("mismatch", "recv of 16 bytes from a send of 8", f"message {str(exc)!r} lacks {missing}")
        except Exception as exc:  # noqa: BLE001
            rep.fail("mismatch", "recv of 16 bytes from a send of 8", f"raised {type(exc).__name__}: {exc}")
        rep.checked["mismatch"] = 1


def _p2p_worker(comm):
    rep = Report()
    torch_error = helpers.torch_import_error()
    steps = []
    for tag, nbytes in enumerate(SIZES):
        for send_first in (True, False):
            steps.append((ring, (send_first, nbytes, 10 * tag)))
            steps.append((all_pairs, (send_first, nbytes, 1000 + 10 * tag)))
    steps += [(same_peer_in_order, ()), (zero_length, ()), (chain, (BIG,)), (chain, (13,)),
              (group_with_collective, ()), (bad_peers, ())]
    if torch_error is None:
        steps.append((torch_tensors, ()))
    t0 = time.monotonic()
    for fn, args in steps:
        try:
            fn(comm, rep, *args)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            rep.fail(fn.__name__, f"{fn.__name__}{args}", f"raised {type(exc).__name__}: {exc}")
            break
    else:
        comm.barrier()
        size_mismatch(comm, rep)
    return {"failures": rep.failures, "checked": rep.checked, "elapsed": time.monotonic() - t0,
            "torch": torch_error}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def reports(request):
    W = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("GPUCOLL_DEBUG_CHECKS", raising=False)
        per_rank = gpucoll.spawn(_p2p_worker, W, backend="host", timeout=TIMEOUT)
    return W, per_rank


def _check(per_rank, section, expected_per_rank):
    failures = [f"rank {r}: {t}" for r, rep in enumerate(per_rank) for sec, t in rep["failures"] if sec == section]
    assert not failures, helpers.format_failures(failures)
    counts = [rep["checked"].get(section, 0) for rep in per_rank]
    assert all(c == e for c, e in zip(counts, expected_per_rank)), (section, counts, expected_per_rank)


def _no_stray_failures(per_rank):
    known = {"ring", "pairs", "order", "zero", "chain", "group", "torch", "bad", "mismatch"}
    stray = [f"rank {r}: {sec}: {t}" for r, rep in enumerate(per_rank) for sec, t in rep["failures"]
             if sec not in known]
    assert not stray, helpers.format_failures(stray)


def test_grouped_ring_both_orders(reports):
    W, per_rank = reports
    _no_stray_failures(per_rank)
    _check(per_rank, "ring", [2 * len(SIZES)] * W)


def test_pairwise_exchanges(reports):
    W, per_rank = reports
    _check(per_rank, "pairs", [2 * len(SIZES) * 2 * (W - 1)] * W)


def test_several_messages_to_one_peer_match_in_order(reports):
    W, per_rank = reports
    _check(per_rank, "order", [6 + 2 + (4 if W >= 3 else 0)] * W)


def test_zero_length_messages(reports):
    W, per_rank = reports
    _check(per_rank, "zero", [4] * W)


def test_standalone_chain_multi_piece(reports):
    W, per_rank = reports
    _check(per_rank, "chain", [0] + [2] * (W - 1))


def test_group_with_collective_and_nested_groups(reports):
    W, per_rank = reports
    _check(per_rank, "group", [3] * W)


def test_torch_tensors(reports):
    W, per_rank = reports
    if per_rank[0]["torch"] is not None:
        pytest.skip(per_rank[0]["torch"])
    _check(per_rank, "torch", [5] * W)


def test_bad_peers_typed_errors_and_still_usable(reports):
    W, per_rank = reports
    n = 8 + 4 + 3 + 1
    _check(per_rank, "bad", [n] * W)


def test_mismatched_sizes_raise_on_the_receiver(reports):
    W, per_rank = reports
    _check(per_rank, "mismatch", [0, 1] + [0] * (W - 2))


# -- several multi-piece messages to one peer in one group --------------------------------------------------------

def _same_peer_stress_worker(comm, seconds):
    """Both ranks exchange five messages (multi-piece ones among them) with each other in one group, again and
    again; returns None when every message arrived intact, else the first failure.

    The ranks stop after the same iteration: each group also carries every rank's "keep going" flag (its own clock
    against the deadline), and both stop once either flag is down. A rank that stopped on its own clock would leave
    its peer waiting in a group it never joins."""
    r, peer = comm.rank, 1 - comm.rank
    sizes = (BIG, 1, 2 * 2**20, 0, 3)
    deadline = time.monotonic() + seconds
    it = 0
    going = True
    while going:
        got = [np.zeros(n, np.uint8) for n in sizes]
        mine, theirs = np.array([time.monotonic() < deadline], np.uint8), np.zeros(1, np.uint8)
        try:
            with comm.group():
                for k, n in enumerate(sizes):
                    comm.send(np.full(n, (10 * r + k + it) % 256, np.uint8), peer)
                    comm.recv(got[k], peer)
                comm.send(mine, peer)
                comm.recv(theirs, peer)
        except Exception as exc:  # noqa: BLE001
            return f"iteration {it}: {type(exc).__name__}: {exc}"
        for k, n in enumerate(sizes):
            if not np.all(got[k] == (10 * peer + k + it) % 256):
                bad = np.flatnonzero(got[k] != (10 * peer + k + it) % 256)
                return f"iteration {it}: message {k} ({n} bytes): {bad.size} bytes wrong from [{bad[0]}]"
        going = bool(mine[0] and theirs[0])
        it += 1
    return None


@pytest.mark.slow
def test_many_messages_to_one_peer_in_one_group():
    """Reproduces within a second or so on the 2-core machine (usually within 200 iterations); runs up to 15 s."""
    per_rank = gpucoll.spawn(_same_peer_stress_worker, 2, args=(15.0,), backend="host", timeout=TIMEOUT)
    assert per_rank == [None, None], per_rank
