"""Names and paths a foreign checkpoint folder hands the importers: one rule for all of them.

DeepSpeed's ``latest`` file names the tag folder to read, Megatron's
``latest_checkpointed_iteration.txt`` the iteration, and ``--tag`` (the CLI) or ``tag=`` (the
library) may name one too. Each is used as one path component under the source folder, so each
must be exactly that — **one plain name**: :func:`plain_name` refuses ``/``, ``\\``, ``.``,
``..``, the empty name, absolute paths (POSIX or Windows), NUL and every other control or
format character (``\\n``, ``\\x1b``, bidi overrides, line separators), lone surrogates, and
names over 255 bytes — before any file is opened, with an error naming where the name came from
(the file, or the option) and what a tag must be.

A plain name can still reach outside through the filesystem: a tag folder, a rank folder or a
``.pt`` that is a symlink to another place. :func:`inside` and :func:`regular_file` check, before
anything is opened, that a path resolves inside the source folder (links that stay inside are
followed, as :class:`ckptkit.storage.local.LocalStore` does for ckptkit's own folders) and, for
files, that it is a regular file (a FIFO would hang ``torch.load``, ``/dev/zero`` stream forever).
Pointer files are read through the same store (:func:`read_pointer`): bounded, regular, inside.

Exports that write a framework's own folder (Megatron ``torch_dist``, DeepSpeed) write local files:
:func:`local_destination` refuses an object-store URL for them, which they used to write as a local
folder named ``s3:`` while reporting success.
"""

from __future__ import annotations

import ntpath
import os
import re
import unicodedata

from ckptkit.errors import CheckpointNotFoundError, ManifestError, OptionsError, UnsafePathError
from ckptkit.storage.local import LocalStore

MAX_NAME_BYTES = 255
"""NAME_MAX of the common filesystems: no folder can have a longer name."""

MAX_POINTER_BYTES = 4096
"""A pointer file (``latest``, the Megatron tracker) holds one short line; anything longer is not one."""

_REFUSED_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}
"""Control, format (bidi overrides, zero-width), surrogate, line and paragraph separator characters."""


def _shown(text: str) -> str:
    """``text`` for a one-line message: escaped (``ascii``) and cut short."""
    return ascii(text) if len(text) <= 80 else f"{ascii(text[:60])}... ({len(text)} characters)"


def name_problem(text: object) -> str | None:
    """Why ``text`` is not one plain folder name, or None when it is."""
    if not isinstance(text, str):
        return f"is a {type(text).__name__}, not a string"
    if not text:
        return "is empty"
    if text in (".", ".."):
        return f"is {text!r}, which names a folder relative to another, not one of its own"
    for ch in text:
        category = unicodedata.category(ch)
        if ch in "/\\":
            return f"contains a path separator {ch!r}"
        if category in _REFUSED_CATEGORIES:
            return f"contains the {'NUL' if ch == chr(0) else 'control or format'} character U+{ord(ch):04X}"
    if ntpath.isabs(text) or ntpath.splitdrive(text)[0]:
        return "is an absolute (drive) path"
    size = len(text.encode("utf-8"))
    if size > MAX_NAME_BYTES:
        return f"is {size} bytes long, over the {MAX_NAME_BYTES}-byte limit of a folder name"
    return None


def plain_name(text: object, where: str, what: str = "tag") -> str:
    """``text`` if it is one plain folder name, else :class:`UnsafePathError` naming ``where`` (the file
    the name was read from, or the option that gave it), the name, and what was expected."""
    problem = name_problem(text)
    if problem is not None:
        shown = _shown(text) if isinstance(text, str) else type(text).__name__
        raise UnsafePathError(f"{where}: the {what} {shown} {problem}; expected one plain folder name inside the "
                              f"checkpoint folder (no '/', '\\', '.', '..', control characters, at most "
                              f"{MAX_NAME_BYTES} bytes): nothing outside the folder is opened")
    assert isinstance(text, str)
    return text


def read_pointer(folder: str, name: str) -> str | None:
    """The stripped text of the pointer file ``folder/name`` (``latest``, the Megatron tracker), None when
    there is no such file. Read through :class:`LocalStore`: a symlink out of ``folder``, a FIFO, a device
    or a file over :data:`MAX_POINTER_BYTES` is an error naming the file, and so is text that is not UTF-8."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    try:
        data = LocalStore(folder).read_bytes(name, limit=MAX_POINTER_BYTES)
    except CheckpointNotFoundError:
        return None  # a directory of that name: not a pointer file
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); expected one plain "
                            "folder name") from None


def inside(folder: str, path: str, what: str = "path") -> str:
    """``path`` if it resolves (symlinks followed) inside ``folder``, else :class:`UnsafePathError`
    naming it and where it points; checked before anything at ``path`` is opened or listed."""
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
        raise UnsafePathError(f"{path}: this {what} points to {real}, outside the checkpoint folder {root}: "
                              "refusing to read it (only links that stay inside the folder are followed)")
    return path


def regular_file(folder: str, path: str) -> str:
    """``path`` if it is a regular file resolving inside ``folder``: :class:`UnsafePathError` for a link
    out of it, :class:`~ckptkit.errors.CorruptCheckpointError` for a FIFO, socket, device, directory or
    nothing (the store's own checks, before anything is opened)."""
    key = os.path.relpath(path, folder)
    if key.startswith(".."):
        raise UnsafePathError(f"{path}: not inside the checkpoint folder {folder}")
    LocalStore(folder).checked_size(key.replace(os.sep, "/"))
    return path


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_destination(dest: str | os.PathLike[str], what: str) -> str:
    """``dest`` as a local path (a ``file://`` URL's path), or OptionsError for any other URL: ``what``
    (an export writing a framework's own folder) writes local files only. Until 2026-12-06 an ``s3://``
    destination became a local folder named ``s3:`` and the export reported success (found by a hunt)."""
    text = os.fspath(dest)
    if text.startswith("file://"):
        return text[len("file://"):]
    if _URL.match(text):
        raise OptionsError(f"{text}: {what} writes local files only; export to a local folder, then copy it to the "
                           "object store")
    return text
