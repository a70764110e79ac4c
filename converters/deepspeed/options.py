"""What a DeepSpeed import and export take: two small frozen dataclasses (no torch imported)."""

from __future__ import annotations

from dataclasses import dataclass

from ckptkit.errors import CkptkitError


@dataclass(frozen=True)
class DeepSpeedImportOptions:
    """``tag``: the checkpoint tag to import (None: the one ``latest`` names; a plain folder name,
    checked before anything is opened). ``threads``: ranks written at once."""

    tag: str | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise CkptkitError(f"threads must be a positive integer, got {self.threads!r}")


@dataclass(frozen=True)
class DeepSpeedExportOptions:
    """The native checkpoint to write: ``dp`` (required: the data-parallel size DeepSpeed will
    load it at), ``zero_stage`` (None: the saving job's), ``ep`` (MoE models: the expert-parallel
    size; None: the saving job's), ``tag`` (None: ``global_step<N>``)."""

    dp: int | None = None
    zero_stage: int | None = None
    ep: int | None = None
    tag: str | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "ep"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CkptkitError(f"{name} must be a positive integer, got {value!r}")
        if self.zero_stage is not None and self.zero_stage not in (1, 2, 3):
            raise CkptkitError(f"zero_stage must be 1, 2 or 3, got {self.zero_stage!r}")

    def check(self) -> int:
        """The DP size, which an export cannot run without."""
        if self.dp is None:
            raise CkptkitError("the deepspeed export needs dp, the DP size the native checkpoint is written for "
                               "(CLI: --dp N)")
        return self.dp
