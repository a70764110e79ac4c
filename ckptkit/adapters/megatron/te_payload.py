"""Transformer Engine's ``_extra_state`` payloads, read without running them.

Transformer Engine (2.x) serialises a module's FP8 state (its recipe, scaling factors and
amax history) with ``pickle.dumps`` into a uint8 tensor, and its ``set_extra_state`` runs
``pickle.loads`` on whatever tensor a load hands it. ckptkit never unpickles a payload, but
handing one from an untrusted checkpoint to the module would let that checkpoint run code in
the training process. So every payload is vetted first, statically: :func:`check` walks the
pickle's opcodes (``pickletools.genops``: nothing is built, nothing is imported) and refuses
it unless every global it names is one Transformer Engine's own payloads name (its recipe
classes, torch's tensor rebuild, ``OrderedDict``). The tensors inside (TE pickles CPU
tensors, whose storages are nested legacy ``torch.save`` streams behind
``torch.storage._load_from_bytes``) are walked the same way: one storage per stream, of one
of torch's storage classes, every integer bounded by the stream's own length (a storage's
declared size is allocated before its bytes are read), and the raw bytes after the pickles
exactly that storage's (its 8-byte element count, then count x element size). Nothing here
unpickles, not even with ``weights_only``: ``pickletools`` only names the opcodes.

Conservative by construction: a ``STACK_GLOBAL`` whose two names were not pushed right
before it as string literals (or memo reads of them) is refused, as are extension codes,
persistent ids and out-of-band buffers, which TE's payloads never use. A dotted name
(``recipe`` + ``os.system`` would resolve through the module's attributes) is refused.
"""

from __future__ import annotations

import io
import pickletools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptkit.errors import UnsafeCheckpointError

TE_RECIPE = "transformer_engine.common.recipe"
RECIPE_CLASSES = frozenset({
    "Format", "_FormatHelper", "MMParams", "QParams", "Recipe", "DelayedScaling", "Float8CurrentScaling",
    "MXFP8BlockScaling", "Float8BlockScaling", "MXFP4QATMXFP8BlockScaling", "MXFP4QATFloat8BlockScaling",
    "NVFP4BlockScaling", "CustomRecipe",
})
"""Classes of Transformer Engine's recipe module (2.x): dataclasses, an enum and a named tuple,
whose construction only stores fields. A ``CustomRecipe`` carries a callable, refused where it
is named."""

PAYLOAD_GLOBALS = frozenset({(TE_RECIPE, name) for name in RECIPE_CLASSES} | {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch.storage", "_load_from_bytes"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),  # how protocols 0-2 spell bytes (torch's weights_only allows it too)
})
"""Every global a payload may name."""

STORAGE_BYTES = {"FloatStorage": 4, "DoubleStorage": 8, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8,
                 "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
                 "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16, "Float8_e4m3fnStorage": 1,
                 "Float8_e5m2Storage": 1}
"""torch's storage classes a nested stream may name, and the bytes of one element of each."""
STORAGE_GLOBALS = frozenset(("torch", name) for name in STORAGE_BYTES)
"""Every global a nested legacy storage stream may name (its storage class)."""

_LEGACY_PICKLES = 5  # magic number, protocol version, system info, the storage, the storage keys
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization's MAGIC_NUMBER
_STRING_PUSH = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING",
                          "BINSTRING", "SHORT_BINSTRING"})
