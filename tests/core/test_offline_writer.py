"""The offline writer's two call forms: ``write_offline(store, OfflineCheckpoint(...), source)`` and
the first form with the checkpoint's fields as keywords (converters not yet switched still use it).

Both must commit the same checkpoint through one implementation, the old form without a warning
(an internal engine API), and a call mixing the forms or misspelling a field must fail before
anything is written.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.engine.offline_writer import OfflineCheckpoint, OfflineWriteResult, write_offline
from ckptkit.layout.box import Box, Region
from ckptkit.layout.manifest import ExplicitLayout, TensorMeta
from ckptkit.layout.values import encode_value
from ckptkit.storage.local import LocalStore

WEIGHT = torch.arange(24, dtype=torch.float32).reshape(6, 4)
BIAS = torch.tensor([1.5, -2.0], dtype=torch.float64)


class _Rows:
    """A rank's pieces cut from the tensors above, counting the bytes it hands out."""

    def __init__(self, items: Sequence[tuple[str, Region]]) -> None:
        self.items, self.bytes_read = list(items), 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, ref: int) -> torch.Tensor:
        key, region = self.items[ref]
        full = WEIGHT if key == "w" else BIAS
        box = region.box
        out = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].clone()
        self.bytes_read += out.numel() * out.element_size()
        return out


def _fields() -> dict[str, object]:
    """Two ranks: the weight's rows split between them, the bias on rank 1, values of every kind."""
    return {
        "world_size": 2,
        "tensors": {"w": TensorMeta("w", "float32", (6, 4), ExplicitLayout(())),
                    "b": TensorMeta("b", "float64", (2,), ExplicitLayout(()))},
        "pieces": {0: [("w", Region(Box((0, 0), (3, 4))))],
                   1: [("w", Region(Box((3, 0), (3, 4)))), ("b", Region(Box((0,), (2,))))]},
        "values": {"step": encode_value(7, "step")},
        "per_rank_values": {r: {"rng": encode_value({"rank": r}, "rng")} for r in range(2)},
        "meta": {"user": {"note": "both forms"}},
        "parallel": "dp2",
    }


def _same_commit(a: OfflineWriteResult, b: OfflineWriteResult, pa: Path, pb: Path) -> None:
    assert (a.nbytes, a.bytes_read) == (b.nbytes, b.bytes_read) == (WEIGHT.nbytes + BIAS.nbytes,) * 2
    ma, mb = a.manifest, b.manifest
    assert ma.tensors == mb.tensors and ma.values == mb.values and ma.per_rank_keys == mb.per_rank_keys == ("rng",)
    assert ma.parallel == mb.parallel == "dp2" and ma.meta["user"] == mb.meta["user"] == {"note": "both forms"}
    for path in (pa, pb):
        view = ckptkit.open(path)
        assert torch.equal(view["w"][...], WEIGHT) and torch.equal(view["b"][...], BIAS)


def test_the_keyword_form_commits_what_the_checkpoint_form_does_without_a_warning(tmp_path: Path) -> None:
    new = write_offline(LocalStore(str(tmp_path / "new")), OfflineCheckpoint(**_fields()),  # type: ignore[arg-type]
                        lambda rank, items: _Rows(items))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an internal API: the old form must stay quiet
        old = write_offline(LocalStore(str(tmp_path / "old")), source=lambda rank, items: _Rows(items),
                            **_fields())
    _same_commit(new, old, tmp_path / "new", tmp_path / "old")


@pytest.mark.parametrize("call", ["mixed", "misspelled", "incomplete", "no source"])
def test_a_call_mixing_or_misspelling_the_forms_fails_before_writing(tmp_path: Path, call: str) -> None:
    store = LocalStore(str(tmp_path / "c"))
    fields = _fields()
    source = lambda rank, items: _Rows(items)  # noqa: E731
    with pytest.raises(TypeError) as err:
        if call == "mixed":
            write_offline(store, OfflineCheckpoint(**fields), source, world_size=2)  # type: ignore[arg-type]
        elif call == "misspelled":
            write_offline(store, source=source, world=2, **{k: v for k, v in fields.items() if k != "world_size"})
        elif call == "incomplete":
            write_offline(store, source=source, tensors=fields["tensors"], pieces=fields["pieces"])
        else:
            write_offline(store, OfflineCheckpoint(**fields))  # type: ignore[arg-type]
    wanted = {"mixed": "world_size", "misspelled": "world", "incomplete": "world_size", "no source": "source"}[call]
    assert wanted in str(err.value)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())
