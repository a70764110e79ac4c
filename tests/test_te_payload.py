"""The vetting of Transformer Engine ``_extra_state`` payloads (ckptkit/adapters/megatron/te_payload.py).

TE's ``set_extra_state`` unpickles whatever payload a load hands it, so ckptkit must refuse every
payload that could run code before any module sees it, and pass every payload TE writes. The
hostile corpus covers each way a pickle can reach a callable (GLOBAL, STACK_GLOBAL through
literals, memo reads and a stack that POPs the vetted names away, INST, extension codes,
persistent ids, dotted names resolving through a module's attributes, nested ``torch.save``
streams behind ``_load_from_bytes``, declared sizes far past the bytes holding them); the fuzz
mutates real TE-shaped payloads and checks that whatever the vetting accepts unpickles touching
only the globals it allows (Python's ``pickle.find_class`` audit event sees every lookup,
nested ``torch.load`` included).
"""

from __future__ import annotations

import copyreg
import io
import math
import os
import pickle
import struct
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.adapters.megatron import te_payload
from ckptkit.errors import UnsafeCheckpointError
from tests import te_payloads as te


class _Call:
    """Pickles as a call of ``fn(*args)``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _refused(data: bytes, match: str = "") -> str:
    with pytest.raises(UnsafeCheckpointError, match=match) as info:
        te_payload.check(data, "payload")
    return str(info.value)


def _nested(numel: int = 6) -> bytes:
    """The legacy torch.save stream torch nests in a pickled CPU tensor's storage."""
    b = pickle.dumps(torch.arange(float(numel)))
    return next(arg for op, arg, _ in __import__("pickletools").genops(b) if op.name == "BINBYTES")


def test_te_shaped_payloads_pass_and_name_what_te_names():
    data = te.payload("layer 3").numpy().tobytes()
    te_payload.check(data, "payload")
    assert set(te_payload.named_globals(data)) == {
        (te.RECIPE, "DelayedScaling"), (te.RECIPE, "Format"), (te.RECIPE, "_FormatHelper"),
        ("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"), ("collections", "OrderedDict")}
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        with te.te_recipe_module():
            te_payload.check(pickle.dumps(te.fp8_state("x"), protocol=protocol), "payload")
    te_payload.check(pickle.dumps(None), "payload")  # what TE 1.x wrote for a module without FP8 state


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_call_of_os_system_is_refused_at_every_protocol(protocol):
    message = _refused(pickle.dumps({"recipe": _Call(os.system, "true")}, protocol=protocol), "posix.system")
    assert message.startswith("payload: ")


def _p4(*ops: bytes) -> bytes:
    return b"\x80\x04" + b"".join(ops) + b"."


def _s(text: str) -> bytes:  # SHORT_BINUNICODE
    return b"\x8c" + bytes([len(text)]) + text.encode()


MEMOIZE, POP, STACK_GLOBAL, EMPTY_TUPLE, REDUCE = b"\x94", b"0", b"\x93", b")", b"R"


