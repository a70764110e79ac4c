"""One small sample per registered checkpoint format, for tests/test_format_conformance.py.

The conformance suite runs the same checks against every format the registry lists, the way
zarr-python runs one store test suite against every store. What differs per format lives here,
as data: the ckptkit checkpoint the format can hold, the options each direction needs, which
tensors and values a round trip keeps (HF keeps the model's weights only; Megatron the model's
weights without the saving job's vocabulary padding rows), and how to remove or add one tensor
*through the format's own files* (a pickled DCP ``.metadata``, a DeepSpeed model-states file, a
zarr array node, a safetensors file and its index).

Samples are cheap on purpose: one process, no training. Megatron and DeepSpeed exports need a
checkpoint written by ckptkit's own adapters (their ``megatron/meta`` / ``deepspeed_engine``
records), so theirs are copies of the golden fixtures (tests/golden/v2, written by the adapters
in real worlds; never edited: copied); the others are written here by ``ckptkit.save`` with
``Sharded`` pieces (a ZeRO-style flat buffer, a fused box with a ``PartitionRule``), every common
dtype, a 0-d tensor and plain values.

Where a format's own tools accept a checkpoint with a tensor removed or added, the sample says
so with the reason (``missing_accepted`` / ``extra_accepted``), and the suite then checks that
the import holds exactly what the folder holds; otherwise the import must refuse, naming it.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ckptkit
from ckptkit.layout.config import ParallelConfig

GOLDEN = Path(__file__).parent / "golden" / "v2"
EXTRA_NAME = "conformance_extra"
"""The name part of the tensor a mutation adds: no format's own tables know it."""


@dataclass(frozen=True)
class Change:
    """What a mutation did: the tensor as the format names it (what an error must name), the ckptkit
    key it imports as where the format accepts the change, and, for an added tensor, the ckptkit key
    of the tensor whose bytes it holds (so an import of it is checked by value)."""

    format_name: str
    ckptkit_key: str
    copies: str | None = None


Mutation = Callable[[Path], Change]
"""Edit an exported folder in place through the format's own files; say what changed."""


def _nothing_to_add(folder: Path) -> None:
    """Most exports are complete folders: nothing is left to the user."""


@dataclass(frozen=True)
class Sample:
    """A format's sample: a ckptkit checkpoint at ``source`` and what the suite needs to know.

    * ``export_options`` / ``import_options``: what each direction takes for this sample (None:
      the format's defaults); ``refused_export``: options the format's ``check_export`` refuses
      (None where every options instance can export);
    * ``kept``: the tensor keys a round trip keeps, each with the same dtype, shape and bytes;
      ``kept_values``: the value keys it keeps equal;
    * ``finish_export``: what a user adds to an exported folder before importing it (HF: its
      ``config.json``, which the export does not write by design: docs/converters.md);
    * ``drop_tensor`` / ``add_tensor``: the mutations; ``missing_accepted`` / ``extra_accepted``:
      why the format's own tools accept that change ("" : they do not, so the import must refuse);
      ``extra_imported``: whether an accepted extra tensor is imported (DCP: any listed tensor is
      one) or left out (zarr: the group's ckptkit table, not its members, lists the checkpoint);
    * ``unchecked_data``: why a flipped byte inside tensor data may import as another value ("":
      the format's files carry checksums, so a flip must be refused or be harmless).
    """

    source: Path
    export_options: Any
    import_options: Any
    refused_export: Any
    kept: frozenset[str]
    kept_values: frozenset[str]
    drop_tensor: Mutation
    add_tensor: Mutation
    missing_accepted: str = ""
    extra_accepted: str = ""
    extra_imported: bool = True
    unchecked_data: str = ""
    finish_export: Callable[[Path], None] = _nothing_to_add


# ---------------------------------------------------------------- DCP's pickled .metadata (DCP and Megatron)


def _edit_dcp_metadata(folder: Path, edit: Callable[[Any], None]) -> None:
    """Rewrite ``.metadata`` as DCP's ``FileSystemWriter`` writes it (a pickled ``Metadata``), after ``edit``.

    Read through DCP's own reader: this is the test's own export, and DCP is the format's tool."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    edit(metadata)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _dcp_drop(fqn: str, ckptkit_key: str) -> Mutation:
    """Remove tensor ``fqn`` from the DCP metadata: its entry, its chunks' storage and its path."""

    def mutate(folder: Path) -> Change:
        def edit(md: Any) -> None:
            del md.state_dict_metadata[fqn]
            for index in [i for i in md.storage_data if i.fqn == fqn]:
                del md.storage_data[index]
            if isinstance(md.planner_data, dict):
                md.planner_data.pop(fqn, None)

        _edit_dcp_metadata(folder, edit)
        return Change(fqn, ckptkit_key)

    return mutate


