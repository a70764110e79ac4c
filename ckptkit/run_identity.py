"""A run's identity: a random id kept in the run's folder, which node memory is tied to.

Why: the memory tier keeps snapshots in node memory (``/dev/shm``), which outlives the job. Its
folder is derived from the run's URL, so a *new* run started at the same URL (the old folder
deleted, the same nodes) would find the old run's snapshots and resume from them: a foreign state
handed back as the newest step. Each memory snapshot therefore records the id of the run that took
it, and a restore uses only snapshots of the id found in the run's folder now. Deleting the folder
deletes the id; the next run creates a new one, and the old snapshots no longer count.

The file is created once, atomically (``put_if_absent``), by rank 0, and agreed by every rank. A
file that cannot be parsed is replaced by a new id, with a warning: the snapshots tied to the old
one are then not used (a restore falls back to persistent checkpoints), never misread.
"""

from __future__ import annotations

import json
import logging
import re
import uuid

from ckptkit.engine.collective import Comm, first_rank_does
from ckptkit.errors import CheckpointNotFoundError, StorageError
from ckptkit.storage.base import ByteStore

log = logging.getLogger("ckptkit")

RUN_FILE = "ckptkit-run.json"
_FORMAT = "ckptkit-run"
_VERSION = 1
_ID = re.compile(r"^[0-9a-f]{32}$")
_MAX_BYTES = 4096


def _parse(data: bytes) -> str | None:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != _VERSION:
        return None
    run_id = doc.get("run_id")
    return run_id if isinstance(run_id, str) and _ID.match(run_id) else None


def _new() -> tuple[str, bytes]:
    run_id = uuid.uuid4().hex
    return run_id, json.dumps({"format": _FORMAT, "version": _VERSION, "run_id": run_id}).encode()


def read_or_create(store: ByteStore) -> str:
    """The run's id, created if the run has none yet. Not collective (rank 0's part).

    A store failure is raised, never taken for "absent": a new id would orphan every snapshot."""
    for _ in range(3):
        try:
            data = store.read_bytes(RUN_FILE, limit=_MAX_BYTES)
        except CheckpointNotFoundError:
            run_id, doc = _new()
            if store.put_if_absent(RUN_FILE, doc):
                log.info("%s: new run %s", store.url, run_id)
                return run_id
            continue  # another process created it first: read theirs
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - too large, a FIFO, not a regular file: damaged
            log.warning("%s/%s unreadable (%s): replaced", store.url, RUN_FILE, exc)
            data = b""
        run_id = _parse(data)
        if run_id is not None:
            return run_id
        run_id, doc = _new()
        log.warning("%s/%s is not a ckptkit run file: replaced by a new run id %s; node-memory snapshots "
                    "of the former id will not be restored", store.url, RUN_FILE, run_id)
        store.delete(RUN_FILE)
        store.put_bytes(RUN_FILE, doc)
        return run_id
    raise StorageError(f"{store.url}/{RUN_FILE}: created by another process but not readable")


def agree(store: ByteStore, comm: Comm) -> str:
    """The run's id on every rank: rank 0 reads or creates it (collective)."""
    run_id, failure = first_rank_does(comm, lambda: read_or_create(store), "reading or creating the run's id")
    if failure is not None:
        raise StorageError(f"{store.url}/{RUN_FILE}: the run's id could not be read or created on rank 0: {failure}")
    return str(run_id)
