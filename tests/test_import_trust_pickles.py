"""A code-running pickle in every pickle an importer opens is refused before it runs, through
``convert`` and ``reshard``, library and CLI.

For each importer and layout, starting from a folder that imports cleanly (checked first), one
file at a time is rewritten with a payload whose ``__reduce__`` would create a marker file
(``os.system`` or ``builtins.exec``), placed deep inside otherwise valid content:

* DeepSpeed ZeRO-2 and ZeRO-3: ``mp_rank_00_model_states.pt`` / ``zero_pp_rank_0_mp_rank_00_model_states.pt``
  and every ``*_optim_states.pt``; DeepSpeed-MoE: every ``layer_*_expert_*`` file; stage-0 MoE: every
  ``expp_rank_*`` file, the model states and the expert files;
* Megatron torch_dist: ``.metadata``, ``common.pt`` and a tensor blob of a ``.distcp``; legacy: every
  ``model_optim_rng.pt``;
* DCP: ``.metadata`` (a payload as the whole pickle, and one nested in a valid ``Metadata``), a tensor
  blob and a non-tensor item's blob.

Every case: a one-line :class:`UnsafeCheckpointError` naming the file and the refused global, the
marker absent, nothing committed at the destination. Figures printed (``-s``) and asserted.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import ckptkit
from ckptkit.layout.config import ParallelConfig
from ckptkit_converters.registry import convert
from tests.test_import_trust_folders import (
    Payload,
    Tally,
    dcp_folder,
    deepspeed_folder,
    expp_folder,
    legacy_folder,
    poison_blob,
    poison_metadata,
    poison_pt,
    run_cli,
    run_library,
    torch_dist_folder,
)

TAG = "global_step3"
TP1 = ParallelConfig.parse("tp1pp1")
TALLY = Tally()
KINDS = ("os.system", "builtins.exec")
REFUSED = {"os.system": "system", "builtins.exec": "builtins.exec"}


def _mkdir_then(build: Callable[[Path], Path]) -> Callable[[Path], Path]:
    def make(path: Path) -> Path:
        path.mkdir(parents=True)
        return build(path)
    return make


BUILDERS: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "zero2": ("deepspeed", lambda p: deepspeed_folder(p)),
    "zero3": ("deepspeed", lambda p: deepspeed_folder(p, stage=3)),
    "moe": ("deepspeed", lambda p: deepspeed_folder(p, moe=True)),
    "expp": ("deepspeed", expp_folder),
    "torch_dist": ("megatron", _mkdir_then(torch_dist_folder)),
    "legacy": ("megatron", legacy_folder),
    "dcp": ("dcp", _mkdir_then(dcp_folder)),
}

# (layout, file relative to the source, how it is poisoned): every pickle the importer opens
PT = "pt"
FILES: list[tuple[str, str, str]] = [
    ("zero2", f"{TAG}/mp_rank_00_model_states.pt", PT),
    ("zero2", f"{TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt", PT),
    ("zero2", f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt", PT),
    ("zero3", f"{TAG}/zero_pp_rank_0_mp_rank_00_model_states.pt", PT),
    ("zero3", f"{TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt", PT),
    ("zero3", f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt", PT),
    ("moe", f"{TAG}/layer_0_expert_0_mp_rank_00_model_states.pt", PT),
    ("moe", f"{TAG}/layer_0_expert_1_mp_rank_00_model_states.pt", PT),
    ("moe", f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt", PT),
    ("expp", f"{TAG}/mp_rank_00_model_states.pt", PT),
    ("expp", f"{TAG}/expp_rank_0_mp_rank_00_optim_states.pt", PT),
    ("expp", f"{TAG}/expp_rank_1_mp_rank_00_optim_states.pt", PT),
    ("expp", f"{TAG}/layer_0_expert_0_mp_rank_00_model_states.pt", PT),
    ("expp", f"{TAG}/layer_0_expert_1_mp_rank_00_model_states.pt", PT),
    ("torch_dist", ".metadata", "metadata"),
    ("torch_dist", ".metadata", "whole"),
    ("torch_dist", "common.pt", PT),
    ("torch_dist", "__0_0.distcp", "blob:decoder."),
    ("legacy", "iter_0000002/mp_rank_00/model_optim_rng.pt", PT),
    ("legacy", "iter_0000002/mp_rank_01/model_optim_rng.pt", PT),
    ("dcp", ".metadata", "metadata"),
    ("dcp", ".metadata", "whole"),
    ("dcp", "__0_0.distcp", "blob:model."),
    ("dcp", "__0_0.distcp", "blob:train."),
]


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("clean")
    out = {name: build(base / name) for name, (_, build) in BUILDERS.items()}
    for name, src in out.items():  # every template imports cleanly: a refusal below is the payload's
        convert(src, base / f"{name}-imported")
        assert (base / f"{name}-imported" / "manifest.json").exists()
    return out


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield
    print("\n" + TALLY.report("test_import_trust_pickles"))
    TALLY.assert_clean()


def _poison(src: Path, rel: str, how: str, marker: Path, kind: str) -> None:
    if how == PT:
        poison_pt(src / rel, marker, kind)
    elif how == "metadata":
        poison_metadata(src, marker, kind)
    elif how == "whole":
        (src / rel).write_bytes(pickle.dumps(Payload(marker, kind)))
    else:
        assert poison_blob(src, marker, how.split(":", 1)[1], kind) == rel


@pytest.mark.parametrize("layout,rel,how", FILES, ids=[f"{a}:{b}:{c}" for a, b, c in FILES])
def test_payload_in_every_pickle_is_refused_before_it_runs(tmp_path, templates, layout, rel, how):
    importer = BUILDERS[layout][0]
    name = Path(rel).name
    for kind in KINDS:
        src, out, marker = tmp_path / kind / "src", tmp_path / kind / "out", tmp_path / kind / "pwned"
        shutil.copytree(templates[layout], src)
        _poison(src, rel, how, marker, kind)
        messages = [
            run_library(TALLY, importer, f"{layout} {rel} {kind} convert", lambda: convert(src, out), [name], out, marker),
            run_library(TALLY, importer, f"{layout} {rel} {kind} reshard", lambda: ckptkit.reshard(src, out, TP1),
                        [name], out, marker),
            run_cli(TALLY, importer, f"{layout} {rel} {kind} cli convert", ["convert", str(src), str(out)], [name],
                    out, marker),
            run_cli(TALLY, importer, f"{layout} {rel} {kind} cli reshard",
                    ["reshard", str(src), str(out), "--to", "tp1pp1"], [name], out, marker),
        ]
        for message in messages:  # what was refused is named too, and that nothing ran
            assert message and REFUSED[kind] in message and "refus" in message, message
        assert not marker.exists() and not (out / "manifest.json").exists()


def test_a_pickle_that_only_names_a_global_is_refused_too(tmp_path, templates):
    """Refused at the name: a global that is never called (a bare reference to ``os.system``) fails too."""
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(templates["zero2"], src)
    path = src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    import torch

    state = torch.load(path, weights_only=False)
    state["ref"] = os.system  # pickled as a GLOBAL only
    torch.save(state, path)
    message = run_library(TALLY, "deepspeed", "bare global", lambda: convert(src, out), [path.name], out)
    assert message and "system" in message
