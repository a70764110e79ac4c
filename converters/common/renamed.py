"""Keywords renamed in this release, still accepted for one more with a DeprecationWarning.

One name along one path: Megatron-LM's own argument is ``make_vocab_size_divisible_by`` (the first
converters called it ``divisible_by``), and the ZeRO stage is ``zero_stage`` as DeepSpeed's files
say it (some functions called it ``stage``). Scripts written against the old keywords must keep
running for one release (the public API is a promise), and must hear, by name, what to write
instead. A decorator keeps each function's own signature the new one (``help()`` and
``inspect.signature`` show it) and the compatibility in one place, to delete after the release.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def renamed_keyword(old: str, new: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Accept ``old=`` as ``new=`` (warning that names ``new``); both at once is a :class:`TypeError`,
    as two values for one parameter are in Python."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{function.__qualname__}() got both {old}= and {new}=; pass {new}= only")
                warnings.warn(f"{function.__qualname__}({old}=...) is deprecated and will be removed in the next "
                              f"release: pass {new}=... instead",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return call

    return decorate


divisible_by_renamed = renamed_keyword("divisible_by", "make_vocab_size_divisible_by")
"""Megatron's padding multiple: ``divisible_by=`` -> ``make_vocab_size_divisible_by=``."""

zero_stage_renamed = renamed_keyword("stage", "zero_stage")
"""DeepSpeed's ZeRO stage: ``stage=`` -> ``zero_stage=``."""
