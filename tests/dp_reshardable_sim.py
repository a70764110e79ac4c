"""Megatron ``torch_dist`` folders with the distributed optimizer's ``dp_reshardable`` form, written in one process.

The real format is covered by Megatron's own saves (tests/test_megatron.py); this writer lays buckets out by the
same rules (megatron-core 0.16: ``sharded_param_state_dp_reshardable`` and the grad buffer's layout) so that
the import can be fuzzed over what one real job cannot vary cheaply: the order of parameters in a bucket, how
many buckets, where DP ranks split a parameter, what the alignment gaps hold, equal weights, bf16 casts. Every
parameter's start is padded to 64 elements, the bucket end to ``lcm(dp, 128)``, each DP rank saves its own range
of every bucket (each parameter's and each gap's slice a chunk of its own, in the file of its global rank
``tp_rank + tp * dp_rank``), model-space weights are saved once per TP rank (replicated ones once), and each
data-parallel group saves its param groups as a sharded object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckptkit.layout.box import Box
from ckptkit_converters.dcp.files import Blob, Chunk, OutItem, OutTensor, build_metadata, save_blob
from ckptkit_converters.megatron.names import VOCAB_PADDING_SUFFIX

EMB, OUT, FINAL = "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"
QKV = "decoder.layers.self_attention.linear_qkv.weight"
QKV_NORM = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
PROJ, FC1, FC1_NORM = ("decoder.layers.self_attention.linear_proj.weight", "decoder.layers.mlp.linear_fc1.weight",
                       "decoder.layers.mlp.linear_fc1.layer_norm_weight")
FC2 = "decoder.layers.mlp.linear_fc2.weight"
STATES = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class Sim:
    """What to write. ``order``: shuffles each group's parameter order with this seed (None: reversed
    registration order, as Megatron does); ``bucket_size``: a new bucket once one holds this many elements."""

    tp: int = 2
    dp: int = 2
    layers: int = 2
    hidden: int = 8
    ffn: int = 12
    vocab: int = 30
    divisible_by: int = 8
    dtype: torch.dtype = torch.float32
    seed: int = 0
    order: int | None = None
    bucket_size: int | None = None
    gap_fill: str = "random"  # or "copies": the gaps hold the leading values of the parameters around them
    step: float = 5.0
    form: str = "dp_reshardable"
    chain: str = ""
    """A prefix of the optimizer's keys: ``chained_1.`` as a ChainedOptimizer's part saves them."""
    """Or ``fully_reshardable``: the same state in model space (the benchmark's comparison)."""
    equal: tuple[str, ...] = ()
    """Model keys whose every layer's weight is set equal to the final norm (ties); ``equal_states``: so are
    their states."""
    equal_states: bool = False
    flat_hook: Callable[[str, int, int, list[tuple[int, int, str, list[Box]]], torch.Tensor], None] | None = None
    """Damage: called with (state, group, bucket index, the bucket's parameters, its flat values) before saving."""
    metadata_hook: Callable[[list[OutTensor], list[OutItem], "_Files"], None] | None = None
    """Damage: called with the DCP tensors and items before ``.metadata`` is written."""
    group_steps: dict[int, float] = field(default_factory=dict)
    """A data-parallel group's own step (damage: Megatron saves one for all)."""
    main: dict[str, torch.Tensor] = field(default_factory=dict)
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def padded_vocab(self) -> int:
        m = self.divisible_by * self.tp
        return -(-self.vocab // m) * m


def _shapes(sim: Sim) -> dict[str, tuple[int, ...]]:
    h, f, n, v = sim.hidden, sim.ffn, sim.layers, sim.padded_vocab
    return {EMB: (v, h), QKV_NORM: (n, h), QKV: (n, 3 * h, h), PROJ: (n, h, h), FC1_NORM: (n, h),
            FC1: (n, 2 * f, h), FC2: (n, h, f), FINAL: (h,), OUT: (v, h)}  # registration order


def _local_boxes(sim: Sim, key: str, shape: tuple[int, ...], t: int, layer: int | None) -> list[Box]:
    """The model-space chunks of TP rank ``t``'s local parameter of ``key`` (at ``layer``), in flat order."""
    if key in (FINAL, QKV_NORM, FC1_NORM):
        return [Box((layer, 0), (1, shape[1]))] if layer is not None else [Box((0,), shape)]
    if key in (EMB, OUT):
        rows = shape[0] // sim.tp
        return [Box((t * rows, 0), (rows, shape[1]))]
    _, a, b = shape
    if key == FC1:
        rows = sim.ffn // sim.tp
        return [Box((layer, t * rows, 0), (1, rows, b)), Box((layer, sim.ffn + t * rows, 0), (1, rows, b))]
    if key == QKV:
        return [Box((layer, t * (a // sim.tp), 0), (1, a // sim.tp, b))]
    return [Box((layer, 0, t * (b // sim.tp)), (1, a, b // sim.tp))]


def _cut(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]


def _params(sim: Sim, t: int) -> list[tuple[str, list[Box]]]:
    """Group ``t``'s local parameters in the module's registration order (the embedding, each layer's in turn,
    the final norm, the output layer: the order of :func:`_shapes`, which is also the DCP key order), reversed
    as Megatron's buffer takes them; or shuffled (``order``)."""
    shapes = _shapes(sim)
    top = {EMB: -1, FINAL: sim.layers, OUT: sim.layers}
    out = [(key, _local_boxes(sim, key, shapes[key], t, None)) for key in shapes if top.get(key) == -1]
    for layer in range(sim.layers):
        out += [(key, _local_boxes(sim, key, shape, t, layer)) for key, shape in shapes.items() if key not in top]
    out += [(key, _local_boxes(sim, key, shapes[key], t, None)) for key in shapes if top.get(key) == sim.layers]
    out.reverse()  # Megatron's buffer takes the module's parameters in reverse
    if sim.order is not None:
        random.Random(sim.order * 1000 + t).shuffle(out)
    return out


def _values(sim: Sim) -> None:
    g = torch.Generator().manual_seed(sim.seed)
    for key, shape in _shapes(sim).items():
        sim.main[key] = torch.randn(shape, generator=g)
        sim.states[key] = {"exp_avg": torch.randn(shape, generator=g) * 1e-3,
                           "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6}
    for key in sim.equal:
        for layer in range(sim.layers):
            sim.main[key][layer] = sim.main[FINAL]
            if sim.equal_states:
                for s in ("exp_avg", "exp_avg_sq"):
                    sim.states[key][s][layer] = sim.states[FINAL][s]


class _Files:
    """The ``.distcp`` files: blobs appended per writer rank."""

    def __init__(self) -> None:
        self.data: dict[int, bytearray] = {}

    def put(self, rank: int, obj: object) -> Blob:
        buf = self.data.setdefault(rank, bytearray())
        raw = save_blob(obj)
        blob = Blob(f"__{rank}_0.distcp", len(buf), len(raw))
        buf.extend(raw)
        return blob


def _buckets(sim: Sim, t: int) -> list[list[tuple[int, int, str, list[Box]]]]:
    """Group ``t``'s buckets: (start, end, key, boxes) of each parameter, starts padded to 64."""
    buckets, current, pos = [], [], 0
    for key, boxes in _params(sim, t):
        start = -(-pos // 64) * 64
        numel = sum(b.numel for b in boxes)
        current.append((start, start + numel, key, boxes))
        pos = start + numel
        if sim.bucket_size is not None and pos >= sim.bucket_size:
            buckets.append(current)
            current, pos = [], 0
    if current:
        buckets.append(current)
    return buckets


def _flat(sim: Sim, bucket: list[tuple[int, int, str, list[Box]]], state: str, g: torch.Generator) -> torch.Tensor:
    end = bucket[-1][1]
    flat = torch.randn(end, generator=g) * 7  # torch.empty: whatever was there
    for start, stop, key, boxes in bucket:
        values = sim.main[key] if state == "param" else sim.states[key][state]
        flat[start:stop] = torch.cat([_cut(values, b).reshape(-1) for b in boxes])
    if sim.gap_fill == "copies":
        for (_, stop, _, _), (nxt, nxt_end, _, _) in zip(bucket, bucket[1:]):
            n = min(nxt - stop, nxt_end - nxt)
            flat[stop:stop + n] = flat[nxt:nxt + n]
    return flat


def _bucket_tensors(sim: Sim, t: int, k: int, bucket: list[tuple[int, int, str, list[Box]]], files: _Files,
                    g: torch.Generator) -> list[OutTensor]:
    unpadded = bucket[-1][1]
    local = -(-unpadded // math.lcm(sim.dp, 128)) * math.lcm(sim.dp, 128) // sim.dp
    cuts = sorted({0, unpadded, *(x for s, e, _, _ in bucket for x in (s, e)),
                   *(r * local for r in range(1, sim.dp) if r * local < unpadded)})
    name = (f"{sim.chain}optimizer.distributed.dp_group_idx_{t}.gbuf_idx_0.dtype_({sim.dtype}, {sim.dtype})"
            f".bucket_idx_{k}")
    out = []
    for state in STATES:
        flat = _flat(sim, bucket, state, g)
        if sim.flat_hook is not None:
            sim.flat_hook(state, t, k, bucket, flat)
        chunks = tuple(Chunk(Box((a,), (b - a,)), files.put(t + sim.tp * (a // local), flat[a:b].clone()))
                       for a, b in zip(cuts, cuts[1:]))
        out.append(OutTensor(f"{name}.{state}", (f"{name}.{state}",), "float32", (unpadded,), chunks))
    return out


def _model_space(sim: Sim, files: _Files) -> list[OutTensor]:
    """The weights, saved once per TP rank's chunk; in the ``fully_reshardable`` form the states too, chunked alike."""
    tensors = []
    for key, shape in _shapes(sim).items():
        values = {"": sim.main[key].to(sim.dtype)}
        if sim.form == "fully_reshardable":
            values.update({f"{sim.chain}optimizer.state.{s}.": sim.main[key] if s == "param" else sim.states[key][s]
                           for s in STATES})
        for prefix, tensor in values.items():
            seen, chunks = set(), []
            for t in range(sim.tp):
                for layer in ([None] if key in (EMB, OUT, FINAL) else range(sim.layers)):
                    for box in _local_boxes(sim, key, shape, t, layer):
                        if box.offsets not in seen:
                            seen.add(box.offsets)
                            chunks.append(Chunk(box, files.put(t, _cut(tensor, box).clone())))
            dtype = str(tensor.dtype).removeprefix("torch.")
            tensors.append(OutTensor(prefix + key, (prefix + key,), dtype, shape, tuple(chunks)))
    return tensors


def write(sim: Sim, folder: Path) -> Path:
    """The torch_dist folder of ``sim`` at ``folder`` (created)."""
    folder.mkdir(parents=True)
    _values(sim)
    files, items = _Files(), []
    tensors = _model_space(sim, files)
    g = torch.Generator().manual_seed(sim.seed + 1)
    groups = [{"lr": 1e-3, "weight_decay": 0.01, "step": sim.step, "params": [0]}]
    optimizer: dict = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": sim.form}
    if sim.form == "dp_reshardable":
        optimizer = {"param_state_sharding_type": sim.form}
        for t in range(sim.tp):
            for k, bucket in enumerate(_buckets(sim, t)):
                tensors.extend(_bucket_tensors(sim, t, k, bucket, files, g))
            record = [{"param_groups": [{**groups[0], "step": sim.group_steps.get(t, sim.step)}]}]
            fqn = f"{sim.chain}optimizer.distributed.dp_group_idx_{t}.optimizer/shard_0_1"
            items.append(OutItem(fqn, (fqn,), files.put(t, record)))
    if sim.metadata_hook is not None:
        sim.metadata_hook(tensors, items, files)
    for rank in range(sim.tp * sim.dp):  # DCP: every rank writes a file, an empty one if it holds nothing
        (folder / f"__{rank}_0.distcp").write_bytes(bytes(files.data.get(rank, b"")))
    (folder / ".metadata").write_bytes(build_metadata(tensors, items, str(folder)))
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    args = argparse.Namespace(num_layers=sim.layers, hidden_size=sim.hidden, tensor_model_parallel_size=sim.tp,
                              pipeline_model_parallel_size=1, make_vocab_size_divisible_by=sim.divisible_by,
                              padded_vocab_size=sim.padded_vocab, vocab_size=sim.vocab,
                              untie_embeddings_and_output_weights=True, world_size=sim.tp * sim.dp,
                              params_dtype=sim.dtype)
    torch.save({"iteration": 5, "checkpoint_version": 3.0, "args": args, "optimizer": optimizer}, folder / "common.pt")
    return folder


def expected(sim: Sim) -> dict[str, torch.Tensor]:
    """What the import must hold: the model weights and every state in model space, vocab padding apart."""
    out = {}
    for key in _shapes(sim):
        for name, values in (("model/", sim.main[key].to(sim.dtype)), ("optimizer/main/", sim.main[key]),
                             ("optimizer/exp_avg/", sim.states[key]["exp_avg"]),
                             ("optimizer/exp_avg_sq/", sim.states[key]["exp_avg_sq"])):
            if key in (EMB, OUT):
                out[name + key] = values[:sim.vocab]
                if sim.padded_vocab > sim.vocab:
                    out[name + key + VOCAB_PADDING_SUFFIX] = values[sim.vocab:]
            else:
                out[name + key] = values
    return out
