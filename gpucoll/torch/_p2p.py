"""Point-to-point methods of ``ProcessGroupGpucoll`` (a mixin, split out for size): send, recv, recv from any source.

isend/irecv are queued and run together, as one gpucoll group, at the first wait of any of them or before the
group's next collective, so matching pairs never deadlock whatever order the ranks issue them in.

CPU tensors follow torch's (gloo's) matching rules: a recv names a source and a tag, or any source, and takes the
earliest message from that source with that tag; messages with other tags wait for their own recv. gpucoll's
channel between two ranks is ordered and untagged, so each send also posts an envelope (tag and size) in the group's
store, numbered per pair of ranks. A receiver reads the envelopes of its sources in order, picks the message a recv
matches, and pulls the payloads from that source in order: payloads that come before the one it wants are kept
until their own recv takes them. A recv from any source looks at every source's next envelope until one matches.
The cost is a store round trip or two per message (about 0.1 ms here), which torch's own gloo backend is close to.

CUDA tensors follow torch's NCCL backend: tags are ignored (the log says so, once) and recv needs a source, since
NCCL has no probe to find one; messages between two ranks match in the order they are posted.
"""

from __future__ import annotations

import datetime
import time

import torch

from gpucoll import _log
from gpucoll.errors import CollectiveTimeout, InvalidArgument, Unsupported
from gpucoll.torch._call import rank_in
from gpucoll.torch._convert import moved
from gpucoll.torch.work import Work

_ENVELOPE = "gpucoll-p2p/{src}>{dst}/{seq}"


class _Inbox:
    """What this rank knows of the messages one source sent it: envelopes read, payloads pulled, payloads kept."""

    __slots__ = ("claimed", "envelopes", "first_open", "kept", "pulled")

    def __init__(self):
        self.envelopes = []  # (tag, nbytes) by sequence number
        self.claimed = []  # whether a recv took that message
        self.first_open = 0  # no message before this one is unclaimed
        self.pulled = 0  # payloads received from the channel so far (they arrive in sequence order)
        self.kept = {}  # seq -> uint8 tensor: pulled before its recv came

    def match(self, tag: int):
        for seq in range(self.first_open, len(self.envelopes)):
            if not self.claimed[seq] and self.envelopes[seq][0] == tag:
                return seq
        return None

    def claim(self, seq: int) -> None:
        self.claimed[seq] = True
        while self.first_open < len(self.claimed) and self.claimed[self.first_open]:
            self.first_open += 1


