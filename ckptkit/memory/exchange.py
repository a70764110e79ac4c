"""Byte transfers between ranks for the memory tier, on a dedicated gloo group.

The group is the tier's own (made once, collectively, when the tier is built): the background
thread that copies snapshots to peers never touches the training process group, and the group's
timeout bounds every wait, so a lost peer fails the copy instead of hanging it.

Two shapes of transfer:

* :meth:`Link.swap` — a round in which every rank sends to one rank and receives from another
  (a permutation: the replica rounds, the parity rounds). All pairs run at once.
  :meth:`Link.swap_parts` is the same round for a message per window, in place, and
  :meth:`Link.swap_bundles` for whole rank folders.
* :meth:`Link.transfer_bundles` — a list of ``(sender, receiver, key)`` moves of whole rank folders
  that every rank walks in the same order, each rank acting only in its own (a restore's copies
  from peers), streamed. The same order on every rank means no two ranks ever wait on
  each other in a cycle. :meth:`Link.send_window` / :meth:`Link.recv_window` are the single
  messages of such a walk whose sizes both sides know (a parity rebuild's windows,
  :mod:`ckptkit.memory.rebuild`).
"""

from __future__ import annotations

import datetime
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ckptkit.engine.collective import release_group

if TYPE_CHECKING:
    from ckptkit.memory.bundle import IncomingBundle, OutgoingBundle


#: A rank folder's files travel in messages of at most this many bytes, each received into the
#: link's own buffer and written into the receiver's file from there: both sides cut the same
#: files (the header listed their sizes) at the same places, so the messages match one to one.
MESSAGE_BYTES = 4 << 20


