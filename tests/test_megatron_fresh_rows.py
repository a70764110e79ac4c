"""The optimizer's copies of vocabulary-padding rows a checkpoint does not hold are zeroed after a load.

``optimizer_state.zero_fresh_rows`` works on whatever part of a parameter a rank's optimizer holds:
the whole TP-local tensor (plain optimizers) or a flat ``[start, stop)`` range of its flattening (the
distributed optimizer's shard, which can begin and end inside a row). Checked against the obvious
reference -- the rows zeroed in a whole tensor, then the rank's range cut out -- over random shapes,
row ranges and shard boundaries. The real job (Megatron's optimizers at a layout whose padding grew)
is tests/test_megatron.py::test_vocab_padding_grows_with_main_copies.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.adapters.megatron.model_space import ParamSpace
from ckptkit.adapters.megatron.optimizer_state import ParamState, zero_fresh_rows


@st.composite
def cases(draw):
    rows = draw(st.integers(1, 12))
    width = draw(st.integers(1, 5))
    fresh, at = [], draw(st.integers(0, rows))
    while at < rows and draw(st.booleans()):
        stop = draw(st.integers(at + 1, rows))
        fresh.append((at, stop))
        at = stop + draw(st.integers(0, 2))
    numel = rows * width
    flat = draw(st.one_of(st.none(), st.tuples(st.integers(0, numel), st.integers(0, numel)).map(sorted).map(tuple)))
    separate_main = draw(st.booleans())
    return rows, width, tuple(fresh), flat, separate_main


@settings(max_examples=200, deadline=None)
@given(cases())
def test_zeroes_exactly_the_fresh_rows_of_what_the_rank_holds(case):
    rows, width, fresh, flat, separate_main = case
    g = torch.Generator().manual_seed(rows * 31 + width)
    whole = {name: torch.randn(rows, width, generator=g) + 5 for name in ("main", "exp_avg", "exp_avg_sq")}
    param = torch.empty(rows, width)
    space = ParamSpace("w", param, 0, (), True, 0, 1, {}, fresh_rows=fresh)

    def held(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if flat is None else t.reshape(-1)[flat[0]:flat[1]].clone()

    main = held(whole["main"])
    state = {"exp_avg": held(whole["exp_avg"]), "exp_avg_sq": held(whole["exp_avg_sq"]), "step": 3}
    ps = ParamState(space, main if separate_main else None, state, flat, None, main)
    zero_fresh_rows([ps])

    for name, got in (("main", main), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
        want = whole[name].clone()
        if name != "main" or separate_main:
            for first, stop in fresh:
                want[first:stop] = 0
        assert torch.equal(got, held(want)), (name, fresh, flat)
    assert state["step"] == 3
