"""Write one format version's golden checkpoints for tests/test_golden.py (see tests/golden/README.md).

The ckptkit that writes them is whatever ``PYTHONPATH`` puts first, usually a read-only extract
of the commit whose format the fixtures pin::

    git -C . archive 1877ae0 | tar -x -C /tmp/ckptkit-v1        # format version 1
    cd /tmp && PYTHONPATH=/tmp/ckptkit-v1 /work/main/.venv/bin/python /work/main/tests/make_golden.py \\
        /work/main/tests/golden/v1 --commit 1877ae0

(run it from a directory without a ``ckptkit`` package of its own, e.g. ``/tmp``: Python puts
the current directory of ``python -c`` first, and the editable install of this checkout would win).
The script refuses to write into an existing fixture folder: fixtures of a released format are
never regenerated, a new format version gets new ones.

Every fixture is a folder ``<name>/`` holding ``ckpt/`` (the checkpoint as that code wrote it),
``expected.npz`` and ``expected.json``. The expected side never comes from ckptkit: tensors are the
source values the ranks held (hand-built tensors, or the framework's own live parameters and
optimizer state, gathered here by plain torch arithmetic), bfloat16 as raw uint16 bits; values
and per-rank values are what the state handed to ``ckptkit.save`` held (captured by wrapping
``ckptkit.save``), in a small JSON encoding of this file's own (:func:`encode`). Before anything
is kept, the writing code reads the checkpoint back and must agree with the expected side.

Fixtures (``--only`` picks some):

* ``dtensor_fsdp``: tests/models.py's tiny net (at :data:`DTENSOR_NET` sizes) under FSDP2
  (``Shard(0)``) on 2 ranks, fp32, two AdamW steps, plus a hand-built bf16 DTensor sharded unevenly
  on dim 1;
* ``dtensor_fsdp_tp``: the same net, bf16, FSDP2 x TP on a 2 x 2 mesh (``_StridedShard``), 4 ranks;
* ``flat``: ``ckptkit.Sharded`` states on 2 ranks: a ZeRO-style flat buffer holding fragments of
  three parameters (one straddling the ranks), a bf16 flat buffer split unevenly, fused-GLU boxes
  (two boxes in one local tensor), a ``replica=`` tensor, plain replicated tensors (fp16, 0-d f64);
* ``deepspeed``: tests/deepspeed_job.py's MLP, ZeRO-2, fp32, 2 ranks, two steps, through
  ``ckptkit.adapters.deepspeed.save`` (no per-rank values: the adapter stores none);
* ``megatron``: a 2-layer Megatron-core GPT (hidden 8, 2 heads in 2 query groups, SwiGLU ffn 16,
  RMSNorm, vocabulary 30 padded to 32), tp2, plain Adam, 2 ranks, two steps, through
  ``ckptkit.adapters.megatron.save`` (per-rank RNG states).

Each own-state fixture carries values (nested, tuples, bytes, nan/inf, non-string dict keys, empty
containers), a ``PerRank`` value and a ``torch.Generator`` on every rank; from format version 2 on,
also a value the ranks disagree about (kept per rank).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))  # tests.* helpers; ckptkit itself comes from PYTHONPATH

FIXTURES = ("dtensor_fsdp", "dtensor_fsdp_tp", "flat", "deepspeed", "megatron")
WORLDS = {"dtensor_fsdp": 2, "dtensor_fsdp_tp": 4, "flat": 2, "deepspeed": 2, "megatron": 2}
METADATA = {"dtensor_fsdp": {"fixture": "dtensor_fsdp", "step": 2}, "dtensor_fsdp_tp": {"fixture": "dtensor_fsdp_tp", "step": 2},
            "flat": {"fixture": "flat", "step": 9, "note": ["a", 1.5]}}  # ckptkit.save(..., metadata=); the adapters pass none


# ---------------------------------------------------------------- the expected side's own JSON encoding

def encode(v: Any) -> Any:
    """JSON for a Python value, tagging what JSON cannot say: every dict is ``{"dict": [[k, v], ...]}``,
    tuples ``{"tuple": [...]}``, bytes ``{"bytes": base64}``, non-finite floats ``{"float": "nan"}``."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, tuple):
        return {"tuple": [encode(x) for x in v]}
    if isinstance(v, list):
        return [encode(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, dict):
        return {"dict": [[encode(k), encode(x)] for k, x in v.items()]}
    raise TypeError(f"cannot encode {type(v).__name__}")


def decode(v: Any) -> Any:
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict):
        (tag, inner), = v.items()
        if tag == "dict":
            return {decode(k): decode(x) for k, x in inner}
        if tag == "tuple":
            return tuple(decode(x) for x in inner)
        if tag == "bytes":
            return base64.b64decode(inner)
        if tag == "float":
            return float(inner)
        raise ValueError(f"unknown tag {tag!r}")
    return v


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types (tuple is not list, 1 is not 1.0 nor True), nan equal to nan;
    dicts compare as mappings (key order aside)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    return a == b