def messages(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(file index, offset, length) of every message that carries files of ``sizes``, in order."""
    return [(i, at, min(MESSAGE_BYTES, size - at)) for i, size in enumerate(sizes) for at in range(0, size, MESSAGE_BYTES)]


def _write(sink: IncomingBundle, msg: tuple[int, int, int], inbox: bytearray) -> BaseException | None:
    """Write one received message into its file; the failure, if any, to raise once the round ends."""
    i, at, n = msg
    try:
        sink.write(i, at, memoryview(inbox)[:n])
    except Exception as exc:  # noqa: BLE001 - a full folder, a header the bytes overrun: raised by the caller
        return exc
    return None


def _attempt(work: Callable[[], object]) -> BaseException | None:
    """Run ``work``; its failure, if any, instead of raising it. For the steps of a walk that are this
    rank's alone (committing a received copy, closing its files): raised, such a failure would
    leave the walk here, and every later move of this rank would never be made while its peers
    waited for it until the group's timeout."""
    try:
        work()
    except Exception as exc:  # noqa: BLE001 - that move's reason, reported once the walk is complete
        return exc
    return None


def _u8(buf: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over ``buf`` without a copy (read-only buffers are only ever sent)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": sends never write to it
        return torch.frombuffer(buf, dtype=torch.uint8)


class Link:
    """Point-to-point bytes between the ranks of ``ranks`` (global ranks; None: the whole world)."""

    def __init__(self, ranks: Sequence[int] | None, timeout_seconds: float) -> None:
        self.group = dist.new_group(ranks=list(ranks) if ranks is not None else None, backend="gloo",
                                    timeout=datetime.timedelta(seconds=timeout_seconds))
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        # made once: two buffers, so a message is received into one while the one before it is
        # written from the other (the write of a received copy overlaps its transfer)
        self._inboxes = (bytearray(MESSAGE_BYTES), bytearray(MESSAGE_BYTES))
        self._inboxes_t = tuple(_u8(b) for b in self._inboxes)
        self._inbox_lock = threading.Lock()  # the tier's thread and a restore never share them

    def close(self) -> None:
        """Destroy this link's group now (see :func:`ckptkit.engine.collective.release_group`)."""
        if self.group is not None:
            group, self.group = self.group, None
            release_group(group)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank's ``ok`` is true: a barrier that also agrees an outcome (one all-reduce,
        bounded by the group's timeout), so every rank takes the same branch after it."""
        t = torch.tensor([0 if ok else 1], dtype=torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return not int(t.item())

    def swap(self, send_to: int, payload: bytes | memoryview, recv_from: int) -> bytearray:
        """Send ``payload`` to ``send_to`` while receiving from ``recv_from``; sizes go first."""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        got = torch.zeros(1, dtype=torch.int64)
        self._batch([(size, send_to, True), (got, recv_from, False)])
        out = bytearray(int(got.item()))
        ops = []
        if len(payload):
            ops.append((_u8(payload), send_to, True))
        if len(out):
            ops.append((_u8(out), recv_from, False))
        self._batch(ops)
        return out

    def swap_parts(self, send_to: int, parts: Sequence[memoryview], recv_from: int,
                   sinks: Sequence[memoryview]) -> None:
        """Send ``parts`` to ``send_to`` while receiving into ``sinks`` from ``recv_from``, one message
        per part, in order. Both sides already know every size (a swapped header listed them), so
        nothing else goes over the wire and each part is read from, and received into, its place."""
        for i in range(max(len(parts), len(sinks))):
            ops = []
            if i < len(parts) and len(parts[i]):
                ops.append((_u8(parts[i]), send_to, True))
            if i < len(sinks) and len(sinks[i]):
                ops.append((_u8(sinks[i]), recv_from, False))
            self._batch(ops)

    def swap_bundles(self, send_to: int, out: OutgoingBundle, recv_from: int, sink: IncomingBundle) -> None:
        """Send the files of ``out`` to ``send_to`` while receiving ``sink``'s from ``recv_from`` (both
        headers already swapped), in messages of at most :data:`MESSAGE_BYTES`: each read from the
        sender's mapped file and written into the receiver's file from the link's buffer.

        A write that fails (a full memory folder) is raised once every message has arrived: the
        sender's messages are still received, so both sides leave the round in step, and the
        failure is the snapshot's, agreed after it."""
        sends = messages([len(p) for p in out.parts])
        recvs = messages(sink.sizes)

        def start(k: int) -> tuple[list[Any], list[Any]]:
            ops = []
            if k < len(sends):
                i, at, n = sends[k]
                ops.append((_u8(out.parts[i][at:at + n]), send_to, True))
            if k < len(recvs):
                ops.append((self._inboxes_t[k % 2][: recvs[k][2]], recv_from, False))
            return ops, self._start(ops)

        with self._inbox_lock:
            failed = self._pipeline(max(len(sends), len(recvs)), start, recvs, sink)
        if failed is not None:
            raise failed

    def _pipeline(self, rounds: int, start: Callable[[int], tuple[list[Any], list[Any]]],
                  recvs: list[tuple[int, int, int]], sink: IncomingBundle) -> BaseException | None:
        """``rounds`` rounds of messages, started by ``start(k)`` (its tensors, kept until their works
        are done, and the works), round ``k`` receiving ``recvs[k]`` into buffer ``k % 2``: the message
        before is written from the other buffer while it travels. Every round runs, even after a
        failed write (its sender sends them all); returns the first failure, to raise once they end."""
        failed: BaseException | None = None
        for k in range(rounds):
            keep, works = start(k)
            if 0 < k <= len(recvs) and failed is None:
                failed = _write(sink, recvs[k - 1], self._inboxes[(k - 1) % 2])
            for work in works:
                work.wait()
            del keep, works  # no tensor over the sender's map outlives its message
        if recvs and rounds == len(recvs) and failed is None:  # the last one, unless a later round wrote it
            failed = _write(sink, recvs[-1], self._inboxes[(len(recvs) - 1) % 2])
        return failed

    def _batch(self, ops: list[tuple[torch.Tensor, int, bool]]) -> None:
        for work in self._start(ops):
            work.wait()

    def _start(self, ops: list[tuple[torch.Tensor, int, bool]]) -> list[Any]:
        """Start ``ops`` (sends and receives) together; their works, to wait on."""
        if not ops:
            return []
        p2p = [dist.P2POp(dist.isend if send else dist.irecv, t, self._global(peer), self.group)
               for t, peer, send in ops]
        return list(dist.batch_isend_irecv(p2p))

    def send_window(self, to: int, data: memoryview | None) -> None:
        """Send one window to ``to`` (both sides know its size), or word that it could not be read
        (``data`` None): a flag first, so the receiver is never left waiting for bytes."""
        dist.send(torch.tensor([0 if data is None else 1], dtype=torch.int64), self._global(to), group=self.group)
        if data is not None and len(data):
            dist.send(_u8(data), self._global(to), group=self.group)

    def recv_window(self, frm: int, out: memoryview) -> bool:
        """Receive one window from ``frm`` into ``out``; False when its sender could not read it."""
        flag = torch.zeros(1, dtype=torch.int64)
        dist.recv(flag, self._global(frm), group=self.group)
        if not int(flag.item()):
            return False
        if len(out):
            dist.recv(_u8(out), self._global(frm), group=self.group)
        return True

    def transfer_bundles(self, moves: Sequence[tuple[int, int, Hashable]],
                         open_out: Callable[[Hashable], OutgoingBundle],
                         open_in: Callable[[Hashable, bytearray], IncomingBundle]) -> dict[Hashable, str | None]:
        """Carry out ``moves`` of whole rank folders in order, each streamed file by file from the
        sender's mapped files into the receiver's; return, by key received here, None when the copy
        arrived and is committed, else why not.

        The receiver answers the header before any file moves: a header it refuses (or a sender that
        could not open its copy, which sends an empty header) ends that move on both sides, so one
        bad copy never leaves the next move's messages out of step. Whatever fails on this rank's own
        side of a move (opening, writing, committing or closing a copy) becomes that move's reason and
        the walk goes on: every send and receive this rank promised is made, so no later move's peer
        waits for it until the group's timeout (until 2026-12-06 a failed commit left the walk and
        skipped this rank's later sends). A failure of the transport itself (a lost peer, the group's
        timeout) is the group's and ends the walk: a pair whose messages may be out of step is not
        read from again."""
        got: dict[Hashable, str | None] = {}
        for sender, receiver, key in moves:
            if sender == self.rank:
                self._send_bundle(self._global(receiver), open_out, key)
            elif receiver == self.rank:
                got[key] = self._receive_bundle(self._global(sender), open_in, key)
        return got

    def _send_bundle(self, peer: int, open_out: Callable[[Hashable], OutgoingBundle], key: Hashable) -> None:
        try:
            out: OutgoingBundle | None = open_out(key)
        except Exception:  # noqa: BLE001 - the receiver reports the missing copy
            out = None
        try:
            header = out.header if out is not None else b""
            dist.send(torch.tensor([len(header)], dtype=torch.int64), peer, group=self.group)
            if out is None:
                return
            dist.send(_u8(header), peer, group=self.group)
            ack = torch.zeros(1, dtype=torch.int64)
            dist.recv(ack, peer, group=self.group)
            if int(ack.item()):
                for i, at, n in messages([len(p) for p in out.parts]):
                    dist.send(_u8(out.parts[i][at:at + n]), peer, group=self.group)
        finally:
            if out is not None:
                _attempt(out.close)  # a view a failed message still holds: unmapped when it goes

    def _receive_bundle(self, peer: int, open_in: Callable[[Hashable, bytearray], IncomingBundle],
                        key: Hashable) -> str | None:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, peer, group=self.group)
        if not int(size.item()):
            return "its holder could not read it"
        header = bytearray(int(size.item()))
        dist.recv(_u8(header), peer, group=self.group)
        try:
            sink: IncomingBundle | None = open_in(key, header)
            why = None
        except Exception as exc:  # noqa: BLE001 - refused before any file moves; reported to the caller
            sink, why = None, f"{type(exc).__name__}: {exc}"
        dist.send(torch.tensor([int(sink is not None)], dtype=torch.int64), peer, group=self.group)
        if sink is None:
            return why
        msgs = messages(sink.sizes)

        def start(k: int) -> tuple[list[Any], list[Any]]:
            return [], [dist.irecv(self._inboxes_t[k % 2][:msgs[k][2]], peer, group=self.group)]

        try:
            with self._inbox_lock:
                failed = self._pipeline(len(msgs), start, msgs, sink)
            if failed is None:
                failed = _attempt(sink.commit)  # the manifest's write: a full folder fails it too
        finally:
            closed = _attempt(sink.close)
        failed = failed or closed
        return None if failed is None else f"{type(failed).__name__}: {failed}"
