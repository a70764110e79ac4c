"""Parsing checkpoint metadata as untrusted input: strict JSON and bounded fields.

A checkpoint folder may come from an untrusted bucket or be damaged, so every
metadata file is parsed as hostile input (docs/trust.md):

* size is capped before parsing (the store refuses larger objects,
  :data:`MAX_METADATA_BYTES`), so memory stays bounded;
* nesting is capped (:data:`MAX_DEPTH`): ``json`` itself would raise a
  ``RecursionError`` deep inside, and our own decoders recurse too;
* only standard JSON: ``NaN``/``Infinity`` and numbers that overflow to
  infinity (``1e999``) are refused — ckptkit never writes them (non-finite
  floats are tagged strings), so their presence means damage;
* a duplicated key in an object is refused (which of the two is meant?);
* every string must be valid Unicode (a lone surrogate cannot be printed or
  encoded and would crash whoever shows it);
* integers that describe layout (ranks, shapes, offsets) are range-checked
  by :func:`as_int` before anything is sized from them.

Standard library only: the layout core uses it.
"""

from __future__ import annotations

import gc
import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ckptkit.errors import ManifestError

#: Largest manifest or index ckptkit parses, in bytes. A 16k-rank checkpoint's manifest is a few
#: MiB (benchmarks/bench_plan_scale.py); ``CKPTKIT_MAX_METADATA_BYTES`` raises it for larger jobs.
MAX_METADATA_BYTES = int(os.environ.get("CKPTKIT_MAX_METADATA_BYTES", 256 << 20))
#: Deepest nesting of JSON containers accepted anywhere in metadata (values included). Saving a
#: value nested deeper is refused at save time, so every checkpoint ckptkit writes can be read.
MAX_DEPTH = 100
#: Largest integer accepted where metadata describes a layout (shapes, offsets, ranks, sizes).
MAX_LAYOUT_INT = 2**62
#: Largest world size (ranks) a manifest may declare.
MAX_WORLD = 1 << 20


_GC = {"depth": 0, "was_enabled": False}
_GC_LOCK = threading.Lock()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a metadata document becomes objects.

    Parsing a manifest or an index makes hundreds of thousands of small, acyclic objects; their
    allocations keep triggering collections, and each older-generation collection walks the whole
    heap. A loading rank that holds its model and the indexes it read already spent about 60% of
    each index's parse in the collector (measured: 0.10 s -> 0.04 s for a 440 KB ZeRO-3 index; a
    torchtitan rank at 1,024 ranks parses hundreds). Nesting and threads (indexes are read in
    parallel) share one pause; the collector's state before the first is restored after the last."""
    with _GC_LOCK:
        if _GC["depth"] == 0:
            _GC["was_enabled"] = gc.isenabled()
            gc.disable()
        _GC["depth"] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC["depth"] -= 1
            if _GC["depth"] == 0 and _GC["was_enabled"]:
                gc.enable()


def load_json(data: bytes, where: str, *, nonfinite: bool = False, checked_by_caller: tuple[str, ...] = ()) -> dict:
    """``data`` as a JSON object, or ManifestError naming ``where`` and what is wrong.

    ``nonfinite=True`` reads the constants ``NaN``/``Infinity``/``-Infinity`` as floats: only for
    documents ckptkit itself once wrote with them (incident records before their floats were tagged),
    which a resume must still read. Numbers that overflow are refused either way.

    ``checked_by_caller``: top-level keys whose values the caller checks item by item for their exact
    types (an index's pieces), so the nesting walk skips them: a container nested where the caller
    wants an integer is refused by that check, and nothing recurses into them. Walking them cost a
    loading rank ~10 ms per index. The walk still covers them when the text holds a surrogate escape,
    since every string must then be checked."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{where}: not valid UTF-8 ({exc})") from None
    try:
        doc = json.loads(text, parse_constant=float if nonfinite else _reject_constant, parse_float=_finite_float,
                         object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ManifestError(f"{where}: JSON nested too deeply") from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected a JSON object")
    strings = _SURROGATE_ESCAPE.search(text) is not None
    if checked_by_caller and not strings:
        check_depth({k: v for k, v in doc.items() if k not in checked_by_caller}, where)
    else:
        check_depth(doc, where, strings=strings)
    return doc


# UTF-8 input cannot hold a surrogate; only a \\uD800-\\uDFFF escape can produce one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:80].encode('utf-8', 'backslashreplace').decode()!r} in an object")
        out[key] = value
    return out


def check_depth(doc: Any, where: str, limit: int = MAX_DEPTH, strings: bool = False) -> None:
    """ManifestError if containers nest deeper than ``limit`` (iterative: no recursion to blow),
    or, with ``strings``, if any key or string is not valid Unicode."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise ManifestError(f"{where}: JSON nested deeper than {limit} levels")
        if isinstance(node, dict):
            if strings:
                for k in node:
                    check_text(k, where)
            items = node.values()
        elif isinstance(node, list):
            items = node
        else:
            continue
        for v in items:
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
            elif strings and isinstance(v, str):
                check_text(v, where)


def check_text(s: str, where: str) -> str:
    """``s`` if it is valid Unicode; ManifestError for a lone surrogate (it cannot be encoded or shown)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        shown = s[:40].encode("utf-8", "backslashreplace").decode()
        raise ManifestError(f"{where}: string {shown!r} is not valid Unicode (a lone surrogate)") from None
    return s


def as_int(value: Any, where: str, minimum: int | None = None, maximum: int = MAX_LAYOUT_INT) -> int:
    """``value`` if it is a JSON integer within ``[minimum, maximum]``; else ManifestError."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"{where}: expected an integer, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise ManifestError(f"{where}: {value} is below {minimum}")
    if value > maximum:
        raise ManifestError(f"{where}: {_show(value)} is above the limit of {maximum}")
    return value


def as_ints(value: Any, where: str, minimum: int | None = None, maximum: int = MAX_LAYOUT_INT,
            max_len: int | None = None) -> tuple[int, ...]:
    items = as_list(value, where)
    if max_len is not None and len(items) > max_len:
        raise ManifestError(f"{where}: {len(items)} entries, at most {max_len} allowed")
    return tuple(as_int(v, where, minimum, maximum) for v in items)


def as_dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def as_list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ManifestError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def as_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _show(value: Any) -> str:
    """A short rendering of a hostile value (a 10**400 integer must not flood the message)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
