"""State keys and the JSON codec for non-tensor state.

State is a nested structure of dicts and lists; every leaf gets a *key*: its
path components joined by ``/`` (``optim/state/layers.0.weight/exp_avg``),
with ``%`` and ``/`` inside a component percent-escaped so keys round-trip.

Non-tensor leaves are stored as JSON, never pickle: JSON natives as they
are, plus tagged forms for tuples, bytes, dicts with non-string keys and the
empty containers that keep a structure's shape. Anything else is refused at
save time with the key named, rather than silently stringified.
"""

from __future__ import annotations

import base64
import copy
import math
from typing import Any

from ckptkit.errors import ManifestError, StateMismatchError
from ckptkit.layout.strict_json import MAX_DEPTH

# An encoded value sits a few levels deep in a manifest (document -> rank_values -> key -> group ->
# value); keep the whole document within what a reader accepts (strict_json.MAX_DEPTH).
MAX_VALUE_DEPTH = MAX_DEPTH - 8
# JSON integers beyond Python's default conversion limit (4300 digits) cannot be read back.
MAX_INT_BITS = 14000


def json_ready(value: Any, what: str) -> Any:
    """``value`` as plain JSON data, kept exactly, or StateMismatchError naming ``what`` and the key path
    of the first part that cannot be: framework records (optimizer param groups, LR schedulers, configs,
    client state) are stored as JSON, never pickle — and never turned into strings. The one rule the
    live adapters (``ckptkit.adapters``) and the importers (``ckptkit_converters``) apply to such records.

    Kept: None, bool, int (up to :data:`MAX_INT_BITS`), float (nan and inf too), str, lists, and dicts
    with string keys; tuples become lists (adapters restore the tuples they know, e.g. Adam's betas);
    subclasses of int, float and str (enums) become the plain value. Refused: anything else (a tensor,
    a set, bytes, an object), a dict key that is not a string (``json.dumps`` would silently write
    ``{1: x}`` as ``{"1": x}``), a string that is not valid Unicode, nesting deeper than
    :data:`MAX_VALUE_DEPTH`."""
    return _json_ready(value, what, (), 0)


def _json_ready(value: Any, what: str, path: tuple[Any, ...], depth: int) -> Any:
    def refuse(problem: str) -> StateMismatchError:
        at = what + "".join(f"[{_short(p)}]" for p in path)
        return StateMismatchError(f"{at} {problem}; ckptkit stores such records as JSON, never pickle, and never "
                                  "as strings: keep it to numbers, strings, lists and dicts with string keys")

    if depth > MAX_VALUE_DEPTH:
        raise refuse(f"nests deeper than {MAX_VALUE_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if not _valid_text(value):
            raise refuse(f"is a string that is not valid Unicode ({value[:40]!a})")
        return str(value)
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise refuse(f"is an integer of {value.bit_length()} bits, too large for JSON")
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_json_ready(v, what, (*path, i), depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise refuse(f"has the key {_short(k)} ({type(k).__name__}) where JSON needs a string")
            if not _valid_text(k):
                raise refuse(f"has a key that is not valid Unicode ({k[:40]!a})")
            out[str(k)] = _json_ready(v, what, (*path, k), depth + 1)
        return out
    raise refuse(f"is a {type(value).__module__}.{type(value).__qualname__}, not a JSON value")


def _short(key: Any) -> str:
    text = ascii(key)
    return text if len(text) <= 60 else text[:50] + "...'"


def _valid_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def join_key(parts: tuple[str | int, ...]) -> str:
    return "/".join(str(p).replace("%", "%25").replace("/", "%2F") for p in parts)


def split_key(key: str) -> tuple[str, ...]:
    return tuple(p.replace("%2F", "/").replace("%25", "%") for p in key.split("/"))


_TAGS = ("__tuple__", "__bytes__", "__dict__", "__float__", "__generator__")  # the last: a generator's per-rank state


def encode_value(value: Any, key: str, depth: int = 0) -> Any:
    """A JSON-safe form of ``value``; raise StateMismatchError for unsupported types.

    Refused here, at save time, is also whatever a reader would refuse (strict_json): nesting
    deeper than :data:`MAX_VALUE_DEPTH`, integers past Python's 4300-digit conversion limit,
    strings that are not valid Unicode — so every committed checkpoint can be loaded."""
    if depth == 0:
        check_key(key)
    if depth > MAX_VALUE_DEPTH:
        raise StateMismatchError(f"state key {key!r}: the value nests deeper than {MAX_VALUE_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _text(value, key)
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise StateMismatchError(f"state key {key!r}: an integer of {value.bit_length()} bits is too large to "
                                     "store as JSON (store it as bytes or a string)")
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"__float__": repr(value)}  # nan / inf / -inf, without relying on non-standard JSON
    inner = depth + 2  # a tagged container is two JSON levels
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, key, inner) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, key, depth + 1) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {_text(k, key): encode_value(v, key, depth + 1) for k, v in value.items()}
        return {"__dict__": [[encode_value(k, key, inner + 1), encode_value(v, key, inner + 1)] for k, v in value.items()]}
    raise StateMismatchError(
        f"state key {key!r}: cannot store a value of type {type(value).__name__} "
        "(supported: tensors, DTensors, ckptkit.Sharded, torch.Generator, and JSON-like values: "
        "None, bool, int, float, str, bytes, list, tuple, dict)"
    )


