"""How DCP's flattened keys and ckptkit's keys correspond, in both directions.

DCP flattens a nested state dict into dotted keys and records, per key, the
*path* it came from (``planner_data``): ``{"model": {"layers.0.wq.weight": t}}``
is stored as ``model.layers.0.wq.weight`` with path ``("model",
"layers.0.wq.weight")``; ``optim.param_groups.0.lr`` has path ``("optim",
"param_groups", 0, "lr")`` (an int is a list index). A ckptkit key is the
same path, its parts joined with ``/`` (``model/layers.0.wq.weight``). So the
mapping is the path, never a guess at which dots separate keys:

* **import**: tensor key = the path joined with ``/`` (``%`` and ``/`` inside a
  part percent-escaped, as everywhere in ckptkit). Non-tensor items are put
  back into the nested structure their paths describe (ints make lists) and
  then named exactly as ``ckptkit.save`` names that structure's values: DCP
  stores each ``param_groups`` entry field by field, ckptkit stores the
  tensor-free list ``optim/param_groups`` as one value. An imported
  checkpoint therefore has the keys ``ckptkit.save`` of the same state dict
  would have written, and ``ckptkit.load`` fills that state dict directly.
  Without a usable ``planner_data`` (a state dict saved already flat, a
  custom planner) every key is one path part: ``tok_embeddings.weight``
  stays ``tok_embeddings.weight``.
* **export**: path = the ckptkit key split at ``/``; DCP key = the path
  joined with ``.``; values are flattened as DCP's own planner flattens them
  (dicts always, lists only when they hold dicts or lists that are not
  flat; tuples are leaves). An empty dict, which DCP's flattening would drop,
  is stored as a leaf so it survives a round trip. DCP turns dict keys into
  strings; so does this.

Round trips are exact: DCP -> ckptkit -> DCP gives the same DCP keys (and the
same paths, except that a list index in the path of a *tensor* comes back as
a string part: ckptkit keys do not say whether a part was a list index), and
ckptkit -> DCP -> ckptkit gives the same keys and values. Two ckptkit keys
that would meet in one DCP key (``a/b.c`` and ``a.b/c``) make the export fail.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ckptkit.engine.state import flatten_state
from ckptkit.errors import LayoutError, ManifestError
from ckptkit.layout.values import split_key

PathItem = str | int
ObjPath = tuple[PathItem, ...]


def dcp_key(path: ObjPath) -> str:
    """DCP's flattened key of a path (how ``flatten_state_dict`` names it)."""
    return ".".join(map(str, path))


# ---------------------------------------------------------------- import


class _Node(dict):  # an inner node of the structure being rebuilt (a dict *value* stays a plain dict)
    pass


_MISSING = object()


def import_keys(tensor_paths: Mapping[str, ObjPath], value_paths: Mapping[str, tuple[ObjPath, Any]],
                where: str) -> tuple[dict[str, str], dict[str, Any]]:
    """ckptkit names for an imported checkpoint.

    ``tensor_paths``: DCP key -> path of each tensor; ``value_paths``: DCP key ->
    (path, decoded value) of each non-tensor item (values must hold no tensors).
    Returns (DCP key -> ckptkit key of each tensor, ckptkit key -> value).
    """
    root = _Node()
    marks: dict[int, str] = {}
    for fqn, path in tensor_paths.items():
        mark = torch.empty(0)
        marks[id(mark)] = fqn
        _place(root, path, mark, fqn, where)
    for fqn, (path, value) in value_paths.items():
        _place(root, path, value, fqn, where)
    flat = flatten_state(_plain(root, where))
    keys = {marks[id(leaf.obj)]: leaf.key for leaf in flat.tensors}
    if len(keys) != len(tensor_paths):  # pragma: no cover - every mark is a leaf of its own
        raise ManifestError(f"{where}: tensor keys could not be mapped one to one")
    return keys, {leaf.key: leaf.obj for leaf in flat.values}


def _place(root: _Node, path: ObjPath, obj: Any, fqn: str, where: str) -> None:
    node = root
    for part in path[:-1]:
        child = node.get(part, _MISSING)
        if child is _MISSING:
            child = node[part] = _Node()
        elif not isinstance(child, _Node):
            raise ManifestError(f"{where}: item {fqn!r} lies inside item {dcp_key(path[:path.index(part) + 1])!r}")
        node = child
    if path[-1] in node:
        raise ManifestError(f"{where}: item {fqn!r} collides with another item at path {list(path)}")
    node[path[-1]] = obj


def _plain(node: _Node, where: str) -> Any:
    """Inner nodes -> dicts, or lists where every part is a list index (DCP's ``set_element``
    pads missing indices with None)."""
    items = {k: _plain(v, where) if isinstance(v, _Node) else v for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items):
        out: list[Any] = [None] * (max(items) + 1)
        for k, v in items.items():
            out[k] = v
        return out
    plain: dict[str, Any] = {}
    for k, v in items.items():
        if str(k) in plain:
            raise ManifestError(f"{where}: path parts {k!r} and {str(k)!r} collide")
        plain[str(k)] = v
    return plain


# ---------------------------------------------------------------- export


def export_path(key: str) -> ObjPath:
    """The DCP path of a ckptkit key: its ``/``-separated parts, unescaped."""
    return split_key(key)


def value_leaves(key: str, value: Any) -> list[tuple[ObjPath, Any]]:
    """The DCP items a ckptkit value becomes: (path, leaf) pairs, flattened as DCP flattens."""
    out: list[tuple[ObjPath, Any]] = []
    _traverse(export_path(key), value, out)
    return out


def _traverse(path: ObjPath, value: Any, out: list[tuple[ObjPath, Any]]) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _traverse((*path, str(k)), v, out)
    elif isinstance(value, list) and not _is_terminal(value):
        for i, v in enumerate(value):
            _traverse((*path, i), v, out)
    else:
        out.append((path, value))


def _is_terminal(value: list[Any]) -> bool:
    """DCP's rule (``traverse_state_dict``): a list is a leaf unless it holds a dict or a non-leaf list."""
    return not any(isinstance(v, Mapping) or (isinstance(v, list) and not _is_terminal(v)) for v in value)


def check_unique(named: Iterable[tuple[str, str]], where: str) -> None:
    """Refuse two ckptkit keys that become one DCP key. ``named``: (ckptkit key, DCP key) pairs."""
    seen: dict[str, str] = {}
    for key, fqn in named:
        other = seen.setdefault(fqn, key)
        if other != key:
            raise LayoutError(f"{where}: keys {other!r} and {key!r} would both be DCP key {fqn!r}; rename one")