def _dcp_add(copy_of: str, fqn: str, path: tuple[str, ...], ckptkit_key: str, copies: str) -> Mutation:
    """Add tensor ``fqn`` to the DCP metadata: ``copy_of``'s entry and chunks under a new name, so its
    bytes are real bytes of the folder (only the name is new)."""

    def mutate(folder: Path) -> Change:
        def edit(md: Any) -> None:
            md.state_dict_metadata[fqn] = md.state_dict_metadata[copy_of]
            for index, info in list(md.storage_data.items()):
                if index.fqn == copy_of:
                    md.storage_data[dataclasses.replace(index, fqn=fqn)] = info
            if isinstance(md.planner_data, dict):
                md.planner_data[fqn] = path

        _edit_dcp_metadata(folder, edit)
        return Change(fqn, ckptkit_key, copies)

    return mutate


# ---------------------------------------------------------------- the generic sample (DCP, zarr)


def write_generic(path: Path) -> None:
    """A checkpoint of ckptkit's own kinds of state in one process: a ZeRO-style flat buffer holding
    two parameters and padding, a fused ``[gate; up]`` tensor with its ``PartitionRule``, bf16,
    fp16, int64 (values past 2**53), a 0-d float64, and plain values."""
    g = torch.Generator().manual_seed(25)
    a, c = torch.randn(3, 4, generator=g), torch.randn(6, generator=g)
    flat = torch.cat([a.reshape(-1), c, torch.zeros(2)])
    glu = torch.randn(4, 3, generator=g)
    state = {
        "model": {
            "flat": ckptkit.Sharded(flat, [
                ckptkit.flat_piece("model/a", (3, 4), ckptkit.Box.full((3, 4)), 0, 12),
                ckptkit.flat_piece("model/c", (6,), ckptkit.Box.full((6,)), 0, 6, local_start=12)]),
            "glu": ckptkit.Sharded(glu, [ckptkit.box_piece("model/glu", (4, 3), (0, 0), (4, 3))],
                                   rule=ckptkit.PartitionRule(tp_axis=0, fused=(2, 2))),
            "half": torch.randn(5, 2, generator=g).to(torch.bfloat16),
            "table": torch.randn(2, 3, generator=g).to(torch.float16),
            "ids": torch.randint(-10 ** 12, 10 ** 12, (4,), generator=g),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
        },
        "train": {"step": 3, "note": "conformance", "lrs": [0.1, 0.2]},
    }
    ckptkit.save(state, str(path))


GENERIC_TENSORS = frozenset({"model/a", "model/c", "model/glu", "model/half", "model/table", "model/ids",
                             "model/scalar"})
GENERIC_VALUES = frozenset({"train/step", "train/note", "train/lrs"})
DCP_MISSING = ("a DCP checkpoint is whatever its .metadata lists, with no fixed names: dcp.load itself loads "
               "one without a tensor into any state dict that does not ask for it")
DCP_EXTRA = ("a DCP checkpoint is whatever its .metadata lists, with no fixed names: every listed tensor is one "
             "(dcp.load reads it for a state dict that asks for it), so the import takes it too")
NO_CHECKSUM = ("{} stores tensor bytes without a checksum: a flipped data byte is another value to the "
               "format's own tools too")


def dcp_sample(root: Path) -> Sample:
    from ckptkit_converters.dcp.options import DcpExportOptions

    write_generic(root / "ckpt")
    return Sample(
        source=root / "ckpt", export_options=DcpExportOptions(threads=1), import_options=None, refused_export=None,
        kept=GENERIC_TENSORS, kept_values=GENERIC_VALUES,
        drop_tensor=_dcp_drop("model.ids", "model/ids"),
        add_tensor=_dcp_add("model.c", f"model.{EXTRA_NAME}", ("model", EXTRA_NAME), f"model/{EXTRA_NAME}", "model/c"),
        missing_accepted=DCP_MISSING, extra_accepted=DCP_EXTRA,
        unchecked_data=NO_CHECKSUM.format("DCP's .distcp"))


# ---------------------------------------------------------------- zarr


def _zarr_node(folder: Path, key: str) -> Path:
    """The array node of ckptkit key ``key``, as the group's own ``ckptkit`` attributes place it."""
    doc = json.loads((folder / "zarr.json").read_text())
    return folder / doc["attributes"]["ckptkit"]["arrays"][key]["path"]


def _zarr_drop(folder: Path) -> Change:
    """Delete one array node; the group's ``ckptkit`` table still lists it."""
    node = _zarr_node(folder, "model/ids")
    shutil.rmtree(node)
    return Change(str(node.relative_to(folder)), "model/ids")


def _zarr_add(folder: Path) -> Change:
    """Add an array node the group's ``ckptkit`` table does not list (a copy of another array)."""
    node = _zarr_node(folder, "model/c")
    shutil.copytree(node, node.parent / EXTRA_NAME)
    return Change(f"{node.parent.relative_to(folder)}/{EXTRA_NAME}", f"model/{EXTRA_NAME}", "model/c")


