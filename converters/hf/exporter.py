"""Export a checkpoint's model weights as Hugging Face safetensors (and read them back).

Release engineers hand a trained model to the Hugging Face ecosystem as
``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.
The weights are read from the checkpoint in model space through :func:`ckptkit.open`
(whatever layout saved them), renamed by a declarative key table per model family
(:mod:`ckptkit_converters.hf.families`), transformed where the two conventions differ
(:mod:`ckptkit_converters.hf.mapping`), and streamed into the shards.

Memory is bounded by the largest single HF tensor, not by a shard or the model: a routed
expert stack ``[E, F, D]`` (or Megatron's ``[layers, E, 2F, D]``) is read one expert at a
time (``view[key][e]``), each shard's safetensors header is computed from the plan before any
data is read, and the tensors are written into the shard as they are read (one read ahead,
on a second thread, so reading and writing overlap).

Where the model sits is detected (:func:`detect_prefix`): under ``model/`` (ckptkit's manager,
the torchtitan adapter, Megatron imports) or at the top level (a torchtitan DCP checkpoint
imported as is, beside ``optimizer``, ``train_state``, ``lr_scheduler``, ``dataloader``). Which
table applies comes from the HF ``config.json``'s ``model_type`` and from the naming the keys
show (torchtitan or Megatron-core).

Both directions use the safetensors format only (a JSON header and raw bytes): no pickle.
Output goes through a byte store, so ``dest`` may be a local directory or an ``s3://`` prefix;
config and tokenizer files are not written (take them from the model's HF repository).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from ckptkit_converters.common.safetensors_out import SAFETENSORS_DTYPES, safetensors_header
from ckptkit_converters.hf.families import (
    FAMILIES,
    MEGATRON,
    Family,
    family_for,
    family_named,
    naming_of,
)
from ckptkit_converters.hf.importer import import_hf, read_hf
from ckptkit_converters.hf.slabs import check_budget, unit_slabs
from ckptkit_converters.hf.mapping import (
    AttentionHeads,
    HFConfig,
    Unit,
    apply,
    from_hf_name,
    is_dropped,
    match_name,
    out_shapes,
    rope_from_hf,
    rope_to_hf,
    to_hf_name,
)
from ckptkit_converters.hf.options import CAST_DTYPES, HFExportOptions, HFImportOptions

from ckptkit.engine.offline_writer import ConvertResult
from ckptkit.engine.prefetch import ReadAhead
from ckptkit.errors import CkptkitError, MissingKeysError
from ckptkit.offline.spread import Dealt, agreed, same_source, spread_comm, write_then_commit
from ckptkit.options import Progress
from ckptkit.storage.url import open_store

__all__ = [
    "FAMILIES",
    "INDEX_NAME",
    "SAFETENSORS_DTYPES",
    "AttentionHeads",
    "HFConfig",
    "HFExportOptions",  # defined in ckptkit_converters.hf.options; importable from here as before
    "HFExportResult",
    "HFImportOptions",
    "detect_prefix",
    "export_hf",
    "from_hf_name",
    "import_hf",
    "read_hf",
    "rope_from_hf",
    "rope_to_hf",
    "to_hf_name",
]

INDEX_NAME = "model.safetensors.index.json"
DTYPE_NAMES = {name: getattr(torch, name) for name in CAST_DTYPES}
# Top-level state a torchtitan DCP checkpoint keeps beside the model's own keys: never weights.
NOT_MODEL = ("optimizer", "train_state", "lr_scheduler", "dataloader", "optim", "train", "rng")


@dataclass(frozen=True)
class HFExportResult(ConvertResult):
    """A conversion's figures (``format`` is ``"hf"``), the safetensors files written, the table used,
    where the model was found, and the checkpoint tensors deliberately not exported."""

    shards: tuple[str, ...] = ()
    family: str = ""
    prefix: str = ""
    dropped: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        """Deprecated: the name this field had before the result was a ConvertResult; use ``.destination``."""
        warnings.warn("HFExportResult.dest is deprecated and is removed in the next release: use .destination",
                      DeprecationWarning, stacklevel=2)
        return self.destination

    @property
    def bytes(self) -> int:
        """Deprecated: the name this field had before the result was a ConvertResult; use ``.nbytes``."""
        warnings.warn("HFExportResult.bytes is deprecated and is removed in the next release: use .nbytes",
                      DeprecationWarning, stacklevel=2)
        return self.nbytes


# ---------------------------------------------------------------- where the model is


def detect_prefix(keys: list[str], where: str = "the checkpoint") -> str:
    """``"model/"`` or ``""``: the state path the model's weights sit under.

    A candidate is ``model/`` (its keys one level below it) or the top level (keys without a
    ``/`` that do not start with another top-level state's name, :data:`NOT_MODEL`); the one
    with more keys that any table knows wins. None known: an error listing what was seen.
    """
    scores = {}
    for prefix in ("model/", ""):
        names = _names_under(keys, prefix)
        scores[prefix] = sum(1 for n in names if any(match_name(f, n) for f in FAMILIES.values()))
    best = max(scores, key=lambda p: (scores[p], p == "model/"))
    if scores[best] == 0:
        tops = sorted({k.split("/")[0] if "/" in k else k.split(".")[0] for k in keys})[:8]
        raise MissingKeysError(f"{where}: no model weights found under 'model/' or at the top level (top-level "
                               f"names: {', '.join(tops) or 'none'}); give the prefix (HFExportOptions.prefix, "
                               f"CLI --prefix)")
    return best


def _names_under(keys: list[str], prefix: str) -> list[str]:
    out = []
    for k in keys:
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        if "/" in name or (prefix == "" and name.split(".")[0] in NOT_MODEL):
            continue
        out.append(name)
    return out


# ---------------------------------------------------------------- plan


@dataclass(frozen=True)
class _Plan:
    family: Family
    prefix: str
    units: list[Unit]
    dropped: tuple[str, ...]
    tie: bool


def plan_export(view: Any, cfg: HFConfig, options: HFExportOptions) -> _Plan:
    """Every unit to write, checked (names, counts, completeness) before any data is read."""
    keys = [t.key for t in view.tensors()]
    prefix = options.prefix if options.prefix is not None else detect_prefix(keys, view.url)
    allowed = set(_names_under(keys, prefix))
    entries = [t for t in view.tensors() if t.key.startswith(prefix) and t.key[len(prefix):] in allowed]
    if not entries:
        raise MissingKeysError(f"{view.url}: no tensors under {prefix!r} (set HFExportOptions.prefix)")
    names = [t.key[len(prefix):] for t in entries]
    family = family_named(options.family) if options.family else family_for(cfg.model_type, naming_of(names))
    tie = options.tie_word_embeddings if options.tie_word_embeddings is not None else (
        cfg.tie_word_embeddings if cfg.tie_word_embeddings is not None else family.tie_default)
    units: list[Unit] = []
    unknown, dropped = [], []
    has_output = False
    for t in entries:
        name = t.key[len(prefix):]
        m = match_name(family, name)
        if m is None:
            (dropped if is_dropped(family, name) else unknown).append(name)
            continue
        if m.rule.tied:
            has_output = True
            if tie:
                dropped.append(name)
                continue
        view.meta_of(t.key).stored_pieces()  # the coverage check: a missing expert fails here, before writing
        units.extend(_units(t.key, t.shape, m, cfg, view.url))
    if unknown:
        raise MissingKeysError(f"{view.url}: no {family.name} HF name for {len(unknown)} tensor(s) under "
                               f"{prefix!r}: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    if not tie and not has_output and family.naming == MEGATRON:
        raise CkptkitError(f"{view.url}: no output_layer.weight (the Megatron model ties it to the embedding), but "
                           f"{cfg.source} does not set tie_word_embeddings: true")
    _check_complete(units, family, cfg, view.url)
    return _Plan(family, prefix, units, tuple(dropped), tie)


def _units(key: str, shape: tuple[int, ...], m: Any, cfg: HFConfig, where: str) -> Iterator[Unit]:
    rule = m.rule
    layers: list[int | None] = list(range(shape[0])) if m.stacked else [m.layer]
    axis = 1 if m.stacked else 0
    experts: list[int | None] = list(range(shape[axis])) if rule.expert_axis else [None]
    lead = axis + (1 if rule.expert_axis else 0)
    shapes = out_shapes(rule, tuple(shape[lead:]), cfg, f"tensor {key!r} of {where}")
    for li, layer in enumerate(layers):
        for expert in experts:
            index = tuple(i for i in ((li if m.stacked else None), expert) if i is not None)
            names = tuple(o.hf.format(l=layer, e=expert) for o in rule.outs)
            yield Unit(key, index, rule, layer, expert, names, shapes)


def _check_complete(units: list[Unit], family: Family, cfg: HFConfig, where: str) -> None:
    """Every layer present (``num_hidden_layers``), every MoE layer with all its expert tensors, each with
    the config's expert count, and no two tensors writing one HF name."""
    seen: dict[str, str] = {}
    for u in units:
        for n in u.names:
            if n in seen and seen[n] != u.key:
                raise CkptkitError(f"{where}: {seen[n]!r} and {u.key!r} both map to HF tensor {n!r}")
            seen[n] = u.key
    layers = sorted({u.layer for u in units if u.layer is not None})
    if layers:
        n = cfg.num_layers or layers[-1] + 1
        missing = sorted(set(range(n)) - set(layers))
        if missing:
            raise MissingKeysError(f"{where}: no tensors for layer(s) {missing} of {n} "
                                   f"({'num_hidden_layers in ' + cfg.source if cfg.num_layers else 'by numbering'})")
        extra = [x for x in layers if x >= n]
        if extra:
            raise CkptkitError(f"{where}: tensors for layer {extra[0]}, but {cfg.source} says num_hidden_layers {n}")
    expert_rules = [r for r in family.rules if r.expert_axis]
    by_layer: dict[int | None, dict[str, set[int]]] = {}
    for u in units:
        if u.rule.expert_axis and u.expert is not None:
            by_layer.setdefault(u.layer, {}).setdefault(u.rule.ours, set()).add(u.expert)
    counts = {len(e) for per in by_layer.values() for e in per.values()}
    want = cfg.num_experts or (max(counts) if counts else 0)
    for layer, per in sorted(by_layer.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        for rule in expert_rules:
            got = per.get(rule.ours)
            if got is None:
                raise MissingKeysError(f"{where}: layer {layer} has routed experts but no {rule.ours.format(l=layer)!r}")
            missing = sorted(set(range(want)) - got)
            if missing or len(got) != want:
                what = f"{len(got)} experts stored, {cfg.source} says {want}" if got == set(range(len(got))) \
                    else f"expert {missing[0]} (of {want}) is missing"
                raise MissingKeysError(f"{where}: layer {layer}, tensor {rule.ours.format(l=layer)!r}: {what}")


def _shards(units: list[Unit], dtype: torch.dtype | None, view: Any, limit: int) -> list[list[Unit]]:
    shards: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        n = _unit_bytes(u, dtype or _dtype_of(view, u.key))
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(u)
        size += n
    return shards


def _unit_bytes(u: Unit, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s) * size for s in u.shapes)


def _dtype_of(view: Any, key: str) -> torch.dtype:
    return view[key].dtype


# ---------------------------------------------------------------- export


def export_hf(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    config: HFConfig | AttentionHeads | None = None,
    *,
    options: HFExportOptions = HFExportOptions(),
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    process_group: Any = None,
) -> HFExportResult:
    """Write the model weights of the checkpoint at ``source`` as HF safetensors shards at ``dest``.

    ``config``: the HF config's facts (:meth:`HFConfig.from_file`), or just head counts
    (:class:`AttentionHeads`, the Llama table); None: what ``options`` give (``config``,
    ``heads`` / ``kv_heads``), if anything (given, the argument is used and those are not). Every tensor under the prefix must have a rule in
    the table or be one of its known drops (an unknown name is an error naming it, never a
    silent drop); counts and completeness are checked before anything is written.

    ``process_group`` (a ``torchrun`` job's; call on every process with the same arguments): the
    shards are dealt to its processes by bytes and each writes its own; process 0 writes the
    index once every shard is there; a failure anywhere fails every process and removes the shards
    written. The files are the single-process export's, byte for byte.
    """
    t0 = time.perf_counter()
    comm = spread_comm(process_group)
    job = agreed(comm, lambda: _prepare(source, dest, config, options, storage_options))
    same_source(comm, job.view.url, job.view.manifest.attempt)
    sizes = {i: sum(_unit_bytes(u, job.dtypes[u.key]) for u in shard) for i, shard in enumerate(job.shards)}
    dealt = Dealt(comm, sizes, len(job.shards), progress, job.total, "hf-export")
    written: list[str] = []
    weight_map = {n: name for shard, name in zip(job.shards, job.names) for u in shard for n in u.names}
    index = {"metadata": {"total_size": job.total, "ckptkit_source": job.view.url,
                          "ckptkit_family": job.plan.family.name},
             "weight_map": dict(sorted(weight_map.items()))}

    def commit(_: list[Any]) -> None:  # process 0, once every shard is there: the export is complete
        written.append(INDEX_NAME)  # a partly written index goes with the shards
        job.out.put_bytes(INDEX_NAME, json.dumps(index, indent=2).encode())

    # a failed export, the index's write included, leaves no shard that a later config.json could pass off
    # as one: each process removes its own (until 2026-12-06 a failed index write left every shard, and a
    # retry into the folder was refused: found by a hunt)
    write_then_commit(comm, dealt, lambda mine: _write_shards(job, mine, dealt.tick, written), commit,
                      lambda: _remove(job.out, written), every_process_discards=True)
    return HFExportResult(job.view.url, job.out.url, "hf", len(weight_map), job.total, job.view.bytes_read - job.read0,
                          time.perf_counter() - t0, tuple(job.names), job.plan.family.name, job.plan.prefix,
                          job.plan.dropped)


@dataclass
class _Job:
    """What every process of an export finds the same before anything is written."""

    view: Any
    out: Any
    cfg: HFConfig
    plan: _Plan
    cast: torch.dtype | None
    permute: bool
    shards: list[list[Unit]]
    names: list[str]
    dtypes: dict[str, torch.dtype]
    total: int
    read0: int
    max_memory: int | None = None


def _prepare(source: str | os.PathLike[str], dest: str | os.PathLike[str], config: HFConfig | AttentionHeads | None,
             options: HFExportOptions, storage_options: dict[str, Any] | None) -> _Job:
    import ckptkit

    cfg = _config(config, options)
    view = ckptkit.open(source, storage_options=storage_options)
    read0 = view.bytes_read
    plan = plan_export(view, cfg, options)
    cast = DTYPE_NAMES[options.dtype] if options.dtype else None
    out = open_store(dest, storage_options)
    weights = [name for name in out.list_children() if name.endswith((".safetensors", ".safetensors.index.json"))]
    if weights:  # the user's config and tokenizer files may stay; weights never: they would be overwritten or shadow ours
        raise CkptkitError(
            f"{out.url}/{weights[0]} exists: an HF export writes its weights into a folder that holds none "
            f"({len(weights)} safetensors file(s) there; a failed export would remove any it overwrote, and a loader "
            "would take a leftover model.safetensors over a new index). Choose another destination, or move them")
    shards = _shards(plan.units, cast, view, options.max_shard_bytes)
    dtypes = {u.key: cast or _dtype_of(view, u.key) for u in plan.units}
    for d in set(dtypes.values()):
        if d not in SAFETENSORS_DTYPES:
            raise CkptkitError(f"{view.url}: safetensors cannot store {d} (tensor "
                               f"{next(k for k, v in dtypes.items() if v == d)!r})")
    total = sum(_unit_bytes(u, dtypes[u.key]) for u in plan.units)
    if options.max_memory is not None:  # a budget too small for some tensor fails here, before any write
        for u in plan.units:
            tensor = view[u.key]
            check_budget(u, tuple(tensor.shape[len(u.index):]), tensor.dtype, cast, cfg,
                         options.permute_rotary is not False, options.max_memory)
    return _Job(view, out, cfg, plan, cast, options.permute_rotary is not False, shards, _shard_names(len(shards)),
                dtypes, total, read0, options.max_memory)


def _write_shards(job: _Job, mine: list[int], tick: Callable[[int], None], written: list[str]) -> None:
    """Write the shards numbered ``mine``, naming each in ``written`` before it is begun: whole tensors
    (one read ahead), or under ``max_memory`` in slabs of rows (:mod:`.slabs`)."""

    def produce(u: Unit) -> list[torch.Tensor]:
        t = job.view[u.key][u.index] if u.index else job.view[u.key][...]
        if job.cast is not None and t.dtype != job.cast:
            t = t.to(job.cast)
        return apply(u, t, job.cfg, job.permute)

    def slabs(u: Unit) -> Iterator[tuple[int, torch.Tensor]]:
        tensor = job.view[u.key]
        return unit_slabs(u, lambda lo, hi: tensor[(*u.index, slice(lo, hi))], tuple(tensor.shape[len(u.index):]),
                          tensor.dtype, job.cast, job.cfg, job.permute, job.max_memory)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-hf-read") as pool:
        for i in mine:
            written.append(job.names[i])
            header = _header(job.shards[i], job.dtypes)
            data = (_shard_bytes(job.shards[i], header, pool, produce, tick) if job.max_memory is None
                    else _shard_slab_bytes(job.shards[i], header, slabs, tick))
            job.out.write_object(job.names[i], data)


def _remove(out: Any, names: list[str]) -> None:
    """Remove the shards a failed export wrote (only those: ``dest`` may hold the user's other files)."""
    for name in names:
        try:
            out.delete(name)
        except (CkptkitError, OSError):
            pass


def _config(config: HFConfig | AttentionHeads | None, options: HFExportOptions) -> HFConfig:
    """The model's facts: the ``config`` argument if given (a caller that built it from the options, or
    from anything else, has said which facts count), else what the options give, else none."""
    if config is None and options.gives_config:
        return options.hf_config()
    return HFConfig.of(config)


def _header(shard: list[Unit], dtypes: dict[str, torch.dtype]) -> bytes:
    """The safetensors header of a shard (computed from the plan: no data is needed)."""
    return safetensors_header((n, dtypes[u.key], shape) for u in shard for n, shape in zip(u.names, u.shapes))


def _shard_bytes(shard: list[Unit], header: bytes, pool: ThreadPoolExecutor,
                 produce: Callable[[Unit], list[torch.Tensor]], tick: Callable[[int], None]) -> Iterator[bytes | memoryview]:
    """The shard's bytes: the header, then each unit's tensors as they are read (one unit read ahead)."""
    yield header
    units = ReadAhead(len(shard), lambda i: produce(shard[i]), pool, read_ahead=1)
    for i, tensors in enumerate(units.in_order()):
        u = shard[i]
        for t, shape in zip(tensors, u.shapes):
            if tuple(t.shape) != tuple(shape):  # the plan and the data disagree: never write a wrong header
                raise CkptkitError(f"tensor {u.key!r} gave shape {list(t.shape)} for {u.names}, planned {list(shape)}")
            if t.numel():
                yield memoryview(t.reshape(-1).view(torch.uint8).numpy())
        tick(sum(t.numel() * t.element_size() for t in tensors))
        del tensors


def _shard_slab_bytes(shard: list[Unit], header: bytes, slabs: Callable[[Unit], Iterator[tuple[int, torch.Tensor]]],
                      tick: Callable[[int], None]) -> Iterator[bytes | memoryview]:
    """The shard's bytes under a memory budget: the header, then each unit's output tensors slab by slab
    (none read ahead), every output checked to fill exactly the rows its header entry promised, in order."""
    yield header
    for u in shard:
        rows = [0] * len(u.shapes)
        last = 0
        for i, t in slabs(u):
            shape = u.shapes[i]
            if i < last or any(rows[j] != u.shapes[j][0] for j in range(last, i)) or \
                    tuple(t.shape[1:]) != tuple(shape[1:]) or rows[i] + t.shape[0] > shape[0]:
                raise CkptkitError(f"tensor {u.key!r} gave rows {list(t.shape)} for {u.names[i]} after {rows[i]}, "
                                   f"planned {list(shape)}: the plan and the data disagree")
            if t.numel():
                yield memoryview(t.reshape(-1).view(torch.uint8).numpy())
            tick(t.numel() * t.element_size())
            rows[i] += t.shape[0]
            last = i
        if rows != [s[0] for s in u.shapes]:
            raise CkptkitError(f"tensor {u.key!r} gave {rows} rows for {list(u.names)}, planned "
                               f"{[list(s) for s in u.shapes]}")


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