# ---------------------------------------------------------------- what the state handed to ckptkit.save held

def _key(path: tuple) -> str:
    return "/".join(str(p).replace("%", "%25").replace("/", "%2F") for p in path)


def leaves(state: dict) -> dict[str, dict[str, Any]]:
    """The non-tensor leaves of a ckptkit state by key, walked the way docs/format.md describes
    (dicts and lists holding state are containers, everything else a value)."""
    import ckptkit

    out: dict[str, dict[str, Any]] = {"values": {}, "per_rank": {}, "generators": {}}

    def has_state(o: Any) -> bool:
        if isinstance(o, (torch.Tensor, ckptkit.Sharded, torch.Generator, ckptkit.PerRank)):
            return True
        if isinstance(o, dict):
            return any(has_state(x) for x in o.values())
        if isinstance(o, (list, tuple)):
            return any(has_state(x) for x in o)
        return False

    def walk(o: Any, path: tuple) -> None:
        if isinstance(o, (torch.Tensor, ckptkit.Sharded)):
            return
        if isinstance(o, torch.Generator):
            out["generators"][_key(path)] = o.get_state().numpy().tobytes()
        elif isinstance(o, ckptkit.PerRank):
            out["per_rank"][_key(path)] = o.value
        elif isinstance(o, dict) and o:
            for k, x in o.items():
                walk(x, (*path, k))
        elif isinstance(o, (list, tuple)) and o and has_state(o):
            for i, x in enumerate(o):
                walk(x, (*path, i))
        elif path:
            out["values"][_key(path)] = o

    walk(state, ())
    return out


@contextlib.contextmanager
def capture_save(into: dict):
    """Record the leaves of the state an adapter hands to ``ckptkit.save``."""
    import ckptkit

    real = ckptkit.save

    def save(state, path, **kw):
        into.update(leaves(state))
        return real(state, path, **kw)

    ckptkit.save = save
    try:
        yield
    finally:
        ckptkit.save = real


def version() -> int:
    from ckptkit.layout.manifest import VERSION

    return VERSION


def own_values(rank: int) -> dict[str, Any]:
    vals: dict[str, Any] = {
        "step": 9, "lr": 1.5e-4, "betas": (0.9, 0.95), "name": "golden", "flags": [True, False, None],
        "inf": float("inf"), "nan": float("nan"), "blob": b"\x00\x01\xfe\xff", "ids": {1: "a", 2: "b"},
        "empty": {}, "nothing": [], "big": 2 ** 70, "nested": {"a": [1, {"b": (2, 3.5)}]},
    }
    if version() >= 2:
        vals["seen_by"] = f"rank {rank}"  # the ranks disagree: kept per rank
    return vals


def per_rank_extras(rank: int) -> dict[str, Any]:
    import ckptkit

    g = torch.Generator().manual_seed(1000 + rank)
    torch.randn(7, generator=g)  # a state that is not a fresh seed's
    return {"loader": ckptkit.PerRank({"position": 1000 * rank + 7, "epoch": 1, "order": (rank, 2), "tag": b"r%d" % rank}),
            "rng": g}


# ---------------------------------------------------------------- rank functions (run in tests/worlds.py worlds)

DTENSOR_NET = (11, 6, 10)  # vocabulary, width, MLP hidden: every shard uneven somewhere (11 rows over 2 or 4 ranks)


