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
import math
from typing import Any

from ckptkit.errors import ManifestError, StateMismatchError


def json_ready(value: Any, what: str) -> Any:
    """``value`` as plain JSON data (tuples become lists), or StateMismatchError naming ``what``:
    framework records (schedulers, client state) are stored as JSON, never pickle."""
    import json

    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise StateMismatchError(f"{what} is not JSON-representable ({exc}); ckptkit stores it as JSON, never "
                                 "pickle: keep it to numbers, strings, lists and dicts") from exc


def join_key(parts: tuple[str | int, ...]) -> str:
    return "/".join(str(p).replace("%", "%25").replace("/", "%2F") for p in parts)


def split_key(key: str) -> tuple[str, ...]:
    return tuple(p.replace("%2F", "/").replace("%25", "%") for p in key.split("/"))


_TAGS = ("__tuple__", "__bytes__", "__dict__", "__float__")


def encode_value(value: Any, key: str) -> Any:
    """A JSON-safe form of ``value``; raise StateMismatchError for unsupported types."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"__float__": repr(value)}  # nan / inf / -inf, without relying on non-standard JSON
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, key) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, key) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: encode_value(v, key) for k, v in value.items()}
        return {"__dict__": [[encode_value(k, key), encode_value(v, key)] for k, v in value.items()]}
    raise StateMismatchError(
        f"state key {key!r}: cannot store a value of type {type(value).__name__} "
        "(supported: tensors, DTensors, ckptkit.Sharded, torch.Generator, and JSON-like values: "
        "None, bool, int, float, str, bytes, list, tuple, dict)"
    )


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
