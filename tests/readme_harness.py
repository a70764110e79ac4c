"""Helpers for tests/test_readme_examples.py: README.md's ```python blocks, run as written.

A block is parsed out of README.md by position (its index among the python blocks and the line its
first line of code is on) and executed statement by statement with ``exec`` in a namespace that
supplies what the fragment assumes (a model, an optimizer, ``train_step``, ...). Two things the
tests need beyond a bare ``exec``:

* ``hooks``: code of the test run between two statements of the block (e.g. "scramble the model
  after the save statement, so the load below must bring it back"), chosen by a substring of the
  statement they follow; a hook whose statement is not in the block fails the test.
* ``values``: the value of every expression statement (``ckpt.tensors("optim/*")``), by the
  statement's source, so a test can assert on what a line of the example returns.

Whatever a block needs that cannot exist on this machine is replaced by :func:`rewrite`, which
fails unless the text it replaces occurs exactly as often as the test expects: a README change
turns into a clear failure, never a rewrite that silently stopped applying.
"""

from __future__ import annotations

import ast
import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    index: int  # 0-based, among the README's ```python blocks
    line: int  # 1-based line of the block's first line of code
    heading: str  # the nearest heading above it
    source: str

    @property
    def first_line(self) -> str:
        return self.source.splitlines()[0].strip() if self.source.strip() else ""

    def where(self) -> str:
        return f"README.md:{self.line} (python block #{self.index}, under {self.heading!r})"


def python_blocks(path: Path | None = None) -> list[Block]:
    """Every ```python block of the README, in order."""
    lines = (path or README).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    heading, i = "(top)", 0
    while i < len(lines):
        text = lines[i]
        fence = _FENCE.match(text)
        if fence is None:
            if text.startswith("#"):
                heading = text.strip()
            i += 1
            continue
        lang, start = fence.group(2).lower(), i + 1
        end = start
        while end < len(lines) and not _FENCE.match(lines[end]):
            end += 1
        if lang in ("python", "py", "python3"):
            blocks.append(Block(len(blocks), start + 1, heading, "\n".join(lines[start:end]) + "\n"))
        i = end + 1
    return blocks


def text_before(block: Block, path: Path | None = None) -> str:
    """The README's text from the previous fence (or the top) up to ``block``: its introduction."""
    lines = (path or README).read_text(encoding="utf-8").splitlines()[: block.line - 2]
    out: list[str] = []
    for text in reversed(lines):
        if _FENCE.match(text):
            break
        out.append(text)
    return "\n".join(reversed(out))


def rewrite(source: str, old: str, new: str, *, count: int = 1, why: str) -> str:
    """Replace ``old`` by ``new`` in a block, failing unless ``old`` occurs exactly ``count`` times.

    ``why`` says what cannot exist here (it is in the failure message, and documents the rewrite)."""
    found = source.count(old)
    assert found == count, (f"README rewrite ({why}) expects {old!r} {count} time(s) in the block, found {found}: "
                            f"the README changed; update the rewrite in tests/test_readme_examples.py\n{source}")
    return source.replace(old, new)


@dataclass
class Run:
    ns: dict[str, Any]
    values: dict[str, Any] = field(default_factory=dict)  # an expression statement's source (no comment) -> its value


def exec_block(block: Block, source: str | None = None, ns: dict[str, Any] | None = None, *,
               hooks: dict[str, Callable[[dict[str, Any]], None]] | None = None) -> Run:
    """Execute ``source`` (default: the block as written) statement by statement in ``ns``.

    ``hooks[substring]`` runs after the first top-level statement whose source contains
    ``substring``; every hook must find its statement. Tracebacks name README.md and the block's
    real line numbers."""
    source = block.source if source is None else source
    ns = {"__name__": f"readme_block_{block.index}"} if ns is None else ns
    filename = f"README.md python block #{block.index}"  # tracebacks: at the README's own line numbers
    tree = ast.parse(source, filename=filename)
    ast.increment_lineno(tree, block.line - 1)
    pending = dict(hooks or {})
    run = Run(ns)
    readme_lines = source.splitlines()
    for stmt in tree.body:
        text = "\n".join(readme_lines[stmt.lineno - block.line: stmt.end_lineno - block.line + 1])
        try:
            if isinstance(stmt, ast.Expr):
                code = compile(ast.Expression(stmt.value), filename, "eval")
                run.values[_segment(readme_lines, stmt, block.line)] = eval(code, ns)  # noqa: S307 - README code
            else:
                exec(compile(ast.Module([stmt], type_ignores=[]), filename, "exec"), ns)  # noqa: S102
        except BaseException as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"raised at README.md:{stmt.lineno}, in {block.where()}:\n{text}")
            raise
        for key in [k for k in pending if k in text]:
            pending.pop(key)(ns)
    assert not pending, f"hooks for statements not in {block.where()}: {list(pending)}"
    return run


def _segment(lines: list[str], stmt: ast.stmt, first: int) -> str:
    """The statement's own source (no trailing comment); AST columns are UTF-8 byte offsets."""
    rows = [line.encode() for line in lines[stmt.lineno - first: stmt.end_lineno - first + 1]]
    rows[-1] = rows[-1][: stmt.end_col_offset]
    rows[0] = rows[0][stmt.col_offset:]
    return b"\n".join(rows).decode()


def split_imports(source: str) -> tuple[str, str]:
    """(the block's leading import statements, the rest), as source text of the same lines."""
    tree = ast.parse(source)
    lines = source.splitlines()
    n = 0
    for stmt in tree.body:
        if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
            break
        n = stmt.end_lineno or n
    return "\n".join(lines[:n]) + "\n", "\n" * n + "\n".join(lines[n:]) + "\n"  # same line numbers


@dataclass
class Call:
    name: str
    bound: inspect.BoundArguments

    @property
    def arguments(self) -> dict[str, Any]:
        return dict(self.bound.arguments)


def binding(fn: Callable[..., Any], calls: list[Call], name: str | None = None) -> Callable[..., Call]:
    """A stand-in for ``fn`` that binds its arguments to ``fn``'s real signature (TypeError if they do
    not bind), records the call in ``calls`` and returns the :class:`Call` instead of running ``fn``."""
    sig = inspect.signature(fn)

    def bind(*args: Any, **kwargs: Any) -> Call:
        call = Call(name or fn.__name__, sig.bind(*args, **kwargs))
        calls.append(call)
        return call

    return bind


class BindingModule(types.ModuleType):
    """Stands in for an adapter module whose functions need a live framework (a DeepSpeed engine, a
    Megatron model): each function is replaced by :func:`binding` of it, recording into ``calls``.
    Everything else (classes, dataclass options, constants) is the real object."""

    def __init__(self, real: types.ModuleType, calls: list[Call]) -> None:
        super().__init__(real.__name__)
        self._real = real
        self.calls = calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)  # AttributeError: the README names something that does not exist
        return binding(value, self.calls, name) if inspect.isfunction(value) else value