class PointToPointMixin:
    def _init_p2p(self) -> None:
        self._sent = {}  # dst -> envelopes posted to it
        self._inboxes = {}  # src -> _Inbox
        self._warned_cuda_tag = False

    # -- torch's methods ------------------------------------------------------------------------------------------
    def send(self, tensors, dst_rank, tag=0):
        if self._delegate("send", tensors):
            return self._cpu_backend.send(tensors, dst_rank, tag)
        return self._queue_p2p("send", True, tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag=0):
        if self._delegate("recv", tensors):
            return self._cpu_backend.recv(tensors, src_rank, tag)
        return self._queue_p2p("recv", False, tensors, src_rank, tag)

    def recv_anysource(self, tensors, tag=0):
        """dist.recv/irecv without a source: the Work's ``_source_rank()`` names the sender once it is done."""
        if self._delegate("recv", tensors):
            return self._cpu_backend.recv_anysource(tensors, tag)
        return self._queue_p2p("recv", False, tensors, None, tag)

    recvAnysource = recv_anysource

    def _queue_p2p(self, what, send, tensors, peer, tag) -> Work:
        if len(tensors) != 1:
            raise Unsupported(f"{what}: gpucoll takes one tensor per call; got {len(tensors)}")
        t = tensors[0]
        tag = int(tag)
        if peer is not None:
            peer = rank_in(self, what, peer, "peer")
            if peer == self.rank():
                raise InvalidArgument(f"{what}: the peer must be another rank than this one ({peer})")
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{what}: expected a tensor; got {type(t).__name__}")
        if not t.is_contiguous():
            raise InvalidArgument(f"{what}: the tensor must be contiguous (call .contiguous())")
        if t.device.type == "cuda":
            if peer is None:
                raise Unsupported("recv from any source (dist.recv/irecv without src) is not supported on CUDA "
                                  "tensors (NCCL, like torch's NCCL backend, cannot find a sender); name the source")
            if tag and not self._warned_cuda_tag:
                self._warned_cuda_tag = True
                _log.warn(f"{what}: message tags are ignored on CUDA tensors, as torch's NCCL backend ignores them: "
                          f"sends and recvs between two ranks match in the order they are posted")
        elif t.device.type != "cpu":
            raise Unsupported(f"{what}: gpucoll's torch backend runs on CPU and CUDA tensors; got {t.device}")
        work = Work([t], pending=self, device=t.device if t.is_cuda else None)
        if send and t.device.type == "cpu":
            seq = self._sent.get(peer, 0)
            self._sent[peer] = seq + 1
            # Posted now, not at the flush: a receiver can match this message while this rank is still busy.
            self._store.set(_ENVELOPE.format(src=self.rank(), dst=peer, seq=seq),
                            f"{tag} {t.numel() * t.element_size()}")
        elif not send:
            work._source = peer
        self._p2p.append((send, peer, t, work, tag))
        return work

    # -- running the queue ----------------------------------------------------------------------------------------
    def _flush_p2p(self) -> None:
        """Runs every queued send/recv, one gpucoll group per device, in the order they were posted."""
        items, self._p2p = self._p2p, []
        if not items:
            return
        by_device = {}
        for item in items:
            by_device.setdefault(item[2].device.type, []).append(item)
        error = None
        try:
            for kind, queued in by_device.items():
                if kind == "cpu":
                    error = self._run_cpu(queued)
                else:
                    self._run_cuda(queued)
        except BaseException as e:
            for *_, work, _ in items:
                work._settled(e)
            raise
        for *_, work, _ in items:
            work._settled()
        if error is not None:
            raise error

    def _run_cuda(self, items) -> None:
        comm = self.communicator(items[0][2].device, what="send/recv")
        works = []
        with comm.group():
            for send, peer, t, _, _ in items:
                flat = moved(t)
                works.append(comm.send(flat, peer, async_op=True) if send else comm.recv(flat, peer, async_op=True))
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(items[0][2].device))
        for *_, work, _ in items:
            work._works, work._event = tuple(works), event

    def _run_cpu(self, items):
        """Matches the recvs (reading envelopes; may wait for senders), then runs sends and payload pulls as one
        group. Returns a size-mismatch error to raise once the group ran (the channel stays in step), or None."""
        comm = self.communicator("cpu", what="send/recv")
        ops, copies, error = [], [], None
        for send, peer, t, work, tag in items:
            flat = moved(t).view(torch.uint8)
            if send:
                ops.append((True, peer, flat))
                continue
            src, seq = self._match(peer, tag)
            work._source = src
            box = self._inboxes[src]
            box.claim(seq)
            nbytes = box.envelopes[seq][1]
            if nbytes != flat.numel() and error is None:
                error = InvalidArgument(f"recv: the message from rank {src} (tag {tag}) has {nbytes} bytes; the "
                                        f"tensor has {flat.numel()}")
            while box.pulled <= seq:  # earlier payloads from src come first on the channel: keep them
                pos, box.pulled = box.pulled, box.pulled + 1
                if pos == seq and nbytes == flat.numel():
                    ops.append((False, src, flat))
                else:
                    box.kept[pos] = torch.empty(box.envelopes[pos][1], dtype=torch.uint8)
                    ops.append((False, src, box.kept[pos]))
            kept = box.kept.pop(seq, None)
            if kept is not None and nbytes == flat.numel():
                copies.append((flat, kept))
        if ops:
            with comm.group():
                for send, peer, buf in ops:
                    (comm.send if send else comm.recv)(buf, peer)
        for dst, src in copies:
            dst.copy_(src)
        return error

    def _match(self, src, tag: int):
        """(source, sequence number) of the message a recv from `src` (None: any) with `tag` takes."""
        if src is not None:
            box = self._inboxes.setdefault(src, _Inbox())
            while True:
                seq = box.match(tag)
                if seq is not None:
                    return src, seq
                self._read_envelope(src, box, wait=True)
        peers = [r for r in range(self.size()) if r != self.rank()]
        deadline, pause = time.monotonic() + self._timeout, 1e-4
        while True:
            for r in peers:
                box = self._inboxes.setdefault(r, _Inbox())
                seq = box.match(tag)
                if seq is None and self._read_envelope(r, box, wait=False):
                    seq = box.match(tag)
                if seq is not None:
                    return r, seq
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"recv from any source (tag {tag}): no message came from ranks {peers} "
                                        f"within {self._timeout:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _read_envelope(self, src: int, box: _Inbox, wait: bool) -> bool:
        key = _ENVELOPE.format(src=src, dst=self.rank(), seq=len(box.envelopes))
        if wait:
            try:
                self._store.wait([key], datetime.timedelta(seconds=self._timeout))
            except RuntimeError as e:  # torch's DistStoreError
                raise CollectiveTimeout(f"recv: no message came from rank {src} within {self._timeout:g} s "
                                        f"(is it alive, and did it send?): {e}") from None
        elif not self._store.check([key]):
            return False
        tag, nbytes = (int(v) for v in self._store.get(key).split())
        self._store.delete_key(key)
        box.envelopes.append((tag, nbytes))
        box.claimed.append(False)
        return True
