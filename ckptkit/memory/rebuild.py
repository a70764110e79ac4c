"""A parity rebuild at a restore, streamed a window at a time.

Rebuilding a lost rank's snapshot needs, for each window of each of its chunks, the share that
chunk went into and the matching window of every other member's snapshot
(:func:`ckptkit.memory.parity.rebuild_windows`). Every rank of the job walks the same windows in
the same order (:func:`walk`); in each, the holders of those inputs on other nodes send their
window to the rebuilt rank, which reads the inputs in its own node folder itself, XORs them and
writes the result into the rank's new folder (:class:`~ckptkit.memory.bundle.BundleSink`). So the
rebuilt rank holds two windows, not the group's snapshots; a holder holds one.

A holder that cannot read its input says so in the window's flag instead of sending bytes, and
every rank keeps walking: no rank is left waiting on a message that never comes, and the rebuilt
rank fails with the input named. The rebuilt copy is committed only if every byte arrived and its
digest is the one the parity shares recorded for it (:mod:`ckptkit.memory.digest`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from ckptkit.errors import CorruptCheckpointError
from ckptkit.memory import parity
from ckptkit.memory.bundle import BundleBytes, BundleSink
from ckptkit.memory.exchange import Link
from ckptkit.memory.node_folder import NodeFolder
from ckptkit.memory.topology import Source
from ckptkit.storage.local import LocalStore


@dataclass(frozen=True)
class Rebuild:
    """What rebuilding ``rank`` at ``step`` takes: its group (``members``, in member order), the chunk
    size, its snapshot's length and digest, and which rank holds each member's share and copy."""

    step: int
    rank: int
    members: tuple[int, ...]
    chunk: int
    length: int
    digest: str
    share_holders: dict[int, int]
    copy_holders: dict[int, int]

    @property
    def me(self) -> int:
        return self.members.index(self.rank)


def plan_rebuilds(step: int, plan: dict[int, Source], gathered: Sequence[Any]) -> list[Rebuild]:
    """Every parity rebuild of ``plan``, ranks in order: the same list on every rank (``gathered``
    is every rank's inventory, exchanged; a share entry is ``(holder, members, index, chunk,
    lengths, digests)``)."""
    out = []
    for rank in sorted(r for r, src in plan.items() if src.kind == "parity"):
        holders: dict[int, int] = {}
        facts: tuple[Any, ...] | None = None
        for holder, (_, _, inv) in enumerate(gathered):
            for _, members, index, chunk, lengths, digests in inv.get(step, {}).get("shares", []):
                if rank in members and index not in holders:
                    holders[index] = holder
                    facts = facts or (tuple(members), chunk, lengths, digests)
        if facts is None:
            raise CorruptCheckpointError(f"memory tier step {step}: no parity share covers rank {rank}")
        members, chunk, lengths, digests = facts
        me = members.index(rank)
        copies = {i: plan[m].holder for i, m in enumerate(members) if i != me and plan[m].holder is not None}
        parity.check_rebuild(me, lengths[me], set(holders) & set(copies), len(members), chunk)
        out.append(Rebuild(step, rank, members, chunk, lengths[me], digests[me], holders, copies))  # type: ignore[arg-type]
    return out


class _Inputs:
    """The inputs this rank holds, opened on first use and closed together."""

    def __init__(self, folder: NodeFolder, step: int, stack: ExitStack) -> None:
        self.folder, self.step, self.stack = folder, step, stack
        self._copies: dict[int, BundleBytes] = {}
        self._shares: dict[int, memoryview] = {}

    def read(self, kind: str, rank: int, at: int, out: memoryview) -> None:
        """``out`` <- ``rank``'s copy (``kind`` "copy") or share ("share") at ``at``."""
        if kind == "copy":
            if rank not in self._copies:
                bundle = self.stack.enter_context(self.folder.outgoing(self.step, rank))
                self._copies[rank] = BundleBytes(bundle.header, bundle.parts)
            self._copies[rank].read_into(at, out)
            return
        if rank not in self._shares:
            self._shares[rank] = self.stack.enter_context(self.folder.open_share(self.step, rank)).view
        share = self._shares[rank]
        if at + len(out) > len(share):
            raise CorruptCheckpointError(f"parity share {rank} of step {self.step} is shorter than its chunk")
        out[:] = share[at:at + len(out)]


