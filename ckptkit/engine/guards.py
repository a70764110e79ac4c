"""Guards: the optimizers whose ``step`` waits at an overlapped snapshot's gate.

``AsyncOptions(snapshot="overlap")`` lets ``save`` return before the state is
copied; the first change of the state must wait for the copy. A guard is any
object with torch's ``register_step_pre_hook`` (every ``torch.optim.Optimizer``,
fused and foreach ones included, and torchtitan's optimizer containers): its hook
calls the saver's gate before each ``step``, ahead of the optimizer's other step
pre-hooks (which may change the state). When no snapshot is pending the hook
costs one attribute read. The hook holds the saver weakly, so an optimizer that
outlives its saver keeps nothing alive, and closing the saver removes the hooks.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ckptkit.errors import OptionsError


class Guards:
    """The hooked optimizers of one saver (each hooked once, however often it is added)."""

    def __init__(self, gate: Callable[[], None]) -> None:
        self._gate = weakref.WeakMethod(gate)  # type: ignore[arg-type]
        self._hooks: dict[int, tuple[weakref.ref[Any] | None, Any]] = {}
        self._every_optimizer: Any = None  # the global step pre-hook's handle (see add)

    def __bool__(self) -> bool:
        return any(ref is None or ref() is not None for ref, _ in self._hooks.values())

    def add(self, *optimizers: Any) -> None:
        """Hook each optimizer's ``step``; refuse anything without ``register_step_pre_hook``. Every other
        ``torch.optim.Optimizer`` of the process waits at the gate too (a global step pre-hook): an
        optimizer not named as a guard changed the state during the copy, and one with fused kernels
        (``fused=True``) does so without moving the version counters, so its race was committed silently
        (found by a hunt, 2026-12-06)."""
        if self._every_optimizer is None and any(opt is not None for opt in optimizers):
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            gate = self._gate

            def every_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
                fn = gate()
                if fn is not None:
                    fn()

            self._every_optimizer = register_optimizer_step_pre_hook(every_step)
        for opt in optimizers:
            if opt is None:
                continue
            register = getattr(opt, "register_step_pre_hook", None)
            if not callable(register):
                raise OptionsError(
                    f"cannot guard an overlapped snapshot with {type(opt).__name__}: it has no register_step_pre_hook "
                    "(a torch.optim.Optimizer has one). Megatron, DeepSpeed and torchtitan objects: use their "
                    "ckptkit adapter, which hooks the torch optimizers inside (docs/overlap.md)")
            if id(opt) in self._hooks and self._alive(id(opt)):
                continue
            gate = self._gate

            def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
                fn = gate()
                if fn is not None:
                    fn()

            try:
                ref: weakref.ref[Any] | None = weakref.ref(opt)
            except TypeError:
                ref = None
            handle = register(hook)
            # first among the optimizer's pre-hooks: another may change the state (torchtitan's MoE
            # load balancing updates expert_bias in one), and must come after the copy
            hooks = getattr(opt, "_optimizer_step_pre_hooks", None)
            if isinstance(hooks, OrderedDict) and handle.id in hooks:
                hooks.move_to_end(handle.id, last=False)
            self._hooks[id(opt)] = (ref, handle)

    def _alive(self, key: int) -> bool:
        ref = self._hooks[key][0]
        return ref is None or ref() is not None

    def remove_all(self) -> None:
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        if self._every_optimizer is not None:
            self._every_optimizer.remove()
            self._every_optimizer = None
