"""Hugging Face safetensors back to checkpoint names: routed experts stacked again, QKV fused again.

The inverse of :func:`ckptkit_converters.hf_safetensors.export_hf`, with the same key tables.
Each HF tensor name is matched to the rule (and layer, expert) it comes from; the tensors of one
rule are grouped into the checkpoint tensor they form (``w1_EFD`` ``[E, F, D]`` from E
``...experts.{e}.gate_proj.weight``; Megatron's ``[layers, E, 2F, D]`` fc1 from gate and up of
every layer and expert), and that grouping must be complete: a missing expert, layer or part is a
:class:`~ckptkit.errors.MissingKeysError` naming the layer, the expert and the HF key, never a
tensor with a hole.

Files are read through a byte store with ranged reads (:class:`SafetensorsFile`: the JSON header
is parsed and checked, then one tensor's bytes are read at a time): no pickle, no mmap, and
``s3://`` works like a local path. :func:`import_hf` writes a ckptkit checkpoint piece by piece
(one piece per layer / expert slice: memory is one slice); :func:`read_hf` returns a dict, for
models that fit in memory (tests, small models).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from ckptkit_converters.hf_families import (
    FAMILIES,
    TORCHTITAN,
    Family,
    Rule,
    family_for,
)
from ckptkit_converters.hf_mapping import AttentionHeads, HFConfig, invert, match_hf

from ckptkit.engine.offline_writer import (
    ConvertResult,
    OfflineWriteOptions,
    write_offline,
)
from ckptkit.errors import CkptkitError, CorruptCheckpointError, ManifestError, MissingKeysError
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import ExplicitLayout, TensorMeta
from ckptkit.layout.rules import PartitionRule
from ckptkit.layout.strict_json import load_json
from ckptkit.options import Progress
from ckptkit.storage.base import ByteStore
from ckptkit.storage.url import open_store

INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_MAX_HEADER = 100 << 20  # safetensors' own limit
HF_ONLY = (".rotary_emb.inv_freq",)
"""HF tensors that are not model state (older Llama exports store the RoPE frequencies): skipped on import,
as torchtitan's adapters skip them."""


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """One ``.safetensors`` file read lazily through a byte store: the header now, tensors on demand."""

    def __init__(self, store: ByteStore, name: str) -> None:
        self.store, self.name = store, name
        where = f"{store.url}/{name}"
        size = store.checked_size(name)
        if size < 8:
            raise CorruptCheckpointError(f"{where}: {size} bytes, too short for a safetensors file")
        head = bytearray(8)
        store.read_into(name, 0, memoryview(head))
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise CorruptCheckpointError(f"{where}: header of {n} bytes in a file of {size}")
        buf = bytearray(n)
        store.read_into(name, 8, memoryview(buf))
        doc = _json_object(bytes(buf), f"{where}: the header")
        self.entries: dict[str, _Entry] = {}
        data = size - 8 - n
        for key, e in doc.items():
            if key == "__metadata__":
                continue
            try:
                dtype = _DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CorruptCheckpointError(f"{where}: tensor {key!r} has a malformed header entry {e!r}") from None
            numel = 1
            for s in shape:
                if s < 0:
                    raise CorruptCheckpointError(f"{where}: tensor {key!r} has a negative dimension")
                numel *= s
            if not 0 <= begin <= end <= data or end - begin != numel * torch.empty((), dtype=dtype).element_size():
                raise CorruptCheckpointError(f"{where}: tensor {key!r} ({e['dtype']} {list(shape)}) has data offsets "
                                             f"[{begin}, {end}) that do not fit it or the file")
            self.entries[key] = _Entry(dtype, shape, 8 + n + begin, 8 + n + end)

    def read(self, key: str) -> torch.Tensor:
        e = self.entries[key]
        buf = bytearray(e.end - e.begin)
        if buf:
            self.store.read_into(self.name, e.begin, memoryview(buf))
            return torch.frombuffer(buf, dtype=e.dtype).reshape(e.shape)
        return torch.empty(e.shape, dtype=e.dtype)


