"""torch.distributed.checkpoint (DCP) checkpoints into and out of ckptkit.

DCP is what torchtitan writes (``step-N`` folders) and what Megatron-core's
``torch_dist`` format builds on, so this is the way in for runs that did not
start with ckptkit, and the way back to plain ``dcp.load``.

* :func:`import_dcp` writes a committed ckptkit checkpoint from a DCP
  directory (local path or ``s3://`` URL). Every tensor chunk becomes an
  explicit box piece at the tensor's global shape, written by the virtual
  rank that wrote it in DCP (``__3_0.distcp`` -> writer rank 3), so DCP's
  sharding is kept and ``ckptkit.load`` reshards it like any checkpoint.
  Chunks are read one at a time (plus ``read_ahead`` per rank being written)
  and written with :mod:`ckptkit.engine.offline_writer`: memory never holds the
  model. The ``.metadata`` pickle is read only through the allow-list
  unpickler (:mod:`ckptkit_converters.common.safe_unpickle`), every blob only through
  ``torch.load(weights_only=True)``. Non-tensor items become ckptkit values
  when they decode that way into JSON-like values; any other item fails the
  import with its name, unless ``skip_unsafe_items`` (then the result lists
  what was skipped).
* :func:`export_dcp` (:mod:`ckptkit_converters.dcp.export`) writes a ckptkit checkpoint as a DCP
  checkpoint that plain ``dcp.load`` reads at any world size, from one process or spread over a
  ``torchrun`` job's processes.

Keys: see :mod:`ckptkit_converters.dcp.keys`. Byte format: :mod:`ckptkit_converters.dcp.files`. Options:
:mod:`ckptkit_converters.dcp.options`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckptkit.options import Progress
from ckptkit.engine.offline_writer import (
    OfflineCheckpoint,
    OfflineWriteOptions,
    StoredTensor,
    write_offline,
)
from ckptkit.engine.prefetch import ReadAhead
from ckptkit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
)
from ckptkit.layout.box import Region
from ckptkit.layout.strict_json import MAX_METADATA_BYTES
from ckptkit.layout.values import encode_value
from ckptkit.plan.merge import check_coverage
from ckptkit.storage.base import ByteStore
from ckptkit.storage.url import open_store
from ckptkit_converters.dcp.files import (
    METADATA_NAME,
    Chunk,
    DcpCheckpoint,
    DcpTensor,
    file_rank,
    load_blob,
    parse_metadata,
    read_blob,
    read_chunk,
    writer_ranks,
)
from ckptkit_converters.dcp.keys import (
    import_keys,
)
from ckptkit_converters.dcp.export import DcpConvertResult, export_dcp
from ckptkit_converters.dcp.options import DcpExportOptions, DcpImportOptions
from ckptkit_converters.common.safe_unpickle import UnsafeCheckpointError, load_dcp_metadata

__all__ = [
    "DcpConvertResult",
    "DcpExportOptions",  # defined in ckptkit_converters.dcp.options; importable from here as before
    "DcpImportOptions",
    "export_dcp",
    "import_dcp",
    "is_dcp_checkpoint",
    "read_dcp_metadata",
]


def is_dcp_checkpoint(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """True if ``url`` holds a DCP ``.metadata`` (a committed DCP checkpoint)."""
    return open_store(url, storage_options).exists(METADATA_NAME)


# ---------------------------------------------------------------- import


def import_dcp(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    options: DcpImportOptions = DcpImportOptions(),
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> DcpConvertResult:
    """Write the DCP checkpoint at ``source`` as a committed ckptkit checkpoint at ``dest``.

    Everything checkable from metadata (every field, every data file's size,
    every non-tensor item) is checked before the first byte is written; a
    failure later (a damaged chunk) removes the partial output. ``dest`` must
    not hold a committed checkpoint.
    """
    t0 = time.perf_counter()
    src = open_store(source, storage_options)
    ckpt = read_dcp_metadata(src)
    ranks, world = data_files(src, ckpt)
    paths = ckpt.paths or {fqn: (fqn,) for fqn in (*ckpt.tensors, *ckpt.items)}
    decoded, skipped = _decode_items(src, ckpt, options.skip_unsafe_items)
    keys, values = import_keys({f: paths[f] for f in ckpt.tensors},
                               {f: (paths[f], v) for f, v in decoded.items()}, f"{src.url}/{METADATA_NAME}")
    specs = {keys[f]: StoredTensor(t.dtype, t.shape) for f, t in ckpt.tensors.items()}
    by_rank: dict[int, list[tuple[DcpTensor, Chunk]]] = {}
    for t in ckpt.tensors.values():
        for c in t.chunks:
            if c.box.numel:
                by_rank.setdefault(ranks[c.blob.file], []).append((t, c))
    for refs in by_rank.values():
        refs.sort(key=lambda r: (r[1].blob.file, r[1].blob.offset))  # sequential reads
    for fqn, t in ckpt.tensors.items():  # before anything is written: chunks must tile each tensor
        check_coverage(keys[fqn], t.shape, tuple((Region(c.box), ranks[c.blob.file]) for c in t.chunks if c.box.numel),
                       f"{src.url}/{METADATA_NAME}")
    pieces = {r: [(keys[t.fqn], Region(c.box)) for t, c in refs] for r, refs in by_rank.items()}
    out = open_store(dest, storage_options)
    # read-ahead only: the chunk a rank's writer asks for is read in its own thread
    with ThreadPoolExecutor(max_workers=max(1, options.threads * options.read_ahead),
                            thread_name_prefix="ckptkit-dcp-read") as pool:
        checkpoint = OfflineCheckpoint(
            world_size=world,
            tensors=specs,
            pieces=pieces,
            values={k: encode_value(v, k) for k, v in values.items()},
            meta={"user": {}, "converted_from": {
                "url": src.url, "format": "dcp", "dcp_version": ckpt.version,
                "keys": "planner_data" if ckpt.paths else "fqn", "skipped": list(skipped)}},
        )
        result = write_offline(
            out, checkpoint, lambda rank, _: DcpPieces(src, by_rank.get(rank, []), pool, options.read_ahead),
            options=OfflineWriteOptions(block_size=options.block_size, threads=options.threads),
            progress=progress,
            what=f"importing {src.url} into {out.url}",
        )
    return DcpConvertResult(src.url, out.url, "ckptkit", len(specs), result.nbytes, result.bytes_read,
                            time.perf_counter() - t0, skipped)


def read_dcp_metadata(src: ByteStore) -> DcpCheckpoint:
    """The validated metadata of the DCP checkpoint in ``src`` (through the allow-list unpickler)."""
    where = f"{src.url}/{METADATA_NAME}"
    try:
        data = src.read_bytes(METADATA_NAME, limit=MAX_METADATA_BYTES)  # parsed whole: bounded like ours
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(
            f"{src.url} has no {METADATA_NAME}: not a DCP checkpoint, or one whose save did not finish "
            "(DCP writes .metadata last)") from None
    return parse_metadata(load_dcp_metadata(data, where), where)


def data_files(src: ByteStore, ckpt: DcpCheckpoint) -> tuple[dict[str, int], int]:
    """Each data file's writer rank, and the world size of the save, after checking every file the
    metadata points into is there and long enough (Megatron's torch_dist import reads DCP too)."""
    files = ckpt.files()
    _check_files(src, files)
    ranks = writer_ranks(list(files))
    # every rank of a DCP save writes a file, an empty one if it holds nothing: those count too
    listed = [r for r in map(file_rank, src.list_children()) if r is not None]
    return ranks, max([*ranks.values(), *listed], default=0) + 1


def _check_files(src: ByteStore, files: dict[str, int]) -> None:
    """Every data file exists and holds every blob the metadata points into (before any read)."""
    for name, need in files.items():
        size = src.size(name)
        if size is None:
            raise CorruptCheckpointError(f"{src.url}/{name} is missing; {METADATA_NAME} records data in it")
        if size < need:
            raise CorruptCheckpointError(
                f"{src.url}/{name} is truncated: {size} bytes, {METADATA_NAME} records data up to byte {need}")


def _decode_items(src: ByteStore, ckpt: DcpCheckpoint, skip: bool) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Every non-tensor item decoded (``weights_only``) into a JSON-like value, or refused by name."""
    decoded: dict[str, Any] = {}
    refused: list[tuple[str, str]] = []
    for fqn, item in sorted(ckpt.items.items(), key=lambda kv: (kv[1].blob.file, kv[1].blob.offset)):
        where = f"{src.url}/{item.blob.file} (item {fqn!r} at byte {item.blob.offset})"
        try:
            value = load_blob(read_blob(src, item.blob), where)
            encode_value(value, fqn)  # JSON-like all the way down (no tensors, no sets, ...)
        except UnsafeCheckpointError as exc:
            refused.append((fqn, str(exc)))
            continue
        except StateMismatchError as exc:
            refused.append((fqn, f"{where}: decodes to a value ckptkit cannot store as JSON ({exc})"))
            continue
        decoded[fqn] = value
    if refused and not skip:  # one line: every reason, the first five in full
        shown = "; ".join(reason for _, reason in refused[:5])
        more = f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""
        raise UnsafeCheckpointError(
            f"{src.url}: {len(refused)} non-tensor item(s) do not decode safely: "
            f"{', '.join(repr(f) for f, _ in refused[:10])}: {shown}{more}. "
            "Nothing was written. Pass skip_unsafe_items=True (CLI: --skip-unsafe-items) to import without them.")
    return decoded, tuple(f for f, _ in refused)


class DcpPieces:
    """One virtual rank's chunks, read from its ``.distcp`` file(s) on demand, with read-ahead.

    The :class:`~ckptkit.engine.offline_writer.PieceSource` of the import:
    each chunk's blob is read and decoded (``weights_only``) through a
    :class:`~ckptkit.engine.prefetch.ReadAhead` on ``pool``, at most
    ``read_ahead`` chunks ahead of the one being written; read-ahead of a
    chunk the writer skips is let go at once, not held until the import ends.
    """

    def __init__(self, src: ByteStore, refs: Sequence[tuple[DcpTensor, Chunk]], pool: ThreadPoolExecutor,
                 read_ahead: int) -> None:
        self._src = src
        self._refs = refs
        self._lock = threading.Lock()
        self._ahead = ReadAhead(len(refs), self._load, pool, read_ahead)
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self._refs)

    def _load(self, ref: int) -> torch.Tensor:
        tensor, chunk = self._refs[ref]
        out = read_chunk(self._src, tensor, chunk)
        with self._lock:
            self.bytes_read += chunk.blob.length
        return out

    def __getitem__(self, ref: int) -> torch.Tensor:
        return self._ahead[ref]

    def close(self) -> None:
        """The rank is written (or failed): read-ahead no one will ask for is dropped."""
        self._ahead.close()