@pytest.mark.parametrize("data, match", [
    # the names come back from the memo after the literals were popped: still seen
    (_p4(_s("os"), MEMOIZE, _s("system"), MEMOIZE, POP, POP, b"h\x00", b"h\x01", STACK_GLOBAL, EMPTY_TUPLE, REDUCE),
     "os.system"),
    # allowed names pushed last, then popped: the STACK_GLOBAL takes os/system below them
    (_p4(_s("os"), _s("system"), _s("torch._utils"), _s("_rebuild_tensor_v2"), POP, POP, STACK_GLOBAL),
     "not string literals"),
    # a dotted name resolves through the recipe module's attributes (it imports os)
    (_p4(_s(te_payload.TE_RECIPE), _s("os.system"), STACK_GLOBAL), "not a plain module and name"),
    (_p4(_s(te_payload.TE_RECIPE), _s("os"), STACK_GLOBAL), "recipe.os"),
    (_p4(_s("builtins"), _s("eval"), STACK_GLOBAL), "builtins.eval"),
    (b"(S'true'\nios\nsystem\n.", "os.system"),  # INST, protocol 0
    (b"\x80\x02cos\nsystem\nq\x00.", "os.system"),  # GLOBAL
    (b"\x80\x02X\x02\x00\x00\x00idQ.", "persistent ids"),  # BINPERSID
    (b"\x80\x05\x97.", "NEXT_BUFFER"),
    (b"", "not a pickle"),
    (b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\x7f", "not a pickle"),  # a frame past the end
    (b"garbage that is no pickle at all", "not a pickle"),
])
def test_handcrafted_pickles_are_refused(data, match):
    _refused(data, match)


def test_an_extension_code_is_refused():
    module = os.system.__module__
    copyreg.add_extension(module, "system", 0xF1)
    try:
        data = pickle.dumps(_Call(os.system, "true"), protocol=2)
    finally:
        copyreg.remove_extension(module, "system", 0xF1)
    assert b"\x82\xf1" in data  # the pickler wrote EXT1 instead of naming the global
    _refused(data, "EXT1")


def test_nested_streams_are_vetted_and_bounded():
    load = torch.storage._load_from_bytes
    te_payload.check(pickle.dumps(_Call(load, _nested())), "payload")
    evil = io.BytesIO()
    torch.save(_Call(os.system, "true"), evil, _use_new_zipfile_serialization=False)
    _refused(pickle.dumps(_Call(load, evil.getvalue())), r"nested tensor storage 0.*posix\.system")
    zipped = io.BytesIO()
    torch.save(torch.ones(2), zipped)
    _refused(pickle.dumps(_Call(load, zipped.getvalue())), "nested tensor storage 0")
    bomb = _nested().replace(b"K\x06N", b"J" + struct.pack("<i", 2**30) + b"N")  # numel 6 -> 2**30
    assert bomb != _nested()
    _refused(pickle.dumps(_Call(load, bomb)), "declared size of 1073741824")
    short = _nested()[:-8]  # the storage's bytes cut short
    _refused(pickle.dumps(_Call(load, short)), "are not the FloatStorage its record declares")
    longer = _nested() + b"\0" * 4  # bytes past the storage
    _refused(pickle.dumps(_Call(load, longer)), "are not the FloatStorage its record declares")


def test_a_recipe_with_a_callable_is_refused_naming_it():
    with te.te_recipe_module():
        state = te.fp8_state("x")
        state["recipe"].amax_compute_algo = math.fsum  # a callable TE allows; never carried across a load
        data = pickle.dumps(state)
    _refused(data, "math.fsum")


_AUDIT: list[tuple[str, str]] | None = None


def _audit(event: str, args: tuple) -> None:
    if event == "pickle.find_class" and _AUDIT is not None:
        _AUDIT.append((str(args[0]), str(args[1])))


sys.addaudithook(_audit)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.text(max_size=8), edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)),
                                                 max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 1 << 16)))
def test_whatever_passes_the_vetting_unpickles_only_allowed_globals(seed, edits, cut):
    """Mutated TE payloads: the vetting refuses (UnsafeCheckpointError, nothing else) or, where it accepts,
    unpickling looks up only the globals it allows, at every depth."""
    global _AUDIT
    data = bytearray(te.payload(seed).numpy().tobytes())
    for at, value in edits:
        data[at % len(data)] = value
    data = bytes(data if cut is None else data[: cut % (len(data) + 1)])
    try:
        te_payload.check(data, "payload")
    except UnsafeCheckpointError:
        return
    _AUDIT = []
    try:
        with te.te_recipe_module():
            pickle.loads(data)
    except Exception:  # noqa: BLE001 - a damaged payload may fail to build; what it looked up is the point
        pass
    finally:
        seen, _AUDIT = _AUDIT, None
    allowed = te_payload.PAYLOAD_GLOBALS | te_payload.STORAGE_GLOBALS
    assert set(seen) <= allowed, set(seen) - allowed


def test_extra_state_names_and_rules_follow_megatrons_unique_keys():
    """``extra/<key>/shard_<offsets>_<shape>`` round-trips, and places a payload with its layer (and expert)."""
    from ckptkit.adapters.megatron.extra_state import parse_name, rule_of
    from ckptkit.layout.rules import PartitionRule

    dense = "extra/decoder.layers.self_attention.linear_qkv._extra_state/shard_3_4"
    assert parse_name(dense) == ("decoder.layers.self_attention.linear_qkv._extra_state", (3,), (4,))
    assert rule_of(*parse_name(dense)) == PartitionRule(layer=3)
    expert = "extra/decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_2.5_4.8"
    assert rule_of(*parse_name(expert)) == PartitionRule(layer=2, expert=5, num_experts=8)
    per_layer = "extra/decoder.layers.7.self_attention.linear_proj._extra_state/shard_0_1"
    assert rule_of(*parse_name(per_layer)) == PartitionRule(layer=7)
    assert rule_of(*parse_name("extra/output_layer._extra_state/shard_0_1")) is None
    for bad in ("model/decoder.layers.x._extra_state/shard_0_4", "extra/decoder.layers.x.weight/shard_0_4",
                "extra/decoder.layers.x._extra_state/shard_a_4", "extra/decoder.layers.x._extra_state"):
        with pytest.raises(ValueError):
            parse_name(bad)