def _json_object(data: bytes, where: str) -> dict:
    """A JSON object from an HF folder, parsed under the limits every checkpoint document gets
    (depth, duplicate keys, NaN; :mod:`ckptkit.layout.strict_json`): the folder may be hostile."""
    try:
        return load_json(data, where)
    except ManifestError as exc:
        raise CorruptCheckpointError(str(exc)) from None


def open_files(store: ByteStore) -> dict[str, SafetensorsFile]:
    """Every shard an HF folder lists (``model.safetensors.index.json``, or one ``model.safetensors``)."""
    if store.exists(INDEX_NAME):
        try:
            weight_map = _json_object(store.read_bytes(INDEX_NAME), f"{store.url}/{INDEX_NAME}")["weight_map"]
            files = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError):
            raise CorruptCheckpointError(f"{store.url}/{INDEX_NAME}: no weight_map of file names") from None
    elif store.exists("model.safetensors"):
        files = ["model.safetensors"]
    else:
        raise CkptkitError(f"{store.url}: neither {INDEX_NAME} nor model.safetensors")
    for f in files:
        if not isinstance(f, str) or "/" in f or f.startswith(".") or not f.endswith(".safetensors"):
            raise CorruptCheckpointError(f"{store.url}/{INDEX_NAME}: {f!r} is not a plain .safetensors file name")
    return {f: SafetensorsFile(store, f) for f in files}


# ---------------------------------------------------------------- grouping


@dataclass(frozen=True)
class Piece:
    """One slice of a checkpoint tensor (``index`` along its leading axes) and the HF tensors forming it."""

    index: tuple[int, ...]
    sources: tuple[tuple[str, str], ...]  # (file, HF name) per rule output
    layer: int | None
    expert: int | None


@dataclass(frozen=True)
class Target:
    """A checkpoint tensor to rebuild: ``key`` (no prefix), its rule, shape, dtype and pieces."""

    key: str
    rule: Rule
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]


def plan_import(files: Mapping[str, SafetensorsFile], family: Family, cfg: HFConfig, where: str) -> list[Target]:
    """Every checkpoint tensor the HF tensors form, checked complete."""
    found: dict[tuple[str, int | None], dict[tuple[int | None, int | None], dict[int, tuple[str, str]]]] = {}
    rules: dict[str, Rule] = {}
    unknown = []
    for fname, f in files.items():
        for name in f.entries:
            if name.endswith(HF_ONLY):
                continue
            hits = match_hf(family, name)
            if not hits:
                unknown.append(name)
                continue
            rule, out, layer, expert = hits[0]
            key = rule.ours.format(l=layer) if rule.per_layer else rule.ours
            group = (key, layer if rule.layer_axis else None)
            slot = found.setdefault(group, {}).setdefault((layer if rule.layer_axis else None, expert), {})
            i = rule.outs.index(out)
            if i in slot:
                raise CorruptCheckpointError(f"{where}: HF tensor {name!r} is in both {slot[i][0]} and {fname}")
            slot[i] = (fname, name)
            rules[key] = rule
    if unknown:
        raise MissingKeysError(f"{where}: no {family.name} checkpoint name for {len(unknown)} HF tensor(s): "
                               f"{', '.join(sorted(unknown)[:5])}{' ...' if len(unknown) > 5 else ''}")
    by_key: dict[str, dict[tuple[int | None, int | None], dict[int, tuple[str, str]]]] = {}
    for (key, _), slots in found.items():
        by_key.setdefault(key, {}).update(slots)
    experts = cfg.num_experts or max((e + 1 for slots in by_key.values() for (_, e) in slots if e is not None),
                                     default=0)
    layers = cfg.num_layers or max((layer + 1 for slots in by_key.values() for (layer, _) in slots
                                    if layer is not None), default=0)
    return [_target(key, rules[key], slots, files, experts, layers, cfg, where) for key, slots in sorted(by_key.items())]