def job_dtensor(path: str, layout: str, dtype: str) -> dict[str, Any]:
    import torch.distributed as dist

    import ckptkit
    from tests import models

    rank = dist.get_rank()
    models.VOCAB, models.DIM, models.HIDDEN = DTENSOR_NET  # tests/models.py's net, smaller (read at build time)
    model, optim = models.build(layout, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], seed=0)
    models.train(model, optim, 2)
    state = models.sharded_state(model, optim)
    full: dict[str, torch.Tensor] = {}
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        wide = torch.randn(6, 13, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        local = torch.chunk(wide, dist.get_world_size(), dim=1)[rank].contiguous()  # 7 + 6 columns
        state["extra"] = {"wide": DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=wide.shape,
                                                     stride=wide.stride())}
        full["extra/wide"] = wide
    state["train"] = own_values(rank)
    state.update(per_rank_extras(rank))
    captured = leaves(state)
    ckptkit.save(state, path, metadata=METADATA[f"dtensor_{layout}"])
    for k, v in models.full_state(model, optim).items():  # gathered by torch.distributed.checkpoint, not ckptkit
        full[k.replace("optim/", "optim/state/", 1) if k.startswith("optim/") else k] = v
    return {"leaves": captured, "full": full if rank == 0 else None}


ZERO = {"zero/exp_avg/a": ((6, 5), torch.float32), "zero/exp_avg/b": ((7,), torch.float32),
        "zero/exp_avg/c": ((4, 9), torch.float32)}
OTHER = {"zero/bf16/w": ((5, 12), torch.bfloat16), "glu/w": ((8, 3), torch.float32),
         "rep/bias": ((5,), torch.int64), "plain/table": ((3, 4), torch.float16), "plain/scalar": ((), torch.float64)}
BF16_SPLIT = 31  # zero/bf16/w's 60 elements: [0, 31) on rank 0, [31, 60) on rank 1