_BYTES_PUSH = frozenset({"SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_NEVER = frozenset({"EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"})
_PERSISTENT = frozenset({"PERSID", "BINPERSID"})
_UNKNOWN = object()


@dataclass
class _Walk:
    """What one pickle names: its globals, bytes literals and integers."""

    globals: list[tuple[str, str]] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    persistent: int = 0


def check(payload: bytes, where: str) -> None:
    """Refuse (:class:`UnsafeCheckpointError` naming ``where`` and the cause) a payload that names
    anything a Transformer Engine payload does not; return quietly for one that does not."""
    walk = _walk_one(io.BytesIO(payload), where)
    if walk.persistent:
        raise UnsafeCheckpointError(f"{where}: the payload uses persistent ids, which Transformer Engine's never do")
    _allowed(walk.globals, PAYLOAD_GLOBALS, where)
    if walk.blobs and ("torch.storage", "_load_from_bytes") not in walk.globals:
        return
    for i, blob in enumerate(walk.blobs):
        _check_storage_stream(blob, f"{where} (nested tensor storage {i})")


def _allowed(names: list[tuple[str, str]], allowed: frozenset[tuple[str, str]], where: str) -> None:
    for module, name in names:
        if (module, name) not in allowed:
            raise UnsafeCheckpointError(
                f"{where}: the payload names {module}.{name}, which Transformer Engine's FP8 state never names (its "
                f"recipe classes, torch's tensor rebuild and storage classes, OrderedDict); it is not unpickled")


def _check_storage_stream(blob: bytes, where: str) -> None:
    """A nested storage: a legacy ``torch.save`` stream of five pickles and the raw bytes after them."""
    stream = io.BytesIO(blob)
    walks = [_walk_one(stream, where) for _ in range(_LEGACY_PICKLES)]
    magic = walks[0].ints
    if magic != [_LEGACY_MAGIC]:  # torch pickles a storage in the legacy form only (TypedStorage.__reduce__)
        raise UnsafeCheckpointError(f"{where}: not a legacy torch.save stream (magic number {magic})")
    for i, walk in enumerate(walks):
        if walk.persistent and i != 3:
            raise UnsafeCheckpointError(f"{where}: a persistent id outside the storage record")
        _allowed(walk.globals, STORAGE_GLOBALS if i == 3 else frozenset(), where)
        if walk.blobs:
            raise UnsafeCheckpointError(f"{where}: bytes inside a storage record")
    for value in walks[3].ints + walks[4].ints:
        if not 0 <= value <= len(blob):
            raise UnsafeCheckpointError(f"{where}: a declared size of {value} in a stream of {len(blob)} bytes")
    _check_storage_bytes(blob[stream.tell():], walks[3], where)


def _check_storage_bytes(rest: bytes, record: _Walk, where: str) -> None:
    """The raw part of a nested stream: exactly one storage (what ``TypedStorage.__reduce__`` writes), its
    8-byte little-endian element count equal to the one its record declares, then that many elements."""
    if len(record.globals) != 1 or record.persistent != 1:
        raise UnsafeCheckpointError(f"{where}: {len(record.globals)} storage classes and {record.persistent} "
                                    "persistent ids; torch nests one storage per stream")
    size = STORAGE_BYTES[record.globals[0][1]]
    count = int.from_bytes(rest[:8], "little", signed=True) if len(rest) >= 8 else -1
    if count < 0 or count not in record.ints or len(rest) != 8 + count * size:
        raise UnsafeCheckpointError(f"{where}: the storage's bytes ({len(rest)}, count {count}) are not the "
                                    f"{record.globals[0][1]} its record declares")


def _walk_one(stream: io.BytesIO, where: str) -> _Walk:
    """The globals, bytes literals and integers of the pickle at the stream's position (which ends
    after it); refused where a global is named in a form this walk cannot follow exactly."""
    walk = _Walk()
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # string values of the pushes since the last stack-changing opcode
    try:
        for op, arg, _ in pickletools.genops(stream):
            name = op.name
            if name in _NEVER:
                raise UnsafeCheckpointError(f"{where}: the payload uses the {name} opcode")
            if name in _PERSISTENT:
                walk.persistent += 1
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                walk.globals.append(_plain(module, attr, where))
            elif name == "STACK_GLOBAL":
                if len(pushed) < 2 or not all(isinstance(x, str) for x in pushed[-2:]):
                    raise UnsafeCheckpointError(f"{where}: a STACK_GLOBAL whose names are not string literals")
                walk.globals.append(_plain(pushed[-2], pushed[-1], where))
            elif name in _BYTES_PUSH:
                walk.blobs.append(bytes(arg))
            elif isinstance(arg, int) and name not in _MEMO_GET | _MEMO_PUT and name != "PROTO" and name != "FRAME":
                walk.ints.append(arg)
            pushed = _after(name, arg, pushed, memo)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - genops raises ValueError and others on damaged input
        raise UnsafeCheckpointError(f"{where}: not a pickle a payload can be ({type(exc).__name__}: {exc})") from None
    return walk


def _after(name: str, arg: Any, pushed: list[Any], memo: dict[int, Any]) -> list[Any]:
    """The string pushes still on top of the stack after opcode ``name``: memo writes leave the
    stack as it is, string pushes and memo reads add a known value, anything else ends the run."""
    if name in _STRING_PUSH:
        return pushed + [str(arg)]
    if name in _MEMO_GET:
        return pushed + [memo.get(arg, _UNKNOWN)]
    if name == "MEMOIZE":
        memo[len(memo)] = pushed[-1] if pushed else _UNKNOWN
        return pushed
    if name in _MEMO_PUT:
        memo[arg] = pushed[-1] if pushed else _UNKNOWN
        return pushed
    return []


def _plain(module: str, name: str, where: str) -> tuple[str, str]:
    if not name.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
        raise UnsafeCheckpointError(f"{where}: the payload names {module!r} {name!r}, not a plain module and name")
    return module, name


def named_globals(payload: bytes) -> Iterator[tuple[str, str]]:
    """The globals a payload names (what the tests compare with TE's); refuses what :func:`check` cannot read."""
    yield from _walk_one(io.BytesIO(payload), "payload").globals
