"""Run the large-layout simulations (tests/scale_sim.py) in a process of their own, and report in JSON.

    python -m tests.scale_layouts_job '[{"scenario": "megatron-dense", "dp": 4, "layers": 8}, ...]'

prints one JSON object per scenario on stdout. A process of its own because each scenario sets up
torch's fake process group (and Megatron's CPU shims point CUDA at the meta device) for the rest of
the process; tests/test_scale_layouts.py and benchmarks/bench_scale_layouts.py call it.

Scenarios (every one: save every rank, merge, check each tensor is covered exactly once and every
index agrees with the manifest, plan the load of chosen target ranks, plan a reshard):

* ``megatron-dense``: Llama-3-70B shapes at tp4·pp8·dp``dp``, distributed optimizer, bf16; load at
  tp8·pp4·dp``load_dp`` (default 8), reshard to tp2pp8;
* ``megatron-moe``: Mixtral-8x7B shapes at tp2·pp``pp``·ep8·etp1·dp``dp``; load at tp4·pp``pp/2``·ep4·etp1,
  reshard to tp2pp4ep4etp1;
* ``zero3``: Llama-3-70B (Hugging Face names) at ZeRO-3 over ``dp``; load at dp ``load_dp``, reshard to dp8;
* ``titan``: torchtitan's llama3 70B at FSDP ``dp`` x TP ``tp``; load at FSDP ``load_dp`` x TP ``load_tp``,
  reshard to tp4dp8;
* ``megatron-rules``: the partition rules a tp2 Megatron model records are the same whether Megatron
  initialised its weights or not (``perform_initialization=False`` skips the attributes they came from).

``layers``: the model object's layer count (fewer than the model's keeps a test fast; the rank count
and the tensors' shapes stay real). ``load``: ``"all"`` target ranks or a ``"sample"`` (Megatron: every
model-parallel position of data-parallel rank 0, and every data-parallel rank of the last position;
``"edges"``: the same on the first and last stage only; otherwise the first, second, middle and last rank).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from tests import scale_sim as sim


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def megatron_sample(tp: int, pp: int, dp: int, stages: list[int] | None = None) -> list[int]:
    """Every model-parallel position at DP rank 0 (of ``stages``: default all), and every DP rank of the
    last position (Megatron's tp-cp-ep-dp-pp rank order, cp = 1): each tensor's every model-parallel
    slice, and one slice's every distributed-optimizer shard."""
    first = [t + tp * dp * p for p in (range(pp) if stages is None else stages) for t in range(tp)]
    last = [(tp - 1) + tp * (d + dp * (pp - 1)) for d in range(dp)]
    return sorted(set(first + last))


def megatron_load_ranks(load: str | None, tp: int, pp: int, dp: int) -> list[int]:
    """``all``; ``edges``: the sample on the first and last stage only (they add the embedding and the
    output layer to the layers every stage has); else the sample on every stage."""
    if load == "all":
        return list(range(tp * pp * dp))
    return megatron_sample(tp, pp, dp, [0, pp - 1] if load == "edges" else None)


def _common(root: str, world: int, classify: Callable[[int], Any], explicit: bool) -> tuple[Any, dict[str, Any]]:
    """Save every rank, then the exactly-once and index checks; the manifest and what they measured.
    ``explicit``: the framework declares pieces only (no DTensors): one pass over the ranks suffices."""
    saver = sim.SaveSim(root, world)
    manifest, seconds = _timed(lambda: saver.run_classified(classify, keep=False, explicit_only=explicit))
    elements, check_seconds = _timed(lambda: sim.check_exactly_once(manifest))
    sim.check_indexes(manifest, saver.stats)
    return manifest, {"save": saver.stats.summary(), "save_wall_s": seconds, "elements_checked": elements,
                      "coverage_check_s": check_seconds, "elements_by_kind": elements_by_kind(manifest)}


def elements_by_kind(manifest: Any) -> dict[str, int]:
    """Model-space elements per kind of tensor: ``model``, and each optimizer state (``optimizer/exp_avg``;
    torchtitan's flattened ``optimizer/state.<fqn>.exp_avg`` by its last name). Every state of a parameter
    has the parameter's elements, so the kinds of a complete checkpoint agree."""
    out: dict[str, int] = {}
    for key, meta in manifest.tensors.items():
        root, _, rest = key.partition("/")
        if root == "optimizer":
            kind = "optimizer/" + (rest.rsplit(".", 1)[-1] if rest.startswith("state.") else rest.split("/")[0])
        else:
            kind = root
        out[kind] = out.get(kind, 0) + meta.numel
    return dict(sorted(out.items()))


def _classify(state_of: Callable[[int], dict[str, Any]]) -> Callable[[int], Any]:
    return lambda rank: sim.classified(state_of(rank), rank)


def _derived(derive: Callable[[int], Any]) -> Callable[[int], Any]:
    """A rank derived from another's classification; the derivation's CPU time stands for its classify."""
    def classify(rank: int) -> tuple[Any, float]:
        t0 = sim.clock()
        cls = derive(rank)
        return cls, sim.clock() - t0
    return classify


def _reshard(manifest: Any, target: str) -> dict[str, Any]:
    from ckptkit.layout.config import ParallelConfig

    _, stats = sim.simulate_reshard(manifest, ParallelConfig.parse(target))
    return stats.summary()


def megatron(spec: dict[str, Any], root: str) -> dict[str, Any]:
    from ckptkit.adapters import megatron as mckpt
    from tests import scale_megatron as sm

    moe = spec["scenario"] == "megatron-moe"
    dp, layers = spec["dp"], spec.get("layers")
    if moe:
        pp = spec.get("pp", 8)
        job = sm.MegatronJob(sm.MIXTRAL_8X7B, tp=2, pp=pp, dp=dp, ep=8, etp=1)
        target = sm.MegatronJob(sm.MIXTRAL_8X7B, tp=4, pp=pp // 2, dp=spec.get("load_dp", dp), ep=4, etp=1)
        reshard_to = "tp2pp4ep4etp1"
    else:
        job = sm.MegatronJob(sm.LLAMA3_70B, tp=4, pp=8, dp=dp)
        target = sm.MegatronJob(sm.LLAMA3_70B, tp=8, pp=4, dp=spec.get("load_dp", 8))
        reshard_to = "tp2pp8"
    if layers:
        job, target = job.with_layers(layers), target.with_layers(layers)
    manifest, out = _common(root, job.world, _classify(lambda r: sm.save_state(job, r)), explicit=True)
    meta, shapes = mckpt.read_meta(root)
    ranks = megatron_load_ranks(spec.get("load"), target.tp, target.pp, target.dp)
    load = sim.simulate_load(root, ((r, sm.load_state(target, r, meta, shapes)) for r in ranks))
    sm.leave()
    return {**out, "layout": job.layout, "model": job.shape.name, "model_layers": job.shape.layers,
            "load_layout": target.layout, "load": load.summary(), "reshard": _reshard(manifest, reshard_to)}


def zero3(spec: dict[str, Any], root: str) -> dict[str, Any]:
    from dataclasses import replace

    from tests import scale_zero3 as sz

    job = sz.Zero3Job(dp=spec["dp"])
    if spec.get("layers"):
        job = replace(job, layers=spec["layers"])
    manifest, out = _common(root, job.world, _classify(lambda r: sz.rank_state(job, r)), explicit=True)
    target = replace(job, dp=spec.get("load_dp", job.dp // 2))
    ranks = range(target.dp) if spec.get("load") == "all" else sorted({0, 1, target.dp // 2, target.dp - 1})
    load = sim.simulate_load(root, ((r, sz.rank_state(target, r)) for r in ranks))
    return {**out, "layout": job.layout, "model": "llama3-70b (hf names)", "model_layers": job.layers,
            "load_layout": target.layout, "load": load.summary(), "reshard": _reshard(manifest, "dp8")}


def titan(spec: dict[str, Any], root: str) -> dict[str, Any]:
    from tests import scale_titan as st

    job = st.TitanJob(dp=spec["dp"], tp=spec.get("tp", 8), layers=spec.get("layers"))
    base, build_seconds = _timed(lambda: st.classified(job, 0))
    checked = sorted(spec.get("check", [job.world - 1]))
    _, check_seconds = _timed(lambda: st.check_ranks(job, base, checked))
    manifest, out = _common(root, job.world, _derived(lambda r: st.at_rank(base, r)), explicit=False)
    load = {"scenario": "titan-load", "root": root, "dp": spec.get("load_dp", job.dp * 2),
            "tp": spec.get("load_tp", job.tp // 2), "layers": job.layers, "load": spec.get("load", "sample")}
    loaded = _in_own_process(load)  # a second torchtitan job cannot be built in this process (scale_titan)
    return {**out, "layout": job.layout, "model": f"torchtitan llama3 {job.flavor}", "model_layers": job.model_layers,
            "build_rank0_s": build_seconds, "ranks_built_and_compared": checked, "compare_s": check_seconds,
            "load_layout": loaded["layout"], "load": loaded["load"], "reshard": _reshard(manifest, "tp4dp8")}


def titan_load(spec: dict[str, Any], root: str) -> dict[str, Any]:
    """Plan the load of the checkpoint at ``spec["root"]`` by a torchtitan job at FSDP ``dp`` x TP ``tp``."""
    from tests import scale_titan as st

    target = st.TitanJob(dp=spec["dp"], tp=spec["tp"], layers=spec.get("layers"))
    base = st.classified(target, 0)
    every = spec.get("load") == "all"
    ranks = range(target.world) if every else sorted({0, 1, target.world // 2, target.world - 1})
    load = sim.simulate_load(spec["root"], ((r, lambda m, w, r=r: sim.grid_targets(st.at_rank(base, r), m, w))
                                            for r in ranks))
    return {"layout": target.layout, "load": load.summary()}


def _in_own_process(spec: dict[str, Any]) -> dict[str, Any]:
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "tests.scale_layouts_job", json.dumps([spec])],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{spec['scenario']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def titan_declare(spec: dict[str, Any], root: str) -> dict[str, Any]:
    """One torchtitan rank built for real: the digest of what it declares (for ``titan``'s check)."""
    from tests import scale_titan as st

    job = st.TitanJob(dp=spec["dp"], tp=spec["tp"], layers=spec.get("layers"))
    return {"digest": st.declarations_digest(st.classified(job, spec["rank"]))}


def megatron_rules(spec: dict[str, Any], root: str) -> dict[str, Any]:
    """The rules a tp2pp2 model records, with Megatron's initialisation and without it (rank 0 and 1)."""
    from tests import scale_megatron as sm

    job = sm.MegatronJob(sm.LLAMA3_70B, tp=2, pp=2, dp=1).with_layers(2)
    out = {}
    for rank in range(job.world):
        with_init = sm.rules_by_tensor(sm.save_state(job, rank, perform_initialization=True))
        without = sm.rules_by_tensor(sm.save_state(job, rank, perform_initialization=False))
        out[rank] = {"same": with_init == without, "tensors": len(with_init),
                     "differ": sorted(k for k in with_init if with_init[k] != without.get(k))[:5]}
    sm.leave()
    return {"ranks": out}


SCENARIOS = {"megatron-dense": megatron, "megatron-moe": megatron, "zero3": zero3, "titan": titan,
             "titan-declare": titan_declare, "titan-load": titan_load, "megatron-rules": megatron_rules}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    root = sim.scratch_dir(f"ckptkit-scale-{spec['scenario']}-")
    cpu = _cpu_seconds()
    try:
        result, seconds = _timed(lambda: SCENARIOS[spec["scenario"]](spec, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"spec": spec, "wall_s": seconds, "cpu_s": _cpu_seconds() - cpu, **result}


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the wall clock of a shared machine says less)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str]) -> int:
    for spec in json.loads(argv[0]):
        print(json.dumps(run(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