def check_key(key: str) -> str:
    """``key`` if it can be stored (UTF-8 text); StateMismatchError naming it otherwise. A key with a lone
    surrogate used to be committed into a manifest every reader then refused."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise StateMismatchError(f"state key {key!a} is not valid Unicode (a lone surrogate, e.g. from a file name "
                                 "decoded with surrogateescape): keys are stored as UTF-8 text; rename it") from None
    return key


def _text(s: str, key: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise StateMismatchError(f"state key {key!r}: string {s[:40]!a} is not valid Unicode (a lone surrogate, "
                                 "e.g. from a file name decoded with surrogateescape); store it as bytes") from None
    return s


def decode_value(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [decode_value(v, where) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, inner), = value.items()
            if tag == "__tuple__":
                return tuple(decode_value(v, where) for v in _list(inner, where))
            if tag == "__bytes__":
                try:
                    return base64.b64decode(inner, validate=True)
                except (ValueError, TypeError):
                    raise ManifestError(f"{where}: malformed bytes value") from None
            if tag == "__float__":
                if inner not in ("nan", "inf", "-inf"):
                    raise ManifestError(f"{where}: malformed float value {inner!r}")
                return float(inner)
            if tag == "__dict__":
                out = {}
                for item in _list(inner, where):
                    if not isinstance(item, list) or len(item) != 2:
                        raise ManifestError(f"{where}: malformed dict item {item!r}")
                    k = decode_value(item[0], where)
                    try:
                        out[k] = decode_value(item[1], where)
                    except TypeError:
                        raise ManifestError(f"{where}: unhashable dict key {k!r}") from None
                return out
        return {k: decode_value(v, where) for k, v in value.items()}
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ManifestError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def shaped_like(value: Any, like: Any) -> Any:
    """``value`` as decoded (JSON's list, tuple, dict, int, float, str, bytes) with the types the state
    being loaded into holds at the same place, where the shapes agree: a namedtuple, ``torch.Size``,
    ``OrderedDict``, ``defaultdict``, an ``IntEnum`` member, a ``numpy.float64``, a ``bytearray``.
    The checkpoint cannot name a Python type without running code at load, so the state's own types
    are the ones used, as a tensor's dtype is the state's; where they do not fit (another length,
    other keys, a constructor that refuses the value) the decoded value stays as it is."""
    if isinstance(value, (list, tuple, dict)):
        return _shaped_container(value, like)
    if isinstance(like, bool) or type(like) is type(value):
        return value
    if isinstance(like, bytearray) and isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, (int, float, str, bytes)) and not isinstance(value, bool) and isinstance(like, type(value)):
        try:
            return type(like)(value)
        except Exception:  # noqa: BLE001 - the state's type refuses the saved value: keep the value
            return value
    return value


def _shaped_container(value: Any, like: Any) -> Any:
    if isinstance(value, tuple) and isinstance(like, tuple) and len(value) == len(like):
        items = [shaped_like(v, x) for v, x in zip(value, like)]
        if hasattr(like, "_fields"):
            return type(like)._make(items)
        try:
            return type(like)(items)
        except Exception:  # noqa: BLE001 - a tuple subclass that cannot be built from its items
            return tuple(items)
    if isinstance(value, list) and isinstance(like, list) and len(value) == len(like):
        return [shaped_like(v, x) for v, x in zip(value, like)]
    if isinstance(value, dict) and isinstance(like, dict) and value.keys() == like.keys():
        items = {k: shaped_like(v, like[k]) for k, v in value.items()}
        if type(like) is dict:
            return items
        try:
            out = copy.copy(like)  # keeps a defaultdict's factory, an OrderedDict's type
            out.clear()
            out.update(items)
            return out
        except Exception:  # noqa: BLE001 - a dict subclass that cannot be copied: a plain dict
            return items
    return value