def zarr_sample(root: Path) -> Sample:
    from ckptkit_converters.zarr.options import ZarrExportOptions

    write_generic(root / "ckpt")
    return Sample(
        source=root / "ckpt", export_options=ZarrExportOptions(chunk_bytes=64, shard_bytes=128, threads=1),
        import_options=None, refused_export=None, kept=GENERIC_TENSORS, kept_values=GENERIC_VALUES,
        drop_tensor=_zarr_drop, add_tensor=_zarr_add,
        extra_accepted=("the group's ckptkit attributes are the checkpoint's list of tensors; another array in "
                        "the group (a user's own addition) is not part of the checkpoint, as zarr readers "
                        "open arrays by path and never require every member"),
        extra_imported=False)


# ---------------------------------------------------------------- Megatron (torch_dist)


MEGATRON_VOCAB = 30  # the golden fixture's true vocabulary (padded to 32 by its multiple of 8)


def megatron_sample(root: Path) -> Sample:
    """The golden Megatron adapter checkpoint (tp2, vocab 30 padded to 32, Adam state), exported
    ``weights_only``: the torch_dist directory holds the model's weights, its padding rows the saving
    job's ``.vocab_padding`` rows (the padding is 32 at tp1 too), and the import keeps them apart again:
    every model tensor comes back. (With the optimizer, the default, the golden fp32 run's export also
    holds the main copies Megatron needs, which are its weights, so its import holds more than the source:
    that round trip is checked in tests/test_megatron_optimizer_export.py.) The export writes ``common.pt``
    without Megatron-LM ``args``, so the import is told the vocabulary (as a user would be)."""
    from ckptkit_converters.megatron.options import MegatronExportOptions, MegatronImportOptions

    shutil.copytree(GOLDEN / "megatron" / "ckpt", root / "ckpt")
    keys = ckptkit.open(root / "ckpt").keys()
    kept = frozenset(k for k in keys if k.startswith("model/"))
    assert any(k.endswith(".vocab_padding") for k in kept)
    return Sample(
        source=root / "ckpt", export_options=MegatronExportOptions(layout=ParallelConfig.parse("tp1pp1"),
                                                                   weights_only=True),
        import_options=MegatronImportOptions(vocab_size=MEGATRON_VOCAB, make_vocab_size_divisible_by=8, threads=1),
        refused_export=MegatronExportOptions(), kept=kept, kept_values=frozenset(),
        drop_tensor=_dcp_drop("decoder.final_layernorm.weight", "model/decoder.final_layernorm.weight"),
        add_tensor=_dcp_add("decoder.final_layernorm.weight", f"decoder.layers.{EXTRA_NAME}.weight",
                            ("decoder", "layers", f"{EXTRA_NAME}.weight"), f"model/decoder.layers.{EXTRA_NAME}.weight",
                            "model/decoder.final_layernorm.weight"),
        missing_accepted=("a torch_dist directory lists its own tensors and the import has no model to ask for "
                          "others: Megatron's dist_checkpointing.load finds a missing tensor only when a model's "
                          "sharded_state_dict requests it"),
        unchecked_data=NO_CHECKSUM.format("torch_dist's .distcp (DCP)"))


# ---------------------------------------------------------------- DeepSpeed


def _model_states(folder: Path) -> Path:
    tag = (folder / "latest").read_text().strip()
    return folder / tag / "mp_rank_00_model_states.pt"


