"""Per-tensor differences between two checkpoints: "did these runs diverge, and where?"

The two checkpoints may have been saved at different layouts and world
sizes: both are read in model space through :class:`CheckpointView`. Each
tensor is walked in boxes of at most ``chunk_elements`` elements (whole rows
along dim 0, splitting inner dimensions only when one row is larger than
that), the next pair of boxes being read while the current one is compared,
so memory stays at a few chunks whatever the checkpoint size.

Statistics are accumulated in float64 (complex128 for complex tensors):
max and mean absolute difference, the L2 norms of both tensors and the
relative norm ``||a - b|| / ||a||``. ``differing`` counts elements whose
bits differ (values compared after casting when the dtypes differ), so a
tensor is reported ``identical`` only if it is bit-for-bit the same.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from ckptkit.options import Progress
from ckptkit.errors import OptionsError
from ckptkit.layout.box import Box
from ckptkit.offline.view import CheckpointView, ViewOptions
from ckptkit.offline.view import open as open_view

Status = Literal["identical", "different", "dtype_mismatch", "shape_mismatch", "only_a", "only_b"]


@dataclass(frozen=True)
class DiffOptions:
    """``chunk_elements``: elements per box read from each checkpoint (memory is a few of these, in
    float64); ``prefetch``: box pairs read ahead of the comparison; ``io_threads``: reads in flight."""

    chunk_elements: int = 1 << 22
    prefetch: int = 1
    io_threads: int = 4

    def __post_init__(self) -> None:
        if self.chunk_elements < 1:
            raise OptionsError(f"chunk_elements {self.chunk_elements} must be >= 1")
        if self.prefetch < 0:
            raise OptionsError(f"prefetch {self.prefetch} must be >= 0")


@dataclass(frozen=True)
class TensorDiff:
    """One tensor's comparison. Statistics are None when the tensor is on one side only or the shapes differ."""

    key: str
    status: Status
    dtype_a: str | None
    dtype_b: str | None
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    numel: int = 0
    differing: int | None = None
    max_abs: float | None = None
    mean_abs: float | None = None
    norm_a: float | None = None
    norm_b: float | None = None
    rel_norm: float | None = None

    @property
    def identical(self) -> bool:
        return self.status == "identical"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for k in ("max_abs", "mean_abs", "norm_a", "norm_b", "rel_norm"):
            v = out[k]
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = str(v)  # JSON has no nan / inf
        return out


@dataclass(frozen=True)
class ValueDiff:
    """A non-tensor value (step, scheduler state, ...) that differs or exists on one side only (stored JSON)."""

    key: str
    a: Any
    b: Any
    status: Literal["different", "only_a", "only_b"]


@dataclass(frozen=True)
class DiffReport:
    a: str
    b: str
    pattern: str | None
    tensors: tuple[TensorDiff, ...]
    values: tuple[ValueDiff, ...]
    bytes_read: int
    seconds: float

    @property
    def identical(self) -> bool:
        return not self.values and all(t.identical for t in self.tensors)

    def differing(self) -> list[TensorDiff]:
        return [t for t in self.tensors if not t.identical]

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "pattern": self.pattern, "identical": self.identical,
            "tensors": [t.to_json() for t in self.tensors],
            "values": [asdict(v) for v in self.values],
            "bytes_read": self.bytes_read, "seconds": self.seconds,
        }


