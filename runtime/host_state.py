"""Where offloaded tensors live: optimizer state moved to (pinned) host memory, fp32 master
weights, and the host scratch buffers transfers land in.

Offloaded state stays in `optimizer.state`, so `optimizer.state_dict()` shows it; it is moved
to the host the first time a compiled step needs it there, and again whenever something (for
instance `optimizer.load_state_dict`, which casts state to each parameter's device) put it
back on the device. The master weights (`state["master_param"]`) mirror the device
parameters: they are created from them, and refreshed from them when the parameter was changed
outside the compiled step (its version counter moved and it no longer equals the master
weights in its own dtype). Scratch buffers are allocated once. Every host tensor is a view into
a `HostArena` (runtime/host_arena.py): before a run, the tensors it is about to place are
reserved together, so they take one allocation of their exact size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphoffload.graph import InputSpec
from graphoffload.runtime.host_arena import HostArena


class HostState:
    def __init__(self, bindings, pin_memory: bool):
        self.bindings = bindings
        self.pin = pin_memory
        self.scratch: dict[tuple[str, str], Tensor] = {}
        self.versions: dict[str, int] = {}
        self.arena = HostArena(pin_memory)

    def _empty(self, like: Tensor) -> Tensor:
        return self.arena.empty(like.shape, like.dtype)

    def _is_placed(self, t: Tensor | None, like: Tensor) -> bool:
        return (t is not None and t.device.type == "cpu" and t.dtype == like.dtype and t.shape == like.shape
                and self.arena.holds(t))

    def reserve(self, inputs: list[tuple[InputSpec, Tensor]]) -> None:
        """Make room in one allocation for the host tensors of `inputs` (host specs with their
        meta vals) that are not in place yet: on the first run, all of them."""
        needed = []
        for spec, like in inputs:
            if spec.kind == "host_scratch":
                missing = spec.target not in self.scratch
            else:
                name, key = spec.target
                param = self.bindings.params[name]
                missing = not self._is_placed(self.bindings.optimizer_of(name).state[param].get(key), like)
            if missing:
                needed.append((like.shape, like.dtype))
        self.arena.reserve(needed)

    def tensor(self, spec: InputSpec, like: Tensor, in_flight: set[str] = frozenset()) -> Tensor:
        """The host tensor for a placeholder, placed as the graph expects (`like`: its meta val).
        `in_flight`: parameters the last step's upload may still be writing; their version
        counters move by that upload, not by an outside change."""
        if spec.kind == "host_scratch":
            if spec.target not in self.scratch:
                self.scratch[spec.target] = self._empty(like)
            return self.scratch[spec.target]
        name, key = spec.target
        param = self.bindings.params[name]
        state = self.bindings.optimizer_of(name).state[param]
        current = state.get(key)
        if key == "master_param" and (current is None or (
                name not in in_flight and self._changed_outside(name, param, current))):
            current = None    # new, or the parameter changed outside the step: mirror it again
            source = param.detach()
        else:
            source = current
        existing = state.get(key)
        if self._is_placed(existing, like):
            if source is not existing:   # master weights mirrored again: in place, no new allocation
                existing.copy_(source)
            return existing
        placed = self._empty(like)
        placed.copy_(source)
        state[key] = placed
        return placed

    def _changed_outside(self, name: str, param: Tensor, master: Tensor) -> bool:
        """Whether the parameter no longer holds its master weights rounded to its dtype. Its
        version counter moving is not enough: another compiled variant of the step (a new input
        shape) uploads it too, and a resumed checkpoint loads parameters and master weights
        together; mirroring the low-precision parameter then would drop the fp32 master bits."""
        if self.versions.get(name) == param._version:
            return False
        return master.shape != param.shape or not torch.equal(
            master.to(device=param.device, dtype=param.dtype), param.detach())

    def record_versions(self, skip: set[str] = frozenset()) -> None:
        """Remember each offloaded parameter's version after the step's own upload (not yet for
        those in `skip`, whose upload is still in flight)."""
        for name, param in self.bindings.params.items():
            if name not in skip:
                self.versions[name] = param._version