def _edit_module(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite the ZeRO-1/2 model-states file with its ``module`` state dict edited. Loaded with
    ``weights_only=True`` (torch's own restricted unpickler): the file holds no DeepSpeed classes."""
    path = _model_states(folder)
    data = torch.load(path, weights_only=True)
    edit(data["module"])
    torch.save(data, path)


def _deepspeed_drop(folder: Path) -> Change:
    """Remove one parameter's weights from ``module``; ``param_shapes`` still lists it."""
    _edit_module(folder, lambda module: module.pop("out.bias"))
    return Change("out.bias", "model/out.bias")


def _deepspeed_add(folder: Path) -> Change:
    """Add a weight to ``module`` that neither ``param_shapes`` nor ``buffer_names`` know."""

    def edit(module: dict[str, torch.Tensor]) -> None:
        module[f"{EXTRA_NAME}.weight"] = module["out.bias"].clone()

    _edit_module(folder, edit)
    return Change(f"{EXTRA_NAME}.weight", f"model/{EXTRA_NAME}.weight", "model/out.bias")


def deepspeed_sample(root: Path) -> Sample:
    """The golden DeepSpeed adapter checkpoint (ZeRO-2, fp32, DP 2): a native folder at DP 2 holds the
    model, the fp32 masters and Adam's moments, so every tensor comes back."""
    from ckptkit_converters.deepspeed.options import DeepSpeedExportOptions, DeepSpeedImportOptions

    shutil.copytree(GOLDEN / "deepspeed" / "ckpt", root / "ckpt")
    return Sample(
        source=root / "ckpt", export_options=DeepSpeedExportOptions(dp=2), import_options=DeepSpeedImportOptions(),
        refused_export=DeepSpeedExportOptions(), kept=frozenset(ckptkit.open(root / "ckpt").keys()),
        kept_values=frozenset(), drop_tensor=_deepspeed_drop, add_tensor=_deepspeed_add,
        unchecked_data=("DeepSpeed's .pt files are torch.save zip archives, and torch.load does not verify their "
                        "CRC-32s: a flipped data byte loads as another value in DeepSpeed's own load_checkpoint too"))


# ---------------------------------------------------------------- Hugging Face


HF_CONFIG = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 12, "num_attention_heads": 2,
             "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 16, "tie_word_embeddings": False}


def write_llama(path: Path) -> None:
    """A 2-layer torchtitan Llama (GQA: 2 query heads, 1 key/value head) in bf16 under ``model/``, with
    optimizer state and a step beside it (an HF folder holds the model's weights only)."""
    g = torch.Generator().manual_seed(25)
    d, f, v, head = HF_CONFIG["hidden_size"], HF_CONFIG["intermediate_size"], HF_CONFIG["vocab_size"], 4

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    model = {"tok_embeddings.weight": r(v, d), "norm.weight": r(d), "lm_head.weight": r(v, d)}
    for layer in range(HF_CONFIG["num_hidden_layers"]):
        p = f"layers.{layer}."
        model.update({
            p + "attention.qkv_linear.wq.weight": r(2 * head, d), p + "attention.qkv_linear.wk.weight": r(head, d),
            p + "attention.qkv_linear.wv.weight": r(head, d), p + "attention.wo.weight": r(d, 2 * head),
            p + "attention_norm.weight": r(d), p + "ffn_norm.weight": r(d),
            p + "feed_forward.w1.weight": r(f, d), p + "feed_forward.w3.weight": r(f, d),
            p + "feed_forward.w2.weight": r(d, f)})
    ckptkit.save({"model": model, "optimizer": {"exp_avg": {"norm.weight": r(d)}}, "train": {"step": 7}}, str(path))


def _edit_safetensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite ``model.safetensors`` and the index's ``weight_map`` together, so the folder stays
    consistent and only the set of tensors changed."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {name: "model.safetensors" for name in sorted(tensors)}
    index_path.write_text(json.dumps(index))


def _hf_drop(folder: Path) -> Change:
    _edit_safetensors(folder, lambda t: t.pop("model.norm.weight"))
    return Change("model.norm.weight", "model/norm.weight")


def _hf_add(folder: Path) -> Change:
    name = f"model.layers.0.mlp.{EXTRA_NAME}.weight"

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors["model.norm.weight"].clone()

    _edit_safetensors(folder, edit)
    return Change(name, f"model/layers.0.mlp.{EXTRA_NAME}.weight", "model/norm.weight")


def hf_sample(root: Path) -> Sample:
    from ckptkit_converters.hf.options import HFExportOptions

    write_llama(root / "ckpt")
    config = root / "config.json"
    config.write_text(json.dumps(HF_CONFIG))

    def add_config(folder: Path) -> None:
        shutil.copyfile(config, folder / "config.json")

    return Sample(
        source=root / "ckpt", export_options=HFExportOptions(config=str(config)), import_options=None,
        refused_export=HFExportOptions(), kept=frozenset(f"model/{k}" for k in _llama_names()),
        kept_values=frozenset(), drop_tensor=_hf_drop, add_tensor=_hf_add,
        unchecked_data=NO_CHECKSUM.format("safetensors"), finish_export=add_config)


def _llama_names() -> list[str]:
    names = ["tok_embeddings.weight", "norm.weight", "lm_head.weight"]
    for layer in range(HF_CONFIG["num_hidden_layers"]):
        names += [f"layers.{layer}.{n}" for n in (
            "attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight", "attention.qkv_linear.wv.weight",
            "attention.wo.weight", "attention_norm.weight", "ffn_norm.weight", "feed_forward.w1.weight",
            "feed_forward.w3.weight", "feed_forward.w2.weight")]
    return names


SAMPLES: Mapping[str, Callable[[Path], Sample]] = {
    "megatron": megatron_sample,
    "deepspeed": deepspeed_sample,
    "dcp": dcp_sample,
    "zarr": zarr_sample,
    "hf": hf_sample,
}
"""Format name -> a factory writing the format's sample under a fresh folder. A newly registered
format must add one: the suite fails for a format it has no sample of."""
