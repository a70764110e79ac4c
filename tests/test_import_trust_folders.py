"""Hostile-folder kit for the importer trust suites (tests/test_import_trust*.py); holds no tests.

* small *valid* native folders built by hand, one per importer and layout, without DeepSpeed or
  Megatron installed or a process group: DeepSpeed ZeRO-2 / ZeRO-3 / MoE (expert files) / stage-0
  MoE (``expp_rank_*``), Megatron torch_dist and legacy (with a tracker), plain DCP. Each imports
  cleanly (the suites check that first), so a case that damages one file reaches that file;
* :class:`Payload`: a pickle whose ``__reduce__`` would create a marker file when unpickled by
  anything that runs code (``os.system`` or ``builtins.exec``);
* :class:`Reads`: an audit hook (``sys.addaudithook``, ``open`` / ``os.listdir`` / ``os.scandir``
  events on every thread) recording what was opened under a bait folder;
* :class:`Tally`: per importer, cases tried / clear errors / silent imports / tracebacks / reads
  outside / payloads run, filled by :func:`run_library` and :func:`run_cli`.
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import math
import os
import pickle
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from ckptkit.cli.main import cli
from ckptkit.errors import CkptkitError
from ckptkit_converters.deepspeed.flat_layout import flat_layouts

# ---------------------------------------------------------------- payloads


class Payload:
    """Unpickled by anything that runs code, this creates ``marker``; ckptkit must refuse it first."""

    def __init__(self, marker: str | os.PathLike[str], kind: str = "os.system") -> None:
        self.marker, self.kind = os.fspath(marker), kind

    def __reduce__(self):
        if self.kind == "os.system":
            return (os.system, (f"touch '{self.marker}'",))
        return (builtins.exec, (f"open({self.marker!r}, 'w').close()",))


def poison_pt(path: Path, marker: Path, kind: str = "os.system") -> None:
    """Rewrite the ``torch.save`` file ``path`` (our own: trusted here) with a payload deep inside it."""
    state = torch.load(path, weights_only=False)
    if isinstance(state, dict):
        state["__extra__"] = {"hooks": [1, {"run": Payload(marker, kind)}]}
    else:
        state = {"value": state, "__extra__": Payload(marker, kind)}
    torch.save(state, path)


def poison_metadata(folder: Path, marker: Path, kind: str = "os.system") -> None:
    """A DCP ``.metadata`` whose otherwise valid ``Metadata`` carries the payload in ``planner_data``."""
    md = pickle.loads((folder / ".metadata").read_bytes())  # our own file: trusted here
    md.planner_data = {**(md.planner_data or {}), "__extra__": Payload(marker, kind)}
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def poison_blob(folder: Path, marker: Path, fqn_prefix: str, kind: str = "os.system") -> str:
    """Append a ``torch.save`` archive of the payload to the data file holding the first item whose key
    starts with ``fqn_prefix`` and point that item at it; returns the data file's name."""
    md = pickle.loads((folder / ".metadata").read_bytes())
    index, info = next((i, v) for i, v in sorted(md.storage_data.items(), key=lambda kv: kv[0].fqn)
                       if i.fqn.startswith(fqn_prefix))
    buf = io.BytesIO()
    torch.save(Payload(marker, kind), buf)
    data = folder / info.relative_path
    size = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buf.getvalue())
    info.offset, info.length = size, len(buf.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    return info.relative_path


# ---------------------------------------------------------------- DeepSpeed folders

DS_DENSE = (("fc.weight", (4, 3)), ("fc.bias", (4,)))
DS_EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts"
DS_BUFFER = ("scale", (2,))


def _group(lr: float, **extra: Any) -> dict[str, Any]:
    return {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, **extra}


def _flat(members: Sequence[tuple[str, tuple[int, ...]]], stage: int, dp: int, rank: int, seed: int):
    """Each flat partition of ``members`` on ``rank``: (layout, values)."""
    out = []
    for lay in flat_layouts([list(members)], stage, dp):
        flat = torch.zeros(lay.cut.partition_numel)
        for f in lay.fragments(rank):
            full = torch.arange(math.prod(lay.shapes[f.param]), dtype=torch.float32) + seed
            flat[f.local_start:f.local_start + f.numel] = full[f.start:f.stop]
        out.append((lay, flat))
    return out


def deepspeed_folder(root: Path, *, stage: int = 2, dp: int = 2, moe: bool = False, tag: str = "global_step3",
                     config: dict[str, Any] | None = None, scheduler: Any = None,
                     group_extra: dict[str, Any] | None = None) -> Path:
    """A native ZeRO checkpoint ``root/latest`` + ``root/tag/`` (stage 1/2 or 3; ``moe``: one MoE layer of 2
    experts at EP 2, ZeRO 1/2 only). ``config`` / ``scheduler`` / ``group_extra`` go into ``ds_config``,
    ``lr_scheduler`` and the first param group (for the JSON-value cases)."""
    folder = root / tag
    folder.mkdir(parents=True)
    (root / "latest").write_text(tag)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [list(DS_DENSE)]
    pgs = [_group(0.1, **(group_extra or {}))]
    if moe:
        groups.append([(f"{DS_EXPERT}.0.w", (3, 2))])
        pgs.append(_group(0.1, moe=True, name="ep_size_2"))
    module = OrderedDict((n, torch.ones(s) if stage < 3 else torch.empty(0)) for n, s in DS_DENSE)
    module[DS_BUFFER[0]] = torch.full(DS_BUFFER[1], 2.0)
    common = {
        "buffer_names": [DS_BUFFER[0]], "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in g) for g in groups],
        "shared_params": {}, "lr_scheduler": scheduler if scheduler is not None else {"last_batch_iteration": 2},
        "global_steps": 3, "global_samples": 24, "skipped_steps": 0, "dp_world_size": dp, "mp_world_size": 1,
        "ds_config": config if config is not None else {"train_batch_size": 8, "zero_optimization": {"stage": stage}},
        "ds_version": "0.19.8", "epoch": 1,
    }
    if moe:
        common["num_experts"] = [2]
        for e in range(2):
            torch.save(OrderedDict([(f"{DS_EXPERT}.{e}.w", torch.full((3, 2), float(e)))]),
                       folder / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
    for r in range(dp):
        flats = []
        for g, members in enumerate(groups):
            gdp = dp // 2 if g == 1 else dp  # the expert group is cut over dp / ep ranks
            flats += _flat(members, stage, gdp, r // 2 if g == 1 else r, seed=r)
        state = {k: {"step": torch.tensor(3.0), "exp_avg": flat.clone(), "exp_avg_sq": flat.clone()}
                 for k, (_, flat) in enumerate(flats)}
        base = {"state": state, "param_groups": [{**pg, "params": [g]} for g, pg in enumerate(pgs)]}
        rec: dict[str, Any] = {"zero_stage": stage, "partition_count": [dp, dp // 2][:len(groups)]}
        if stage < 3:
            rec.update(base_optimizer_state=base, single_partition_of_fp32_groups=[f for _, f in flats])
        else:
            rec.update(optimizer_state_dict=base, fp32_flat_groups=[f for _, f in flats])
            torch.save({"module": module, **common}, folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": rec, "ds_version": "0.19.8"},
                   folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    if stage < 3:
        torch.save({"module": module, **common}, folder / "mp_rank_00_model_states.pt")
    return root


def expp_folder(root: Path, tag: str = "global_step3") -> Path:
    """A DeepSpeed-MoE checkpoint saved without ZeRO: ``expp_rank_{0,1}`` optimizer files (EP 2, one MoE
    layer of 2 experts), the model states and the per-expert files."""
    folder = root / tag
    folder.mkdir(parents=True)
    (root / "latest").write_text(tag)
    module = OrderedDict((n, torch.ones(s)) for n, s in DS_DENSE)
    module[DS_BUFFER[0]] = torch.full(DS_BUFFER[1], 2.0)
    torch.save({"module": module, "buffer_names": [DS_BUFFER[0]], "num_experts": [2], "shared_params": {},
                "lr_scheduler": None, "global_steps": 3, "global_samples": 24, "skipped_steps": 0,
                "dp_world_size": 2, "ds_config": {"train_batch_size": 8}, "ds_version": "0.19.8"},
               folder / "mp_rank_00_model_states.pt")
    for e in range(2):
        torch.save(OrderedDict([(f"{DS_EXPERT}.{e}.w", torch.full((3, 2), float(e)))]),
                   folder / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
    shapes = [s for _, s in DS_DENSE] + [(3, 2)]
    for r in range(2):
        state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(s), "exp_avg_sq": torch.zeros(s)}
                 for i, s in enumerate(shapes)}
        groups = [_group(0.1, params=[0, 1]), _group(0.1, params=[2], moe=True, name="ep_size_2")]
        torch.save({"optimizer": {"state": state, "param_groups": groups}},
                   folder / f"expp_rank_{r}_mp_rank_00_optim_states.pt")
    return root


# ---------------------------------------------------------------- Megatron and DCP folders

VOCAB = 16


def megatron_args(tp: int = 1, divisible_by: int = 16) -> argparse.Namespace:
    return argparse.Namespace(num_layers=2, hidden_size=8, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=1, make_vocab_size_divisible_by=divisible_by,
                              padded_vocab_size=VOCAB, vocab_size=VOCAB, untie_embeddings_and_output_weights=True,
                              world_size=tp, params_dtype=torch.float32)


def torch_dist_folder(folder: Path) -> Path:
    """A Megatron torch_dist directory: DCP data, ``metadata.json`` and ``common.pt`` recording the args."""
    g = torch.Generator().manual_seed(0)
    dcp.save({"embedding.word_embeddings.weight": torch.randn(VOCAB, 8, generator=g),
              "decoder.layers.self_attention.linear_qkv.weight": torch.randn(2, 24, 8, generator=g),
              "output_layer.weight": torch.randn(VOCAB, 8, generator=g)}, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"iteration": 2, "checkpoint_version": 3.0, "args": megatron_args()}, folder / "common.pt")
    return folder


def legacy_folder(root: Path, iteration: int = 2) -> Path:
    """A legacy Megatron save root (tracker + ``iter_XXXXXXX/mp_rank_0{0,1}/model_optim_rng.pt``, TP 2)."""
    g = torch.Generator().manual_seed(1)
    root.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    for t in range(2):
        rank = root / f"iter_{iteration:07d}" / f"mp_rank_{t:02d}"
        rank.mkdir(parents=True)
        model = {"embedding.word_embeddings.weight": torch.randn(VOCAB // 2, 8, generator=g),
                 "output_layer.weight": torch.randn(VOCAB // 2, 8, generator=g)}
        for layer in range(2):
            model[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"] = torch.randn(12, 8, generator=g)
        torch.save({"args": megatron_args(tp=2, divisible_by=8), "iteration": iteration, "checkpoint_version": 3.0,
                    "model": model}, rank / "model_optim_rng.pt")
    return root


def dcp_folder(folder: Path) -> Path:
    """A plain DCP checkpoint with a tensor and a non-tensor item."""
    dcp.save({"model": {"w": torch.arange(12.0).reshape(4, 3)}, "train": {"step": 3}},
             checkpoint_id=str(folder), no_dist=True)
    return folder


# ---------------------------------------------------------------- reads outside, and the tally


class Reads:
    """Files opened and folders listed under ``bait`` while recording (every thread: an audit hook)."""

    _installed = False
    _active: list[Reads] = []
    _lock = threading.Lock()

    def __init__(self, bait: Path) -> None:
        self.bait = os.path.realpath(bait)
        self.hits: list[tuple[str, str]] = []
        if not Reads._installed:
            sys.addaudithook(Reads._hook)  # cannot be removed: one hook, idle unless a Reads is active
            Reads._installed = True

    @staticmethod
    def _hook(event: str, args: tuple[Any, ...]) -> None:
        if not Reads._active or event not in ("open", "os.listdir", "os.scandir") or not args:
            return
        path = args[0]
        if not isinstance(path, (str, bytes, os.PathLike)):
            return
        real = os.path.realpath(os.fsdecode(path))
        for r in list(Reads._active):
            if real == r.bait or real.startswith(r.bait + os.sep):
                r.hits.append((event, real))

    def __enter__(self) -> Reads:
        with Reads._lock:
            Reads._active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with Reads._lock:
            Reads._active.remove(self)


@dataclass
class Tally:
    """Per importer: cases tried / clear errors / silent imports / tracebacks / reads outside / payloads run
    (and errors that were not one line naming what was expected: ``unclear``)."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)

    KINDS = ("tried", "clear", "silent", "traceback", "outside", "ran", "unclear")

    def add(self, importer: str, kind: str, note: str = "") -> None:
        row = self.counts.setdefault(importer, dict.fromkeys(self.KINDS, 0))
        row[kind] += 1
        if kind not in ("tried", "clear"):
            self.bad.append(f"{importer}: {kind}: {note}")

    def report(self, title: str) -> str:
        lines = [f"{title}: importer: tried / clear errors / silent imports / tracebacks / reads outside / "
                 "payloads run (unclear)"]
        for name, c in sorted(self.counts.items()):
            lines.append(f"  {name}: {c['tried']} / {c['clear']} / {c['silent']} / {c['traceback']} / "
                         f"{c['outside']} / {c['ran']} ({c['unclear']})")
        return "\n".join(lines)

    def assert_clean(self) -> None:
        assert not self.bad, "\n".join(self.bad[:20])


def _after(tally: Tally, importer: str, what: str, dest: Path, marker: Path | None, reads: Reads | None) -> None:
    if (dest / "manifest.json").exists():
        tally.add(importer, "silent", f"{what}: something was committed at {dest}")
    if marker is not None and marker.exists():
        tally.add(importer, "ran", f"{what}: the payload ran")
        marker.unlink()
    if reads is not None and reads.hits:
        tally.add(importer, "outside", f"{what}: read {reads.hits[:3]}")
        reads.hits.clear()


def run_library(tally: Tally, importer: str, what: str, call: Callable[[], Any], expect: Sequence[str], dest: Path,
                marker: Path | None = None, reads: Reads | None = None) -> str | None:
    """Run one library case: a clear error is a CkptkitError on one line naming one of ``expect``."""
    tally.add(importer, "tried")
    message = None
    try:
        call()
        tally.add(importer, "silent", f"{what}: no error")
    except CkptkitError as exc:
        message = str(exc)
        if "\n" in message or not any(e in message for e in expect):
            tally.add(importer, "unclear", f"{what}: {message[:300]!r} names none of {list(expect)}")
        else:
            tally.add(importer, "clear")
    except Exception as exc:  # noqa: BLE001 - what the suite counts
        tally.add(importer, "traceback", f"{what}: {type(exc).__name__}: {exc}")
    _after(tally, importer, what, dest, marker, reads)
    return message


def run_cli(tally: Tally, importer: str, what: str, args: Sequence[str], expect: Sequence[str], dest: Path,
            marker: Path | None = None, reads: Reads | None = None) -> str:
    """Run one CLI case in process: a clear error is exit code 2 with one ``error:`` line naming ``expect``."""
    tally.add(importer, "tried")
    res = CliRunner().invoke(cli, list(args))
    err = res.stderr.strip()
    if res.exit_code == 0:
        tally.add(importer, "silent", f"{what}: exit 0")
    elif res.exit_code != 2 or res.exception is not None and not isinstance(res.exception, SystemExit):
        tally.add(importer, "traceback", f"{what}: exit {res.exit_code}: {err[:300]} {res.exception!r}")
    elif len(err.splitlines()) != 1 or not err.startswith("error:") or not any(e in err for e in expect):
        tally.add(importer, "unclear", f"{what}: {err[:300]!r} names none of {list(expect)}")
    else:
        tally.add(importer, "clear")
    _after(tally, importer, what, dest, marker, reads)
    return err
