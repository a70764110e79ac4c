"""One trusted-unpickling rule for every ``.pt`` the converters open (converters/common/safe_unpickle.py),
and the Megatron-LM ``args`` facts read through it. No Megatron or DeepSpeed install needed.

* Megatron's and DeepSpeed's loaders (and DCP's blob decoder) trust exactly their stand-ins on top
  of ``weights_only``'s defaults: a class someone else in the process registered with
  ``add_safe_globals`` is refused by all three, and the process's own registrations are never
  touched, also when loads with different tables run on many threads at once (the user's own
  loads alongside: tests/test_import_trust_concurrency.py);
* an ``argparse.Namespace`` becomes an inert record holding its attributes; anything executable
  inside it is refused before it runs;
* what ``args`` records (true and padded vocabulary, padding multiple, layers) is read, given values
  must agree with it, and only what is missing is asked for, by name.
"""

from __future__ import annotations

import argparse
import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckptkit.errors import LayoutError, ManifestError
from ckptkit.offline.formats import MissingImportOptions
from ckptkit_converters.common import safe_unpickle
from ckptkit_converters.deepspeed import files as deepspeed_format
from ckptkit_converters.megatron import files as megatron_format
from ckptkit_converters.dcp.files import load_blob
from ckptkit_converters.megatron.importer import resolve_vocab
from ckptkit_converters.megatron.files import SavedArgs
from ckptkit_converters.common.safe_unpickle import NamespaceRecord, UnsafeCheckpointError
from tests.malicious_pickle import RunsOnLoad


class Registered:
    """A class another library registered process-wide with ``torch.serialization.add_safe_globals``."""

    def __init__(self) -> None:
        self.ran = True


@pytest.fixture
def registered():
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([Registered])
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def _args(**fields) -> argparse.Namespace:
    return argparse.Namespace(num_layers=4, hidden_size=64, tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=2, make_vocab_size_divisible_by=16,
                              padded_vocab_size=256, vocab_size=None, untie_embeddings_and_output_weights=True,
                              world_size=4, params_dtype=torch.float32, **fields)


def test_namespace_becomes_an_inert_record_with_its_attributes(tmp_path: Path):
    path = tmp_path / "common.pt"
    torch.save({"iteration": 2, "checkpoint_version": 3.0, "args": _args(tokenizer_type="GPT2BPETokenizer")}, path)
    common = megatron_format.load_pt(str(path))
    args = common["args"]
    assert type(args) is NamespaceRecord and args.num_layers == 4 and args.tokenizer_type == "GPT2BPETokenizer"
    assert args.params_dtype is torch.float32
    saved = SavedArgs.of(args)
    assert saved == SavedArgs(num_layers=4, tp=2, pp=2, vpp=None, divisible_by=16, padded_vocab_size=256,
                              vocab_size=None, world_size=4, untied=True, recorded=True)
    assert SavedArgs.of(None) == SavedArgs() and not SavedArgs.of({"num_layers": 4}).recorded  # a dict is not args


def test_code_inside_args_is_refused_before_it_runs(tmp_path: Path):
    marker = str(tmp_path / "pwned")
    path = tmp_path / "common.pt"
    torch.save({"args": _args(exit_signal_handler=RunsOnLoad(marker))}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"common\.pt.*system"):
        megatron_format.load_pt(str(path))
    assert not os.path.exists(marker)


def test_classes_registered_by_others_are_not_trusted(tmp_path: Path, registered):
    path = tmp_path / "x.pt"
    torch.save({"optimizer_state_dict": {"x": Registered()}}, path)
    assert isinstance(torch.load(path, weights_only=True)["optimizer_state_dict"]["x"], Registered)  # torch would
    with pytest.raises(UnsafeCheckpointError, match="Registered"):
        megatron_format.load_pt(str(path))
    with pytest.raises(UnsafeCheckpointError, match="Registered"):
        deepspeed_format.load_file(str(path))
    buf = io.BytesIO()
    torch.save(Registered(), buf)
    with pytest.raises(UnsafeCheckpointError, match="Registered"):
        load_blob(buf.getvalue(), "blob")
    assert Registered in torch.serialization.get_safe_globals()  # the process's own registration is back


def test_concurrent_loads_with_different_tables(tmp_path: Path, registered):
    mg, ds, bad = tmp_path / "mg.pt", tmp_path / "ds.pt", tmp_path / "bad.pt"
    torch.save({"args": _args(), "w": torch.arange(6)}, mg)
    torch.save({"optimizer_state_dict": {"zero_stage": 2}, "w": torch.ones(3)}, ds)
    torch.save({"r": Registered()}, bad)
    buf = io.BytesIO()
    torch.save(torch.arange(4), buf)
    blob = buf.getvalue()

    def one(i: int) -> str:
        kind = i % 4
        if kind == 0:
            assert megatron_format.load_pt(str(mg))["args"].num_layers == 4
        elif kind == 1:
            assert deepspeed_format.load_file(str(ds))["optimizer_state_dict"]["zero_stage"] == 2
        elif kind == 2:
            assert torch.equal(load_blob(blob, "blob"), torch.arange(4))
        else:
            with pytest.raises(UnsafeCheckpointError):
                megatron_format.load_pt(str(bad))
        return "ok"

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(200))) == ["ok"] * 200
    assert Registered in torch.serialization.get_safe_globals()


def test_megatron_facts_are_read_and_only_the_missing_ones_asked_for():
    recorded = SavedArgs.of(safe_unpickle.NamespaceRecord(vocab_size=250, make_vocab_size_divisible_by=16,
                                                          padded_vocab_size=256))
    assert resolve_vocab(None, None, recorded, 256, "ckpt") == (250, 16)
    assert resolve_vocab(250, 16, recorded, 256, "ckpt") == (250, 16)
    with pytest.raises(LayoutError, match=r"--vocab-size 300 disagrees with the checkpoint's vocab_size 250"):
        resolve_vocab(300, None, recorded, 256, "ckpt")
    with pytest.raises(LayoutError, match="--divisible-by 128 disagrees"):
        resolve_vocab(None, 128, recorded, 256, "ckpt")
    with pytest.raises(ManifestError, match="padded_vocab_size 256, but 'embedding.word_embeddings.weight' has 512"):
        resolve_vocab(None, None, recorded, 512, "ckpt")
    # Megatron-LM without --vocab-size: args carry the padding multiple but not the true vocabulary
    no_vocab = SavedArgs.of(safe_unpickle.NamespaceRecord(vocab_size=None, make_vocab_size_divisible_by=16))
    with pytest.raises(MissingImportOptions, match=r"ckpt: its args do not record vocab_size .*--vocab-size N") as e:
        resolve_vocab(None, None, no_vocab, 256, "ckpt")
    assert e.value.missing == ("vocab_size",) and "--divisible-by" not in str(e.value)
    assert resolve_vocab(250, None, no_vocab, 256, "ckpt") == (250, 16)
    # no args at all (a checkpoint written without them): both, in one message
    with pytest.raises(MissingImportOptions, match=r"no Megatron-LM args.*--vocab-size N.*--divisible-by N") as e:
        resolve_vocab(None, None, SavedArgs.of(None), 256, "ckpt")
    assert e.value.missing == ("vocab_size", "make_vocab_size_divisible_by")