def _target(key: str, rule: Rule, slots: dict[tuple[int | None, int | None], dict[int, tuple[str, str]]],
            files: Mapping[str, SafetensorsFile], experts: int, layers: int, cfg: HFConfig, where: str) -> Target:
    layer_range = range(layers) if rule.layer_axis else [None]
    expert_range = range(experts) if rule.expert_axis else [None]
    pieces, first = [], None
    for layer in layer_range:
        for expert in expert_range:
            slot = slots.get((layer, expert), {})
            for i, o in enumerate(rule.outs):
                if i not in slot:
                    lay = layer if layer is not None else _layer_of(key)
                    hf = o.hf.format(l=lay, e=expert)
                    what = ", ".join(x for x in (f"layer {lay}" if lay is not None else "",
                                                 f"expert {expert} (of {experts})" if expert is not None else "") if x)
                    raise MissingKeysError(f"{where}: {what + ': ' if what else ''}no HF tensor {hf!r} "
                                           f"(needed for {key!r})")
            srcs = tuple(slot[i] for i in range(len(rule.outs)))
            entries = [files[f].entries[n] for f, n in srcs]
            sig = [(e.dtype, e.shape) for e in entries]
            if first is None:
                first = sig
            elif sig != first:
                raise CkptkitError(f"{where}: {srcs[0][1]!r} is {sig[0][0]} {list(sig[0][1])}, the other slices of "
                                   f"{key!r} are {first[0][0]} {list(first[0][1])}")
            index = tuple(i for i in (layer, expert) if i is not None)
            pieces.append(Piece(index, srcs, layer, expert))
    assert first is not None
    dtype = first[0][0]
    shape0 = _slice_shape(rule, [s for _, s in first], cfg, f"{where}: {key!r}")
    lead = tuple(n for n, used in ((layers, rule.layer_axis), (experts, rule.expert_axis)) if used)
    return Target(key, rule, (*lead, *shape0), dtype, tuple(pieces))


