"""Frozen parameters in a Megatron-core job (Megatron-LM's ``--freeze-*``, e.g. a multimodal run's
frozen language model): set ``requires_grad=False`` before the DDP wrap, so neither Megatron's grad
buffers nor its optimizer (plain or distributed) hold them; the adapter saves them from the module.

The tiny GPT (tests/megatron_model.py) trains with its word embeddings frozen. Every resume builds its
model from another seed, so the frozen embedding must come from the checkpoint:

* at the saving layout, the resumed run's eval and losses equal the saving run's, bit for bit, with the
  distributed optimizer and with the plain one;
* at tp2 (another layout), the loaded job saved again at once holds every tensor of the checkpoint, the
  frozen embedding included, bit for bit.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch

from tests import megatron_job as job
from tests import megatron_model as mm

pytestmark = pytest.mark.usefixtures("retire_megatron_world")

FROZEN = ("embedding",)


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distributed-optimizer", "plain-optimizer"])
def test_a_frozen_embedding_resumes_exactly(worlds, tmp_path, dist_opt):
    layout = mm.Layout(dist_opt=dist_opt, frozen=FROZEN)
    folder = str(tmp_path / "ckpt")
    ref = worlds.run(2, job.train_and_save, layout, folder, save_step=2, steps=4)[0]
    got = worlds.run(2, job.resume, layout, folder, steps=4)[0]
    assert got["eval"] == ref["eval"]
    assert {s: got["losses"][s] for s in (3, 4)} == {s: ref["losses"][s] for s in (3, 4)}
    if dist_opt:  # at another layout: everything loaded, the frozen embedding too, saved again bit for bit
        again = str(tmp_path / "again")
        worlds.run(2, job.resume, mm.Layout(tp=2, dist_opt=False, frozen=FROZEN), folder, steps=2, save_again=again)
        a, b = job.all_tensors(folder), job.all_tensors(again)
        key = "model/embedding.word_embeddings.weight"
        assert key in a and torch.equal(a[key], b[key])
        assert not any("word_embeddings" in k for k in a if k.startswith("optimizer/"))  # frozen: no state
        assert {k: v for k, v in a.items() if k.startswith("model/")}.keys() == \
            {k: v for k, v in b.items() if k.startswith("model/")}.keys()
        for k in a:
            if k.startswith("model/"):
                assert torch.equal(a[k], b[k]), k
