"""How an export reports a failure that is not ckptkit's own: one error type, naming both ends."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ckptkit.errors import CkptkitError

T = TypeVar("T")


def export_step(step: Callable[[], T], error: type[CkptkitError], what: str) -> T:
    """``step()``; a failure that is not a :class:`CkptkitError` (an ``OSError`` of the store, a
    framework's own exception) raised as ``error("<what> failed: <it>")``, so every process of a
    spread export, and the user, reads which export failed and why."""
    try:
        return step()
    except Exception as exc:
        if isinstance(exc, CkptkitError):
            raise
        raise error(f"{what} failed: {exc}") from exc
