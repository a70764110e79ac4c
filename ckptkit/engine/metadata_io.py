"""Reading a checkpoint's manifest and indexes, with integrity checks.

The manifest is the commit marker: a location without one is either not a
checkpoint or an uncommitted one, and the two get different errors. Every
index is checked against the size and SHA-256 the manifest recorded, so a
torn or swapped index is caught before any of its offsets is trusted.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from ckptkit.errors import CheckpointNotFoundError, CorruptCheckpointError, UncommittedCheckpointError
from ckptkit.layout.index import Index
from ckptkit.layout.manifest import MANIFEST_NAME, Manifest, sha256_hex
from ckptkit.layout.strict_json import MAX_METADATA_BYTES
from ckptkit.storage.base import ByteStore


SAVE_LEFTOVERS = frozenset({"data", "index"})
"""What a save writes before its manifest: a folder holding only these is one whose save did not finish."""
STEP_PATTERN = re.compile(r"^step-([0-9]+)$")  # ASCII digits: `\d` takes "step-١٢" for step 12
"""A step folder's name (``step-0000500``, torchtitan's ``step-500``); the run folder's listing reads it too."""


def read_manifest(store: ByteStore) -> Manifest:
    data = _manifest_bytes(store)
    return Manifest.from_json_bytes(data, f"{store.url}/{MANIFEST_NAME}")


def _manifest_bytes(store: ByteStore) -> bytes:
    try:
        return store.read_bytes(MANIFEST_NAME, limit=MAX_METADATA_BYTES)
    except CheckpointNotFoundError:
        pass
    children = store.list_children()
    others = sorted(n for n in children if n not in SAVE_LEFTOVERS and not n.startswith(f"{MANIFEST_NAME}.tmp-"))
    if children and not others:
        raise UncommittedCheckpointError(
            f"{store.url} has no committed manifest ({MANIFEST_NAME}): the save that wrote it did not "
            "finish, so it is not a checkpoint (saving to this path again replaces the leftovers)"
        )
    if others:  # not what a save leaves: a run folder, another format, the user's files (said as such, 2026-12-06)
        steps = [n for n in others if STEP_PATTERN.match(n)]
        if steps:
            raise CheckpointNotFoundError(f"{store.url} is a run folder (step folders such as {steps[-1]}), not a "
                                          "checkpoint: name one of its steps (`ckptkit ls` lists them)")
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        raise CheckpointNotFoundError(f"no checkpoint at {store.url}: no {MANIFEST_NAME}, and it holds {shown}, which "
                                      "no ckptkit save writes (`ckptkit convert` reads other formats)")
    raise CheckpointNotFoundError(f"no checkpoint at {store.url}")


def read_index(store: ByteStore, manifest: Manifest, rank: int) -> Index:
    try:
        return _read_index(store, manifest, rank)
    except CorruptCheckpointError:
        fallback = store.fallback  # a tiered store's local copy may be stale
        if fallback is None:
            raise
        return _read_index(fallback, manifest, rank)


def _read_index(store: ByteStore, manifest: Manifest, rank: int) -> Index:
    ref = manifest.indexes.get(rank)
    where = f"{store.url}/{ref.key if ref else f'index of rank {rank}'}"
    if ref is None:
        raise CorruptCheckpointError(f"{store.url}: the manifest lists no index for rank {rank}")
    try:
        # the manifest records the index's size: never read much more (a hostile folder may put a
        # device, a FIFO or a huge file there); a little more still gets the digest's clearer message
        data = store.read_bytes(ref.key, limit=min(2 * ref.size + 4096, MAX_METADATA_BYTES))
    except CheckpointNotFoundError:
        raise CorruptCheckpointError(f"{where}: index of rank {rank} is missing") from None
    if len(data) != ref.size or sha256_hex(data) != ref.sha256:
        raise CorruptCheckpointError(
            f"{where}: index of rank {rank} does not match the manifest's digest "
            f"({len(data)} bytes, expected {ref.size})"
        )
    index = Index.from_json_bytes(data, where)
    if index.rank != rank:
        raise CorruptCheckpointError(f"{where}: index says rank {index.rank}, manifest says rank {rank}")
    return index


def read_indexes(store: ByteStore, manifest: Manifest, ranks: set[int], threads: int = 8) -> dict[int, Index]:
    ordered = sorted(ranks)
    if len(ordered) <= 1 or threads <= 1:
        return {r: read_index(store, manifest, r) for r in ordered}
    with ThreadPoolExecutor(max_workers=min(threads, len(ordered)), thread_name_prefix="ckptkit-index") as pool:
        return dict(zip(ordered, pool.map(lambda r: read_index(store, manifest, r), ordered)))