def walk(link: Link | None, me: int, local_ids: Sequence[str], folder: NodeFolder,
         rebuilds: Sequence[Rebuild]) -> LocalStore | None:
    """Carry out ``rebuilds`` (every rank calls this with the same list); return this rank's
    rebuilt folder, committed, when it is one of them (else None). Raises on the rebuilt rank
    only, after the walk is complete, so every other rank's part of it ends too: anything that
    fails on this rank's side of a window (writing the rebuilt copy into its node folder: a full
    folder, one out of inodes, any other error) becomes the rebuild's failure and the walk goes on,
    every window of every rebuild sent or received as promised. (Until 2026-12-06 a raw ``OSError``
    from making the step folder left the walk on the rebuilt rank, and the holders of its later
    windows, and of any later rebuild's, waited in their sends until the group's timeout.)"""
    result: LocalStore | None = None
    failure: CorruptCheckpointError | None = None
    with ExitStack() as stack:
        inputs = _Inputs(folder, rebuilds[0].step if rebuilds else 0, stack)
        for rb in rebuilds:
            if rb.rank != me:
                _serve(link, me, local_ids, inputs, rb)
                continue
            sink = stack.enter_context(folder.rebuilt(rb.step, rb.rank, rb.length, rb.digest))
            problem = _receive(link, me, local_ids, inputs, rb, sink)
            if problem is None:
                try:
                    result = sink.commit()
                except Exception as exc:  # noqa: BLE001 - a digest that differs, a manifest not written
                    problem = f"{type(exc).__name__}: {exc}"
            if problem is not None:
                try:
                    folder.remove_rank(rb.step, rb.rank)
                except Exception as exc:  # noqa: BLE001 - left for the next snapshot's tidying
                    problem += f" (and its half-written folder could not be removed: {exc})"
                failure = CorruptCheckpointError(f"memory tier: rebuilding rank {rb.rank}'s snapshot of step "
                                                 f"{rb.step} from parity failed: {problem}")
    if failure is not None:
        raise failure
    return result


def _sources(rb: Rebuild, w: parity.RebuildWindow) -> list[tuple[str, int, int, int]]:
    """(kind, holder, rank it is of, offset) of every input of window ``w``: its share first."""
    sources = [("share", rb.share_holders[w.share], rb.members[w.share], w.off)]
    return sources + [("copy", rb.copy_holders[i], rb.members[i], at) for i, at in zip(w.members, w.member_at)]


def _serve(link: Link | None, me: int, local_ids: Sequence[str], inputs: _Inputs, rb: Rebuild) -> None:
    """This rank's part of another rank's rebuild: send every window it holds, in the walk's order."""
    buf = bytearray(min(parity.WINDOW, rb.chunk))
    for w in parity.rebuild_windows(rb.me, len(rb.members), rb.chunk, len(buf)):
        for kind, holder, of, at in _sources(rb, w):
            _window(link, me, rb.rank, holder, local_ids, inputs, kind, of, at, memoryview(buf)[: w.n])


def _receive(link: Link | None, me: int, local_ids: Sequence[str], inputs: _Inputs, rb: Rebuild,
             sink: BundleSink) -> str | None:
    """Rebuild this rank's snapshot into ``sink``, window by window; why it failed, or None. Every
    window's inputs are received even after a failure, so their holders' sends all complete."""
    problem: str | None = None
    width = min(parity.WINDOW, rb.chunk)
    acc, buf = bytearray(width), bytearray(width)
    for w in parity.rebuild_windows(rb.me, len(rb.members), rb.chunk, width):
        view = memoryview(acc)[: w.n]
        for k, (kind, holder, of, at) in enumerate(_sources(rb, w)):
            got = _window(link, me, rb.rank, holder, local_ids, inputs, kind, of, at, memoryview(buf)[: w.n])
            if problem is None:
                if isinstance(got, str):
                    problem = got
                elif k == 0:
                    view[:] = got
                else:
                    parity.xor_into(view, got)
        if problem is None:
            try:
                sink.feed(view[: max(0, min(w.n, rb.length - w.at))])
            except Exception as exc:  # noqa: BLE001 - damaged bytes, a full folder, a step folder not made
                problem = f"{type(exc).__name__}: {exc}"
    return problem


def _window(link: Link | None, me: int, rebuilt: int, holder: int, local_ids: Sequence[str], inputs: _Inputs,
            kind: str, of: int, at: int, buf: memoryview) -> memoryview | str | None:
    """One input window: sent by its holder when it is on another node, read by the rebuilt rank
    itself when it is in its own node folder. The rebuilt rank gets the bytes (or why not); the
    holder and everyone else get None."""
    remote = local_ids[holder] != local_ids[rebuilt]
    if remote and link is not None and me == holder:
        try:
            inputs.read(kind, of, at, buf)
            ok = True
        except Exception:  # noqa: BLE001 - the rebuilt rank reports the missing input
            ok = False
        link.send_window(rebuilt, buf if ok else None)
        return None
    if me != rebuilt:
        return None
    what = f"rank {of}'s {'copy' if kind == 'copy' else 'parity share'} (held by rank {holder})"
    if remote:
        if link is None or not link.recv_window(holder, buf):
            return f"{what} could not be read by its holder"
        return buf
    try:
        inputs.read(kind, of, at, buf)
    except Exception as exc:  # noqa: BLE001 - reported as the rebuild's failure
        return f"{what}: {type(exc).__name__}: {exc}"
    return buf
