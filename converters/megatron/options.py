"""What a Megatron import and export take: two small frozen dataclasses (no torch imported).

Facts are named as Megatron-LM names them (``make_vocab_size_divisible_by``), so a user copies
them from their training arguments unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptkit.errors import CkptkitError, LayoutError
from ckptkit.layout.config import ParallelConfig


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CkptkitError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class MegatronImportOptions:
    """Facts a Megatron checkpoint may not record, and how its import runs.

    ``vocab_size`` / ``make_vocab_size_divisible_by``: the true vocabulary and its padding multiple,
    needed only when the saved ``args`` do not record them (given and recorded must agree; the
    error names what is missing). ``tied``: whether a legacy checkpoint without ``args`` ties the
    output layer to the embedding. ``threads``: source ranks written at once. ``weights_only``: leave the
    optimizer out, listed as skipped (by default it is imported wherever its form is one ckptkit reads; CLI:
    ``--opt weights_only=true``).
    """

    vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None
    tied: bool | None = None
    threads: int = 2
    weights_only: bool = False

    def __post_init__(self) -> None:
        _positive("vocab_size", self.vocab_size)
        _positive("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        _positive("threads", self.threads)


OPTIMIZER_FORMS = ("distributed", "plain")
"""Which Megatron optimizer an export writes the state for: the distributed one (its ``fully_reshardable``
form) or the plain one (a job without ``--use-distributed-optimizer``)."""


@dataclass(frozen=True)
class MegatronExportOptions:
    """The layout Megatron will load the torch_dist directory at (``layout``: tp, pp, with virtual
    chunks and uneven stages as ``vpp`` / ``pp_layers`` say, ep/etp for MoE; no context parallelism), the
    padding multiple to re-pad the vocabulary to (None: the checkpoint's), and ``weights_only``:
    leave the optimizer out (by default it is written, in the distributed optimizer's
    ``fully_reshardable`` form, whenever the checkpoint holds one; CLI: ``--opt weights_only=true``).
    ``optimizer``: which Megatron optimizer the state is written for, ``"distributed"`` or ``"plain"``
    (a job without ``--use-distributed-optimizer``; CLI: ``--opt optimizer=plain``). ``max_memory``: bytes of
    tensor data held at once; larger target chunks are written as slabs, each its own DCP chunk (CLI:
    ``--max-memory``; None: whole chunks)."""

    layout: ParallelConfig | None = None
    make_vocab_size_divisible_by: int | None = None
    weights_only: bool = False
    optimizer: str = "distributed"
    max_memory: int | None = None

    def __post_init__(self) -> None:
        _positive("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        _positive("max_memory", self.max_memory)
        check_optimizer_form(self.optimizer)

    def target(self) -> ParallelConfig:
        """The layout, checked to be one the exporter writes."""
        target = self.layout
        if target is None:
            raise CkptkitError("the megatron export needs the target layout: layout (CLI: --to LAYOUT, e.g. "
                               "--to tp2pp2), the tp/pp Megatron will load the torch_dist directory at")
        if target.cp != 1:
            raise LayoutError(f"--format megatron writes no context parallelism; target {target} asks for cp={target.cp}")
        return target


def check_optimizer_form(form: str) -> None:
    """Refuse an optimizer form other than :data:`OPTIMIZER_FORMS`, naming both."""
    if form not in OPTIMIZER_FORMS:
        raise CkptkitError(f"optimizer must be 'distributed' or 'plain' (the Megatron optimizer the export "
                           f"is for), got {form!r}")