def _layer_of(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() else None


def _slice_shape(rule: Rule, shapes: list[tuple[int, ...]], cfg: HFConfig, where: str) -> tuple[int, ...]:
    takes = [o.take for o in rule.outs]
    if takes in (["q", "k", "v"], ["gate", "up"]):
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise CkptkitError(f"{where}: the parts {[list(s) for s in shapes]} do not stack along rows")
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    return shapes[0]


def _read_slice(target: Target, piece: Piece, files: Mapping[str, SafetensorsFile], cfg: HFConfig,
                permute: bool, where: str) -> torch.Tensor:
    parts = [files[f].read(n) for f, n in piece.sources]
    return invert(target.rule, parts, cfg, permute, f"{where}: {target.key!r}")


def _family(cfg: HFConfig, family: str | None, naming: str) -> Family:
    if family is not None:
        if family not in FAMILIES:
            raise CkptkitError(f"unknown model family {family!r} (known: {', '.join(FAMILIES)})")
        return FAMILIES[family]
    return family_for(cfg.model_type, naming)


# ---------------------------------------------------------------- entry points


def read_hf(
    source: str | os.PathLike[str],
    config: HFConfig | AttentionHeads | None = None,
    *,
    family: str | None = None,
    naming: str = TORCHTITAN,
    permute_rotary: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """An HF safetensors folder as ``{checkpoint name: tensor}`` (experts stacked, renamed, permuted back).

    Loads everything into memory: meant for models that fit. :func:`import_hf` streams.
    ``config`` / ``family`` / ``naming`` pick the table as the export does (no ``model_type``: Llama).
    """
    cfg = HFConfig.of(config)
    store = open_store(source, storage_options)
    files = open_files(store)
    targets = plan_import(files, _family(cfg, family, naming), cfg, store.url)
    out = {}
    for t in targets:
        full = torch.empty(t.shape, dtype=t.dtype)
        for p in t.pieces:
            x = _read_slice(t, p, files, cfg, permute_rotary, store.url)
            if p.index:
                full[p.index] = x
            else:
                full = x
        out[t.key] = full
    return out


@dataclass(frozen=True)
class _Spec:
    dtype: str
    shape: tuple[int, ...]


class _Pieces:
    """The piece source of :func:`write_offline`: one HF slice (e.g. one expert) assembled per piece."""

    def __init__(self, order: list[tuple[Target, Piece]], files: Mapping[str, SafetensorsFile], cfg: HFConfig,
                 permute: bool, where: str) -> None:
        self.order, self.files, self.cfg, self.permute, self.where = order, files, cfg, permute, where
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, ref: int) -> torch.Tensor:
        target, piece = self.order[ref]
        x = _read_slice(target, piece, self.files, self.cfg, self.permute, self.where)
        self.bytes_read += x.numel() * x.element_size()
        return x.reshape((1,) * len(piece.index) + tuple(x.shape)).contiguous()


def _rule(t: Target, tensors: Mapping[str, _Spec], prefix: str, divisible_by: int) -> PartitionRule | None:
    if t.rule.layer_axis or t.key.startswith(("embedding.", "output_layer.", "decoder.")):
        from ckptkit_converters import megatron_names as names

        shapes = {k[len(prefix):]: s.shape for k, s in tensors.items() if k.startswith(prefix)}
        return names.rule_for(t.key, divisible_by=divisible_by, ffn=names.gated_ffn(t.key, shapes))
    return PartitionRule(expert_axis=0) if t.rule.expert_axis else None


def _layouts(tensors: Mapping[str, _Spec], items: list[tuple[str, Region]],
             rules: Mapping[str, PartitionRule | None]) -> dict[str, TensorMeta]:
    """Manifest entries carrying the rules: the pieces sorted exactly as the merge sorts them."""
    by_key: dict[str, list[tuple[Region, int]]] = {k: [] for k in tensors}
    for key, region in items:
        by_key[key].append((region, 0))
    return {k: TensorMeta(k, s.dtype, s.shape, ExplicitLayout(tuple(sorted(by_key[k], key=lambda p: (p[0].key(), p[1])))),
                          rule=rules[k]) for k, s in sorted(tensors.items())}


def import_hf(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    config: HFConfig | AttentionHeads | None = None,
    *,
    family: str | None = None,
    naming: str = TORCHTITAN,
    prefix: str = "model/",
    permute_rotary: bool = True,
    divisible_by: int = 128,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write the HF folder ``source`` as a committed ckptkit checkpoint at ``dest`` (tensors under ``prefix``).

    Each routed expert (and, for Megatron names, each layer) is one stored piece, read and written on
    its own: memory is one slice, not the model. ``ckptkit.load`` then reads it at any layout.
    The tensors carry partition rules (docs/moe.md): routed experts ``expert_axis`` (0 for torchtitan's
    ``[E, ...]``; Megatron's ``[layers, E, ...]``: ``layer_axis=0, expert_axis=1``), and for Megatron
    names the rules of :func:`ckptkit_converters.megatron_names.rule_for` (``divisible_by``: the
    vocabulary padding multiple a later Megatron export pads to; Megatron's default 128).
    """
    t0 = time.perf_counter()
    cfg = HFConfig.of(config)
    src = open_store(source, storage_options)
    files = open_files(src)
    targets = plan_import(files, _family(cfg, family, naming), cfg, src.url)
    tensors = {prefix + t.key: _Spec(str(t.dtype).removeprefix("torch."), t.shape) for t in targets}
    order: list[tuple[Target, Piece]] = []
    items: list[tuple[str, Region]] = []
    for t in targets:
        for p in t.pieces:
            lead = len(p.index)
            box = Box((*p.index, *(0 for _ in t.shape[lead:])), (*(1 for _ in p.index), *t.shape[lead:]))
            order.append((t, p))
            items.append((prefix + t.key, Region(box)))
    out = open_store(dest, storage_options)
    pieces = _Pieces(order, files, cfg, permute_rotary, src.url)
    rules = {prefix + t.key: _rule(t, tensors, prefix, divisible_by) for t in targets}
    result = write_offline(out, world_size=1, tensors=tensors, pieces={0: items}, source=lambda rank, _: pieces,
                           layouts=_layouts(tensors, items, rules),
                           meta={"converted_from": {"url": src.url, "format": "hf"}},
                           options=OfflineWriteOptions(threads=1), progress=progress,
                           what=f"importing {src.url} into {out.url}")
    return ConvertResult(src.url, out.url, "ckptkit", len(tensors), result.nbytes, result.bytes_read,
                         time.perf_counter() - t0)
