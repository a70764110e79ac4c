"""The exceptions ckptkit raises.

Every failure a user can cause or meet (a bad path, a damaged checkpoint, a
state that does not match) is one of these, and its message names the
checkpoint, the tensor or file, the rank where it matters, and what was
expected. Callers catch :class:`CkptkitError` to handle all of them; the CLI
turns them into one-line messages and a non-zero exit code.

Standard library only: the layout core raises these too.
"""

from __future__ import annotations


class CkptkitError(Exception):
    """Base class of every error ckptkit raises on purpose."""


class LayoutError(CkptkitError, ValueError):
    """A layout declaration is invalid (boxes out of bounds, bad parallel config)."""


class CheckpointNotFoundError(CkptkitError, FileNotFoundError):
    """There is no checkpoint at the given location."""


class ForeignCheckpointError(CkptkitError):
    """A location holds a checkpoint in another format where ckptkit would otherwise go on without it: a
    run folder whose newest step is the framework's own checkpoint (torch.distributed.checkpoint from
    torchtitan's manager, DeepSpeed's ``global_stepN``, Megatron's ``iter_NNNNNNN``), which a resume
    would skip, going back in time or starting from scratch (:mod:`ckptkit.adapters.foreign_steps`).
    Not a ``CheckpointNotFoundError``: code that starts fresh when nothing is found must not start
    fresh here."""


class UncommittedCheckpointError(CheckpointNotFoundError):
    """The location holds checkpoint data but no committed manifest.

    A save that crashed or is still running leaves such a directory behind; it
    is never loaded (DESIGN.md section 3: the manifest's appearance is the
    commit).
    """


class ManifestError(CkptkitError):
    """A manifest or index file is malformed or fails validation."""


class UnsupportedVersionError(ManifestError):
    """A manifest or index was written by a format version this ckptkit cannot read."""


class UnsafePathError(ManifestError):
    """Checkpoint metadata points outside the checkpoint (``..``, absolute paths)."""


class CorruptCheckpointError(CkptkitError):
    """Stored bytes do not match their metadata: truncated object, checksum or digest mismatch."""


class TooLargeError(CorruptCheckpointError):
    """A metadata object (manifest, index) is larger than the reader's safety limit.

    Metadata is parsed whole, so its size is capped before any byte is read
    (see docs/trust.md): a hostile or damaged folder cannot exhaust memory.
    """


class RestoreFloorError(CkptkitError):
    """A restore would have fallen back past damaged checkpoints to a step older than the caller
    allows (``at_least``): training it knows of would be thrown away without a word."""


class StateMismatchError(CkptkitError):
    """The caller's state and the checkpoint disagree (keys, dtypes, shapes)."""


class MissingKeysError(StateMismatchError, KeyError):
    """Keys the state asks for are not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnexpectedKeysError(StateMismatchError):
    """The checkpoint holds keys the state does not have (strict loading)."""


class DTypeMismatchError(StateMismatchError, TypeError):
    """A tensor's dtype in the checkpoint differs from the target tensor's."""


class ShapeMismatchError(StateMismatchError):
    """A tensor's global shape in the checkpoint differs from the target's."""


class CoverageError(CkptkitError):
    """Stored pieces do not cover a region the target needs, or overlap each other."""


class PeerFailureError(CkptkitError):
    """A collective operation failed on another rank; that rank raised the real error."""


class LoadStalledError(CkptkitError, TimeoutError):
    """A rank made no progress in a load for ``LoadOptions.stall_seconds``; raised on every rank.

    A load whose storage read never returns would otherwise hang every rank silently: the others
    wait in a collective for the stalled one, and nothing in a load times out before the process
    group's own timeout (30 minutes for gloo), which then names no rank and no object. The load
    watchdog (:mod:`ckptkit.engine.watchdog`) tells every rank out of band, through the job's
    key-value store, so no rank needs the stalled one's cooperation. ``rank`` is the stalled rank
    (global), ``object`` the storage key it was reading (None if it was not reading).

    After this error the process group may still hold collectives the other ranks entered and
    the stalled one never will: do not run more collectives on it; restart the job (torchrun's
    ``--max-restarts`` does). The stalled rank's own process may not exit by itself while its
    read is stuck (Python joins its reader threads at exit); the launcher's kill ends it.
    """

    def __init__(self, message: str, rank: int | None = None, object: str | None = None) -> None:  # noqa: A002
        super().__init__(message)
        self.rank = rank
        self.object = object

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StorageError(CkptkitError, OSError):
    """The byte store failed (permission, disk full, network) in a way retries did not fix."""


class CommitOutcomeUnknownError(StorageError):
    """A commit whose answer was lost, and whose manifest could not be read back to learn whether it
    happened. The save is reported failed, but its objects are kept: the checkpoint may be committed
    (``ckptkit ls``/``verify`` say; ``gc`` removes it if not). Deleting them, as a failed save's cleanup
    does, could leave a committed manifest naming nothing (reproduced through a proxy, 2026-12-06)."""


class CheckpointUnreadableError(StorageError):
    """A checkpoint exists but could not be read (network, permissions), even after retries.

    Raised instead of falling back to an older checkpoint: a restore that silently went back in
    time (or started from scratch) because a read failed would lose training without a word.
    Retry once the store answers again, or restore an older step explicitly (``at_most``).
    """


class SaveError(CkptkitError):
    """A save failed; the previous committed checkpoint is untouched."""


class PreviousSaveFailedError(SaveError):
    """An asynchronous save that failed in the background, raised by the next save before it starts
    (that save did not start; the failure is reported once, so the next attempt goes ahead)."""


class SnapshotRaceError(SaveError):
    """An overlapped snapshot (``AsyncOptions(snapshot="overlap")``) saw a saved tensor change in place
    before its copy was final, by a path no guard hooks: that save fails, nothing of it is committed."""


class OptionsError(CkptkitError, ValueError):
    """An options or policy object was given a value it cannot take (every options dataclass raises this)."""


class SliceError(CkptkitError, IndexError):
    """An index does not fit the tensor (too many indices, an int out of range, an unsupported kind)."""


class ReshardError(LayoutError):
    """The target layout cannot be planned (an impossible split, a strict-mode tensor without a rule, ...)."""


class PoolClosedError(CkptkitError):
    """The pool was closed (its user failed) while a caller waited for a buffer."""


class TrainingStopped(CkptkitError):
    """The ladder ran out of rungs: repeated spikes even after lowering the learning rate."""


class DataLoaderRemapError(StateMismatchError):
    """The data-loader positions cannot be carried to the new DP degree as asked."""


class UnsafeCheckpointError(CkptkitError):
    """A foreign checkpoint asked to run or build something the converters do not trust.

    Raised before anything it names is called: a refused ``.metadata`` global,
    or a ``.distcp`` blob that ``torch.load(weights_only=True)`` refuses.
    """