def test_only_te2_payloads_are_carried_at_a_save():
    """A ShardedObject's data: None and an empty uint8 tensor are not stored, TE 2.x's payload is, anything
    else (TE 1.x's io.BytesIO, a dict) is refused naming the module."""
    from types import SimpleNamespace

    from ckptkit.adapters.megatron.extra_state import _payload
    from ckptkit.errors import StateMismatchError

    assert _payload(SimpleNamespace(data=None), "m") is None
    assert _payload(SimpleNamespace(data=torch.empty(0, dtype=torch.uint8)), "m") is None
    payload = te.payload("x")
    assert torch.equal(_payload(SimpleNamespace(data=payload), "m"), payload)
    for data in (io.BytesIO(b"x"), {"scale": torch.ones(1)}, torch.ones(3), torch.zeros(2, 2, dtype=torch.uint8)):
        with pytest.raises(StateMismatchError, match="module 'm' holds a"):
            _payload(SimpleNamespace(data=data), "m")


def test_a_grouped_gemm_modules_fp8_state_is_refused_and_its_empty_state_passed_over():
    """TEGroupedMLP's grouped linear (``num_gemms`` experts in one module, ``_extra_state<i>`` per expert):
    Megatron merges those in a load hook a per-object ``set_extra_state`` would bypass, so FP8 state there is
    refused by name at the save, and state without FP8 (empty) is not declared at all."""
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from ckptkit.adapters.megatron.extra_state import declared
    from ckptkit.errors import StateMismatchError

    model = torch.nn.Module()
    model.add_module("fc1", torch.nn.Module())
    model.fc1.num_gemms = 2

    def obj(data, i):
        return SimpleNamespace(key="decoder.layers.mlp.experts.linear_fc1._extra_state", data=data,
                               global_offset=(0, i), global_shape=(1, 2), replica_id=(0, 0, 0),
                               unique_key=f"decoder.layers.mlp.experts.linear_fc1._extra_state/shard_0.{i}_1.2")

    empty = torch.empty(0, dtype=torch.uint8)
    assert declared([model], [(0, "fc1._extra_state", obj(empty, 0)), (0, "fc1._extra_state1", obj(empty, 1))]) == []
    with pytest.raises(StateMismatchError, match="'fc1._extra_state1' is a grouped-GEMM linear"):
        declared([model], [(0, "fc1._extra_state1", obj(te.payload("x"), 1))])


def test_a_stored_payload_declared_huge_or_not_1d_is_refused_before_its_buffer_is_made():
    """A hostile manifest may declare any shape for an ``extra/`` tensor; the load would make its buffer before
    reading, so a payload over 64 MiB (TE's are kilobytes) or of more than one axis is refused first."""
    from types import SimpleNamespace

    from ckptkit.adapters.megatron.extra_state import MAX_PAYLOAD_BYTES, load_entries

    state = SimpleNamespace(name="extra/decoder.layers.x._extra_state/shard_0_1")
    assert load_entries([state], {state.name: (22250,)}, "ckpt")["x0"].local.shape == (22250,)
    for shape in ((1 << 40,), (MAX_PAYLOAD_BYTES + 1,), (4, 4), ()):
        with pytest.raises(UnsafeCheckpointError, match=r"ckpt: tensor 'extra/decoder.*declares shape"):
            load_entries([state], {state.name: shape}, "ckpt")


def test_a_load_does_not_refuse_what_the_loading_modules_hold_now():
    """At a load the modules' current payloads are not used: a grouped-GEMM module with FP8 state, or TE 1.x's
    BytesIO form, is passed over (saving refuses both, so no checkpoint holds them)."""
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from ckptkit.adapters.megatron.extra_state import declared

    model = torch.nn.Module()
    model.add_module("fc1", torch.nn.Module())
    model.add_module("proj", torch.nn.Module())
    model.fc1.num_gemms = 2
    grouped = SimpleNamespace(key="decoder.layers.mlp.experts.linear_fc1._extra_state", data=te.payload("x"),
                              global_offset=(0, 1), global_shape=(1, 2), replica_id=(0, 0, 0),
                              unique_key="decoder.layers.mlp.experts.linear_fc1._extra_state/shard_0.1_1.2")
    old = SimpleNamespace(key="decoder.layers.proj._extra_state", data=io.BytesIO(b"te1"), global_offset=(0,),
                          global_shape=(1,), replica_id=(0, 0, 0), unique_key="decoder.layers.proj._extra_state/shard_0_1")
    got = declared([model], [(0, "fc1._extra_state1", grouped), (0, "proj._extra_state", old)], saving=False)
    assert [(s.path, s.payload) for s in got] == [("proj._extra_state", None)]
