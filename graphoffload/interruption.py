"""What an interrupted step leaves behind, and refusing to train on it.

With updates fused into backward, the last layers' parameters and optimizer state are updated
before the first layers' gradients exist. An exception part-way through backward (an
out-of-memory error, KeyboardInterrupt, a failing CPU worker, a collective timing out) leaves
some parameters updated and others not, which eager PyTorch never does. Holding every update
back until backward ends would cost the memory the fusion saves, so instead the step finds out
what changed (the version counters of the parameters and optimizer state, which every in-place
write bumps) and, if anything did, refuses to run again until the user restores the model and
the optimizer or accepts the partial update. An error before any update (in forward, or in
backward before the first fused update) changed nothing and is re-raised as it is.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from graphoffload.errors import StateError, describe


@dataclass(frozen=True)
class Snapshot:
    """Version counters of the tensors a step may update, taken before it runs."""

    params: tuple[tuple[str, Tensor, int], ...]
    state: tuple[tuple[str, Tensor, int], ...]

    @staticmethod
    def take(bindings: Any) -> Snapshot:
        names = {id(p): n for n, p in bindings.params.items()}
        # a ZeRO stage 3 parameter is a DTensor: the step writes its local rows
        params = tuple((n, w, w._version) for n, p in bindings.params.items()
                       for w in [p.detach().to_local() if isinstance(p, DTensor) else p])
        state = tuple((f"{names.get(id(p), '?')}.{key}", watched, watched._version)
                      for opt in bindings.optimizers for p, s in opt.state.items()
                      for key, t in s.items() if isinstance(t, Tensor)
                      for watched in [Snapshot._witness(p, t)])
        return Snapshot(params, state)

    @staticmethod
    def _witness(param: Tensor, state: Tensor) -> Tensor:
        """The tensor whose version counter tells whether `state` was written. A view (offloaded
        state lives in views of one host arena) shares its base's counter with every other view,
        so any bucket's host update would move it; its parameter's counter moves instead exactly
        when that bucket's update is uploaded, which follows its host update within the step."""
        return param if state._base is not None else state

    def changed(self) -> list[str]:
        """Parameters (and `param.state_key` optimizer state) written since the snapshot."""
        return [n for n, t, v in (*self.params, *self.state) if t._version != v]


class InterruptionGuard:
    """Per compiled step: remembers an interruption that left a partial update and clears it
    when every model and optimizer the step drives has been restored with `load_state_dict`
    (or the step's `load_state_dict` restored the optimizers), or on `accept()`."""

    def __init__(self) -> None:
        self.updated: list[str] = []
        self.cause = ""
        self._pending: set[int] = set()
        self._handles: list[Any] = []

    def interrupted(self, exc: BaseException, updated: list[str], bindings: Any, step_name: str) -> str:
        self.updated = updated
        self.cause = describe(exc)
        self._pending = {id(o) for o in (*bindings.modules, *bindings.optimizers)}
        ref = weakref.ref(self)

        def restored(obj: Any, *_: Any) -> None:
            guard = ref()
            if guard is not None:
                guard.restored(obj)
        for obj in (*bindings.modules, *bindings.optimizers):
            if isinstance(obj, torch.nn.Module):
                self._handles.append(obj.register_load_state_dict_post_hook(
                    lambda module, _keys, obj=obj: restored(obj)))
            else:
                self._handles.append(obj.register_load_state_dict_post_hook(lambda opt: restored(opt)))
        return self.message(step_name)

    def shown(self) -> str:
        """The tensors the interrupted step changed, the first eight by name."""
        return ", ".join(self.updated[:8]) + (f" and {len(self.updated) - 8} more" if len(self.updated) > 8 else "")

    def message(self, step_name: str) -> str:
        return (f"{step_name} was interrupted part-way ({self.cause}) after its fused optimizer updates had "
                f"changed {self.shown()}; the rest of the model and optimizer were not updated. Restore the model "
                "and optimizer from a checkpoint (their load_state_dict, or the step's for the optimizers) "
                "and retry, or call step.accept_partial_update() to train on as they are")

    @property
    def active(self) -> bool:
        return bool(self.updated)

    def restored(self, obj: Any) -> None:
        self._pending.discard(id(obj))
        if not self._pending:
            self.clear()

    def restored_optimizers(self, optimizers: Any) -> None:
        for opt in optimizers:
            self.restored(opt)

    def clear(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()
        self.updated = []
        self.cause = ""

    def check(self, step_name: str) -> None:
        if self.active:
            raise StateError("refusing to run: " + self.message(step_name))