def diff(
    a: str | os.PathLike[str] | CheckpointView,
    b: str | os.PathLike[str] | CheckpointView,
    *,
    pattern: str | None = None,
    options: DiffOptions = DiffOptions(),
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> DiffReport:
    """Compare every tensor (matching the shell ``pattern``, if given) and every value of two checkpoints."""
    t0 = time.perf_counter()
    va = a if isinstance(a, CheckpointView) else open_view(a, storage_options=storage_options,
                                                            options=ViewOptions(options.io_threads))
    vb = b if isinstance(b, CheckpointView) else open_view(b, storage_options=storage_options,
                                                            options=ViewOptions(options.io_threads))
    read0 = va.bytes_read + vb.bytes_read
    keys = sorted(set(va.keys()) | set(vb.keys()))
    if pattern is not None:
        keys = [k for k in keys if fnmatch.fnmatchcase(k, pattern)]
    total = sum(va.meta_of(k).numel for k in keys if k in va and k in vb and va.meta_of(k).shape == vb.meta_of(k).shape)
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    out = []
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptkit-diff") as pool:
        for key in keys:
            out.append(diff_tensor(va, vb, key, options, pool, tick))
    values = [] if pattern is not None else _diff_values(va, vb)
    return DiffReport(
        va.url, vb.url, pattern, tuple(out), tuple(values),
        va.bytes_read + vb.bytes_read - read0, time.perf_counter() - t0,
    )


def diff_tensor(
    va: CheckpointView, vb: CheckpointView, key: str, options: DiffOptions,
    pool: ThreadPoolExecutor, tick: Callable[[int], None] = lambda n: None,
) -> TensorDiff:
    """Compare tensor ``key`` of two views, streaming boxes of at most ``options.chunk_elements``."""
    if key not in vb:
        m = va.meta_of(key)
        return TensorDiff(key, "only_a", m.dtype, None, m.shape, None, m.numel)
    if key not in va:
        m = vb.meta_of(key)
        return TensorDiff(key, "only_b", None, m.dtype, None, m.shape, m.numel)
    ma, mb = va.meta_of(key), vb.meta_of(key)
    if ma.shape != mb.shape:
        return TensorDiff(key, "shape_mismatch", ma.dtype, mb.dtype, ma.shape, mb.shape)
    acc = _Accumulator(ma.dtype == mb.dtype)
    for ta, tb in _box_pairs(va, vb, key, chunk_boxes(ma.shape, options.chunk_elements), options.prefetch, pool):
        acc.add(ta, tb)
        tick(ta.numel())
    if ma.dtype != mb.dtype:
        status: Status = "dtype_mismatch"
    else:
        status = "identical" if acc.differing == 0 else "different"
    numel = ma.numel
    mean = acc.sum_abs / numel if numel else 0.0
    norm_a, norm_b, norm_d = math.sqrt(acc.sq_a), math.sqrt(acc.sq_b), math.sqrt(acc.sq_d)
    if norm_a > 0:
        rel = norm_d / norm_a
    else:
        rel = 0.0 if norm_d == 0 else (math.nan if math.isnan(norm_d) else math.inf)
    if not acc.numeric:
        return TensorDiff(key, status, ma.dtype, mb.dtype, ma.shape, mb.shape, numel,
                          acc.differing if acc.same_dtype else None)
    return TensorDiff(key, status, ma.dtype, mb.dtype, ma.shape, mb.shape, numel, acc.differing,
                      acc.max_abs, mean, norm_a, norm_b, rel)


def chunk_boxes(shape: tuple[int, ...], max_elements: int) -> Iterator[Box]:
    """Boxes tiling a tensor of ``shape`` in row-major order, each at most ``max_elements`` elements.

    Whole rows (blocks along dim 0) when a row fits; otherwise each row is
    split the same way along the next dimension, recursively. A 0-d tensor is
    one empty-offset box; a tensor with no elements yields nothing.
    """
    if not shape:
        yield Box((), ())
        return
    if any(s == 0 for s in shape):
        return
    row = math.prod(shape[1:])
    if row <= max_elements:
        step = max(1, max_elements // row)
        for lo in range(0, shape[0], step):
            n = min(step, shape[0] - lo)
            yield Box((lo, *(0 for _ in shape[1:])), (n, *shape[1:]))
        return
    for i in range(shape[0]):
        for inner in chunk_boxes(shape[1:], max_elements):
            yield Box((i, *inner.offsets), (1, *inner.sizes))


def _box_pairs(
    va: CheckpointView, vb: CheckpointView, key: str, boxes: Iterator[Box], prefetch: int, pool: ThreadPoolExecutor,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Both sides of each box; ``prefetch`` pairs are read ahead while the caller compares."""
    pending: deque[tuple[Future[torch.Tensor], Future[torch.Tensor]]] = deque()

    def submit(box: Box) -> None:
        pending.append((pool.submit(va.read_box, key, box), pool.submit(vb.read_box, key, box)))

    for box in boxes:
        submit(box)
        while len(pending) > prefetch:
            fa, fb = pending.popleft()
            yield fa.result(), fb.result()
    while pending:
        fa, fb = pending.popleft()
        yield fa.result(), fb.result()


class _Accumulator:
    """Running statistics over chunks, in float64 (complex128 for complex data)."""

    def __init__(self, same_dtype: bool) -> None:
        self.same_dtype = same_dtype
        self.numeric = True  # False once a side has no arithmetic (packed float4): bits compared only
        self.differing = 0
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.sq_a = self.sq_b = self.sq_d = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.numel() == 0:
            return
        if self.same_dtype:
            self.differing += int(_bits_differ(a, b).sum())
        if a.dtype in _NO_ARITHMETIC or b.dtype in _NO_ARITHMETIC:
            self.numeric = False
            return
        wide = torch.complex128 if (a.is_complex() or b.is_complex()) else torch.float64
        a64, b64 = a.to(wide), b.to(wide)
        if not self.same_dtype:
            self.differing += int((a64 != b64).sum())
        d = (a64 - b64).abs()
        self.max_abs = _nanmax(self.max_abs, float(d.max()))
        self.sum_abs += float(d.sum())
        self.sq_d += float((d * d).sum())
        self.sq_a += float(a64.abs().square().sum())
        self.sq_b += float(b64.abs().square().sum())


_NO_ARITHMETIC = tuple(d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)  # torch >= 2.8
"""dtypes torch converts to no other (two 4-bit floats per byte): their differences are counted in bits, with
no numeric statistics."""


def _nanmax(x: float, y: float) -> float:
    return math.nan if math.isnan(x) or math.isnan(y) else max(x, y)


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do the stored bits differ? (NaN == NaN when the bits agree; 0.0 != -0.0.)"""
    size = a.element_size()
    if a.dtype == torch.bool:
        return a != b
    if size == 16:  # complex128: two float64 words per element
        return (a.view(torch.int64) != b.view(torch.int64)).reshape(*a.shape, 2).any(-1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return a.view(as_int) != b.view(as_int)


def _diff_values(va: CheckpointView, vb: CheckpointView) -> list[ValueDiff]:
    """Replicated values, compared in their stored JSON form (exact: floats included)."""
    a, b = va.manifest.values, vb.manifest.values
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in b:
            out.append(ValueDiff(key, a[key], None, "only_a"))
        elif key not in a:
            out.append(ValueDiff(key, None, b[key], "only_b"))
        elif _json_text(a[key]) != _json_text(b[key]):
            out.append(ValueDiff(key, a[key], b[key], "different"))
    return out


def _json_text(value: object) -> str:
    """A stored value as JSON text: Python's ``==`` calls ``True``, ``1`` and ``1.0`` equal, and ``0.0``
    and ``-0.0``, which load as different values (a diff called such checkpoints identical until
    2026-12-06); the save's merge compares the same way."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
