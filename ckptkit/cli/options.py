"""The option types and options every command shares, parsed one way everywhere.

* :data:`SIZE` — ``4GiB``, ``512MiB``, ``2G``, ``1.5g`` or a byte count (binary units) -> int;
* :data:`LAYOUT` — ``tp4pp2``, ``tp2pp2dp4``, ``tp1pp4vpp2`` -> :class:`~ckptkit.layout.config.ParallelConfig`;
* :data:`LAYER_COUNTS` — ``15,17`` -> ``(15, 17)``;
* :class:`FiniteRange` — a number in a range, never ``nan`` or ``inf``;
* :data:`KEY_VALUE` — ``KEY=VALUE`` (the value parsed as JSON when it is JSON, else a string);
* decorators: :func:`json_option` (``--json``), :func:`storage_option` (``--storage-option``,
  repeatable, collected into one dict or None), :func:`threads_option`,
  :func:`megatron_facts_options` (``--vocab-size``, ``--divisible-by``).

Only click is imported here (and the torch-free layout parser when a layout is parsed), so
``ckptkit --help`` and the metadata commands start fast.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from ckptkit import ParallelConfig

F = TypeVar("F", bound=Callable[..., Any])

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class FiniteRange(click.FloatRange):
    """click's ``FloatRange`` that also refuses ``nan`` and ``inf``: both pass a range's bounds (a
    comparison with NaN is false), and later failed as a ckptkit bug (exit 3) where the value was
    turned into a byte count (``--chunk-mib nan``), or printed a "nan min" interval (``plan``)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def parse_size(text: str) -> int:
    """``1GiB``, ``512MiB``, ``2G``, ``1.5g``, ``64KiB`` or a byte count; binary units (GB means GiB here)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 1GiB, 512MiB, 2G, or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class ByteSize(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Layout(click.ParamType):
    name = "layout"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> ParallelConfig:
        from ckptkit import LayoutError, ParallelConfig

        if isinstance(value, ParallelConfig):
            return value
        try:
            return ParallelConfig.parse(str(value))
        except LayoutError as exc:
            self.fail(str(exc), param, ctx)


class LayerCounts(click.ParamType):
    name = "counts"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            counts = tuple(int(x) for x in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of layer counts (e.g. 15,17)", param, ctx)
        return counts


class KeyValue(click.ParamType):
    name = "key=value"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, Any]:
        if isinstance(value, tuple):
            return value
        key, sep, raw = str(value).partition("=")
        if not sep or not key.strip():
            self.fail(f"{value!r} is not KEY=VALUE (e.g. endpoint_url=http://localhost:9000, anon=true)", param, ctx)
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw
        return key.strip(), parsed


SIZE = ByteSize()
LAYOUT = Layout()
LAYER_COUNTS = LayerCounts()
KEY_VALUE = KeyValue()


def _as_dict(ctx: click.Context, param: click.Parameter, pairs: tuple[tuple[str, Any], ...]) -> dict[str, Any] | None:
    return dict(pairs) if pairs else None


def json_option(f: F) -> F:
    """``--json``: one JSON document on stdout instead of text (errors still go to stderr)."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of text.")(f)


def storage_option(f: F) -> F:
    """``--storage-option KEY=VALUE`` (repeatable) -> ``storage_options``: a dict, or None."""
    return click.option(
        "--storage-option", "storage_options", type=KEY_VALUE, multiple=True, callback=_as_dict, metavar="KEY=VALUE",
        help="Option for the byte store of s3:// URLs (s3fs's, plus io_engine=native|tensorstore); repeatable; "
             "values are JSON when they parse (anon=true, client_kwargs='{\"region_name\": \"us-east-1\"}').")(f)


def threads_option(default: int | None, help: str) -> Callable[[F], F]:
    def wrap(f: F) -> F:
        return click.option("--threads", type=click.IntRange(1, 64), default=default,
                            show_default=default is not None, help=help)(f)
    return wrap


def megatron_facts_options(f: F) -> F:
    """``--vocab-size`` and ``--divisible-by``: what a Megatron import needs when its args do not say."""
    f = click.option("--divisible-by", type=click.IntRange(min=1), default=None,
                     help="Megatron: make_vocab_size_divisible_by, when the checkpoint's args do not record it "
                          "(export: re-pad the vocabulary to this multiple instead).")(f)
    return click.option("--vocab-size", type=click.IntRange(min=1), default=None,
                        help="Megatron import: the true vocabulary size, when the checkpoint's args do not record "
                             "it (Megatron-LM keeps only the padded one unless --vocab-size was given to it).")(f)