def flat_full(key: str) -> torch.Tensor:
    shape, dtype = {**ZERO, **OTHER}[key]
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    if dtype == torch.int64:
        return torch.randint(-10 ** 12, 10 ** 12, shape, generator=g)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def job_flat(path: str) -> dict[str, Any]:
    import torch.distributed as dist

    import ckptkit

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [math.prod(s) for s, _ in ZERO.values()]
    per = -(-sum(sizes) // world)  # 73 elements: 37 per rank, the last rank's buffer padded by one
    lo, hi = rank * per, (rank + 1) * per
    buf = torch.zeros(per)
    pieces, start = [], 0
    for key, n in zip(ZERO, sizes):
        a, b = max(lo, start), min(hi, start + n)
        if b > a:
            shape = ZERO[key][0]
            pieces.append(ckptkit.flat_piece(key, shape, ckptkit.Box.full(shape), a - start, b - start, local_start=a - lo))
            buf[a - lo:b - lo] = flat_full(key).reshape(-1)[a - start:b - start]
        start += n
    w = flat_full("zero/bf16/w")
    a, b = (0, BF16_SPLIT) if rank == 0 else (BF16_SPLIT, w.numel())
    bf16 = ckptkit.Sharded(w.reshape(-1)[a:b].clone(),
                           [ckptkit.flat_piece("zero/bf16/w", (5, 12), ckptkit.Box.full((5, 12)), a, b)])
    glu = flat_full("glu/w")  # [gate; up] of 4 rows each, each half split over the 2 ranks
    local = torch.cat([glu[2 * rank:2 * rank + 2], glu[4 + 2 * rank:4 + 2 * rank + 2]])
    glu_state = ckptkit.Sharded(local, [
        ckptkit.box_piece("glu/w", (8, 3), (2 * rank, 0), (2, 3), local_offsets=(0, 0)),
        ckptkit.box_piece("glu/w", (8, 3), (4 + 2 * rank, 0), (2, 3), local_offsets=(2, 0)),
    ])
    rep = flat_full("rep/bias")
    state = {
        "zero": ckptkit.Sharded(buf, pieces),
        "bf16": bf16,
        "glu": glu_state,
        "rep": ckptkit.Sharded(rep.clone(), [ckptkit.box_piece("rep/bias", (5,), (0,), (5,), replica=(rank, world))]),
        "plain": {"table": flat_full("plain/table"), "scalar": flat_full("plain/scalar")},
        "train": own_values(rank),
        **per_rank_extras(rank),
    }
    captured = leaves(state)
    ckptkit.save(state, path, metadata=METADATA["flat"])
    return {"leaves": captured, "full": {k: flat_full(k) for k in {**ZERO, **OTHER}} if rank == 0 else None}


def _gather_flat(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def job_deepspeed(path: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ckptkit.adapters import deepspeed as ds_ckpt
    from tests import deepspeed_job as dj

    engine = dj.build(2, "fp32")
    for step in (1, 2):
        dj.train_step(engine, step)
    captured: dict[str, Any] = {}
    with capture_save(captured):
        ds_ckpt.save(engine, path, client_state={"epoch": 3, "note": "golden"})
    # The expected tensors from DeepSpeed's own structures: the module's (full, under ZeRO-2) parameters
    # and buffers, and each flat fp32 partition and its Adam state gathered over the ranks and cut
    # at the parameters' sizes, in the group's order (zero_to_fp32's recipe).
    full = {f"model/{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    full.update({f"model/{n}": b.detach().clone() for n, b in engine.module.named_buffers()})
    names = {id(p): n for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    for g, params in enumerate(opt.bit16_groups):
        assert [id(p) for p in opt.round_robin_bit16_groups[g]] == [id(p) for p in params]
        fp32 = opt.single_partition_of_fp32_groups[g]
        flats = {"fp32": _gather_flat(fp32)}
        for k, v in opt.optimizer.state[fp32].items():
            if isinstance(v, torch.Tensor) and v.shape == fp32.shape:
                flats[k] = _gather_flat(v)
        pos = 0
        for p in params:
            for k, flat in flats.items():
                full[f"optimizer/{k}/{names[id(p)]}"] = flat[pos:pos + p.numel()].reshape(p.shape).clone()
            pos += p.numel()
        for p in params:  # fp32 training: the master copy is the parameter
            assert torch.equal(full[f"optimizer/fp32/{names[id(p)]}"], p.detach())
    return {"leaves": captured, "full": full if dist.get_rank() == 0 else None}


MEGATRON = {"vocab": 30, "divisible_by": 8, "layers": 2, "hidden": 8, "heads": 2, "groups": 2, "ffn": 16}


def _megatron_setup() -> Any:
    """tests/megatron_model.py's trainer, at the smallest sizes that still have every kind of tensor."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests import megatron_cpu_shims
    from tests import megatron_model as mm

    megatron_cpu_shims.install()
    mm.VOCAB = MEGATRON["vocab"]  # the batches' token range
    mm.teardown()
    tp = 2
    ps.initialize_model_parallel(tp, 1)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=MEGATRON["layers"], hidden_size=MEGATRON["hidden"], num_attention_heads=MEGATRON["heads"],
        num_query_groups=MEGATRON["groups"], ffn_hidden_size=MEGATRON["ffn"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=False, add_bias_linear=False,
        normalization="RMSNorm", use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, batch_p2p_comm=False,
    )
    padded = -(-MEGATRON["vocab"] // (MEGATRON["divisible_by"] * tp)) * MEGATRON["divisible_by"] * tp
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=padded,
                     max_sequence_length=mm.SEQ, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    chunk = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=False,
                                                                          bucket_size=4096), model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01,
                                                       use_distributed_optimizer=False, clip_grad=1.0), [chunk])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=3,
                                        lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=20, wd_incr_style="constant")
    return mm.Trainer(mm.Layout(tp=tp, dist_opt=False, divisible_by=MEGATRON["divisible_by"]), [chunk], optimizer,
                      scheduler)


def job_megatron(path: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ckptkit.adapters import megatron as mckpt
    from tests import megatron_model as mm

    t = _megatron_setup()
    try:
        for _ in range(2):
            mm.train_step(t)
        captured: dict[str, Any] = {}
        with capture_save(captured):
            mckpt.save(t.model, path, optimizer=t.optimizer, scheduler=t.scheduler, iteration=t.iteration,
                       extra={"consumed_samples": 16, "note": "golden"},
                       options=mckpt.MegatronOptions(vocab_size=MEGATRON["vocab"],
                                                     make_vocab_size_divisible_by=MEGATRON["divisible_by"]))
        # this rank's own parameters and their Adam moments, by Megatron's parameter names
        inner = t.model[0].module
        states = {}
        opts = getattr(t.optimizer, "chained_optimizers", [t.optimizer])
        for o in opts:
            for group in o.optimizer.param_groups:
                for p in group["params"]:
                    states[id(p)] = o.optimizer.state[p]
        local: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in inner.named_parameters():
            local[name] = {"param": p.detach().clone(), **{k: v.detach().clone() for k, v in states[id(p)].items()
                                                             if isinstance(v, torch.Tensor) and v.shape == p.shape}}
        return {"leaves": captured, "local": local, "rank": dist.get_rank()}
    finally:
        mm.teardown()


def megatron_full(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Megatron's model space from the tp ranks' local tensors, by hand: layers stacked on a new axis
    0; column-parallel weights (QKV, the embedding and output layer: vocabulary-parallel) concatenated
    on dim 0, row-parallel ones (attention projection, fc2) on dim 1; SwiGLU fc1 as [gate; up] with
    each half gathered on its own; norms replicated, under the names Megatron's sharded state dict
    gives them (the layer norms folded into ``linear_qkv`` / ``linear_fc1``, TE style); the
    vocabulary's padding rows apart, as ``<key>.vocab_padding`` (MegatronOptions.vocab_size)."""
    tp = len(ranks)
    names = list(ranks[0]["local"])
    full: dict[str, torch.Tensor] = {}

    def gather(name: str, what: str) -> torch.Tensor:
        parts = [r["local"][name][what] for r in ranks]
        if "linear_fc1.weight" in name:
            halves = [p.chunk(2, dim=0) for p in parts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        if any(s in name for s in ("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            return torch.cat(parts, dim=0)
        if any(s in name for s in ("linear_proj.weight", "linear_fc2.weight")):
            return torch.cat(parts, dim=1)
        for p in parts[1:]:  # replicated over tp
            assert torch.equal(p, parts[0]), name
        return parts[0]

    for what, prefix in (("param", "model"), ("exp_avg", "optimizer/exp_avg"), ("exp_avg_sq", "optimizer/exp_avg_sq")):
        layered: dict[str, dict[int, torch.Tensor]] = {}
        for name in names:
            t = gather(name, what)
            if "word_embeddings" in name or "output_layer" in name:
                full[f"{prefix}/{name}.vocab_padding"] = t[MEGATRON["vocab"]:]
                t = t[:MEGATRON["vocab"]]
            name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
            name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
            bits = name.split(".")
            if bits[:2] == ["decoder", "layers"]:
                layered.setdefault(".".join(bits[:2] + bits[3:]), {})[int(bits[2])] = t
            else:
                full[f"{prefix}/{name}"] = t
        for key, by_layer in layered.items():
            full[f"{prefix}/{key}"] = torch.stack([by_layer[i] for i in range(len(by_layer))])
    assert tp == 2
    return full


# ---------------------------------------------------------------- the parent: write, check, keep

def expected_values(per_rank_leaves: list[dict[str, Any]], fmt: int) -> tuple[dict, dict]:
    """(values every reader sees, {rank: values that rank alone gets back}) as the format stores them:
    version 1 keeps rank 0's values; version 2 keeps a value its holders agree on once and one
    they disagree about per rank."""
    if fmt == 1:
        return dict(per_rank_leaves[0]["values"]), {}
    keys = {k for lv in per_rank_leaves for k in lv["values"]}
    agreed, split = {}, {}
    for k in sorted(keys):
        held = [(r, lv["values"][k]) for r, lv in enumerate(per_rank_leaves) if k in lv["values"]]
        if all(same(v, held[0][1]) for _, v in held):
            agreed[k] = held[0][1]
        else:
            for r, v in held:
                split.setdefault(r, {})[k] = v
    return agreed, split


def write_fixture(name: str, out: str, commit: str, worlds: Any) -> None:
    import ckptkit

    folder = os.path.join(out, name)
    if os.path.exists(folder):
        raise SystemExit(f"{folder} exists: never regenerate a released version's fixtures; add new ones")
    fmt = version()
    tmp = tempfile.mkdtemp(prefix=f"golden-{name}-")
    ckpt = os.path.join(tmp, "ckpt")
    world = WORLDS[name]
    if name == "dtensor_fsdp":
        results = worlds.run(world, job_dtensor, ckpt, "fsdp", "fp32")
    elif name == "dtensor_fsdp_tp":
        results = worlds.run(world, job_dtensor, ckpt, "fsdp_tp", "bf16")
    elif name == "flat":
        results = worlds.run(world, job_flat, ckpt)
    elif name == "deepspeed":
        results = worlds.run(world, job_deepspeed, ckpt)
    else:
        results = worlds.run(world, job_megatron, ckpt)
        results[0]["full"] = megatron_full(sorted(results, key=lambda r: r["rank"]))
    tensors: dict[str, torch.Tensor] = results[0]["full"]
    all_leaves = [r["leaves"] for r in results]
    agreed, split = expected_values(all_leaves, fmt)

    # the writing code reads its checkpoint back: the expected side and the checkpoint must agree
    view = ckptkit.open(ckpt)
    assert set(view.keys()) == set(tensors), sorted(set(view.keys()) ^ set(tensors))[:10]
    for k, t in tensors.items():
        got = view[k].read()
        assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape), (k, got.dtype, t.dtype, got.shape, t.shape)
        assert torch.equal(got.reshape(-1).view(torch.uint8) if got.numel() else got,
                           t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t), k
    assert set(view.values) == set(agreed), sorted(set(view.values) ^ set(agreed))
    for k, v in agreed.items():
        assert same(view.values[k], v), (k, view.values[k], v)
    verify = getattr(ckptkit, "verify", None) or __import__("ckptkit.catalog", fromlist=["verify"]).verify  # v1: catalog
    assert verify(ckpt).ok

    arrays: dict[str, np.ndarray] = {}
    doc: dict[str, Any] = {
        "fixture": name, "format_version": fmt, "written_by": commit, "world_size": world,
        "tensors": {}, "values": encode(agreed), "rank_values": {}, "per_rank": {},
    }
    for i, (k, t) in enumerate(sorted(tensors.items())):
        a = t.detach().contiguous()
        arrays[f"t{i:03d}"] = (a.view(torch.uint16) if a.dtype == torch.bfloat16 else a).numpy()
        doc["tensors"][k] = {"array": f"t{i:03d}", "dtype": str(a.dtype).removeprefix("torch."), "shape": list(a.shape)}
    for r, lv in enumerate(all_leaves):
        if r in split:
            doc["rank_values"][str(r)] = encode(split[r])
        mine: dict[str, Any] = {}
        for k, v in sorted(lv["per_rank"].items()):
            mine[k] = {"value": encode(v)}
        for k, raw in sorted(lv["generators"].items()):
            arrays[f"g{r}_{len(mine):02d}"] = np.frombuffer(raw, dtype=np.uint8).copy()
            mine[k] = {"generator": f"g{r}_{len(mine):02d}"}
        if mine:
            doc["per_rank"][str(r)] = mine
    if name in METADATA:  # save(metadata=) is kept, JSON-encoded, as the manifest's meta "user"
        from ckptkit.layout.values import decode_value

        assert same(decode_value(view.meta["user"], "metadata"), METADATA[name]), view.meta
    doc["metadata"] = encode(METADATA[name]) if name in METADATA else None
    os.makedirs(folder)
    shutil.copytree(ckpt, os.path.join(folder, "ckpt"))
    np.savez(os.path.join(folder, "expected.npz"), **arrays)
    with open(os.path.join(folder, "expected.json"), "w") as f:
        f.write(json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n")  # compact: RNG states are long
    shutil.rmtree(tmp)
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(folder) for n in ns)
    print(f"{folder}: {len(tensors)} tensors, {len(agreed)} values, {size} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the version's folder, e.g. tests/golden/v1")
    parser.add_argument("--commit", required=True, help="the commit whose code writes (recorded in expected.json)")
    parser.add_argument("--only", nargs="*", choices=FIXTURES, default=list(FIXTURES))
    args = parser.parse_args()
    import ckptkit

    print(f"ckptkit {ckptkit.__version__} from {os.path.dirname(ckptkit.__file__)}, format version {version()}")
    if os.path.realpath(os.path.dirname(HERE)) in os.path.realpath(ckptkit.__file__) and version() == 1:
        raise SystemExit("version 1 fixtures must be written by the old code: put its extract first on PYTHONPATH")
    from tests.worlds import Worlds

    worlds = Worlds()
    try:
        for name in args.only:
            write_fixture(name, args.out, args.commit, worlds)
            if name == "megatron":
                worlds.retire(WORLDS[name])  # the Megatron CPU shims stay installed in those processes
    finally:
        worlds.close()


if __name__ == "__main__":
    main()
