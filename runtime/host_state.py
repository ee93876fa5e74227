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

Under ZeRO (`data_parallel=`) a rank offloads its own dim-0 chunk of every parameter: its state
and master weights are chunk-sized host tensors, and `optimizer.state` holds them as the
`Shard(0)` DTensors the step keeps without offload (their local tensors are the host tensors the
graph reads and writes); the master weights mirror the rank's rows of the parameter (stage 3:
the rows the parameter's DTensor holds, which the uploads write).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from graphoffload.data_parallel import ZeRO, as_shard, local_chunk
from graphoffload.errors import StateError
from graphoffload.graph import InputSpec
from graphoffload.runtime.host_arena import HostArena


class HostState:
    def __init__(self, bindings, pin_memory: bool, zero: ZeRO | None = None):
        self.bindings = bindings
        self.pin = pin_memory
        self.zero = zero              # ZeRO: state and master weights of this rank's chunks
        self._mesh: Any = None
        self.scratch: dict[tuple[str, str], Tensor] = {}
        self.versions: dict[str, int] = {}
        self.arena = HostArena(pin_memory)

    def _mirrored(self, param: Tensor) -> Tensor:
        """What the master weights of `param` mirror: the parameter, or under ZeRO this rank's rows."""
        p = param.detach()
        return p if self.zero is None else local_chunk(p, self.zero.world_size, self.zero.rank)

    def _as_state(self, placed: Tensor, param: Tensor, key: str) -> Tensor:
        """What `optimizer.state` holds for a host tensor: itself, or under ZeRO this rank's
        chunk as a `Shard(0)` DTensor (the step counter and a 0-dim parameter's state stay plain,
        as `data_parallel.shard_state` keeps them)."""
        if self.zero is None or key == "step" or param.dim() == 0:
            return placed
        if self._mesh is None:
            self._mesh = self.zero.device_mesh(self.bindings.device.type)
        return as_shard(placed, param, self._mesh)

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
                missing = not self._is_placed(_local(self.bindings.optimizer_of(name).state[param].get(key)), like)
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
        existing = _local(state.get(key))   # a DTensor under ZeRO: the graph reads its local chunk
        if key == "master_param" and existing is not None and _narrower(existing.dtype, like.dtype):
            raise StateError(
                f"optimizer state of parameter {name!r}: its master weights ('master_param') are "
                f"{existing.dtype}, but this step keeps them {like.dtype}, so they were rounded, most likely "
                f"by optimizer.load_state_dict(...) (or DCP's set_optimizer_state_dict) before the step "
                f"compiled: torch casts loaded state to the parameters' dtype. Load it again exactly with "
                f"step.load_state_dict({{'optimizers': [saved]}}, optimizers=[optimizer]) (or, with a fresh "
                f"optimizer, call optimizer.load_state_dict after step.compile(...)); nothing was trained "
                f"from the rounded values")
        source = existing
        if key == "master_param" and (existing is None or (
                name not in in_flight and self._changed_outside(name, param, existing))):
            source = self._mirrored(param)   # new, or the parameter changed outside the step: mirror it again
        if self._is_placed(existing, like):
            if source is not existing:   # master weights mirrored again: in place, no new allocation
                existing.copy_(source)
            return existing
        placed = self._empty(like)
        placed.copy_(source)
        state[key] = self._as_state(placed, param, key)
        return placed

    def _changed_outside(self, name: str, param: Tensor, master: Tensor) -> bool:
        """Whether the parameter no longer holds its master weights rounded to its dtype. Its
        version counter moving is not enough: another compiled variant of the step (a new input
        shape) uploads it too, and a resumed checkpoint loads parameters and master weights
        together; mirroring the low-precision parameter then would drop the fp32 master bits."""
        if self.versions.get(name) == _version(param):
            return False
        mirrored = self._mirrored(param)
        return master.shape != mirrored.shape or not torch.equal(
            master.to(device=param.device, dtype=param.dtype), mirrored)

    def record_versions(self, skip: set[str] = frozenset()) -> None:
        """Remember each offloaded parameter's version after the step's own upload (not yet for
        those in `skip`, whose upload is still in flight)."""
        for name, param in self.bindings.params.items():
            if name not in skip:
                self.versions[name] = _version(param)


def _version(param: Tensor) -> int | tuple[int, int]:
    """What moves when the parameter is changed outside the step. A DTensor (a ZeRO stage 3
    step's rows) has two counters: its own, which its ops move (`mul_`, `copy_` from
    `set_model_state_dict`), and its local tensor's, which writes through `to_local()` move (the
    step's uploads write through another alias and move neither)."""
    if isinstance(param, DTensor):
        with torch.no_grad():   # (under grad mode to_local() gives a view no one may write)
            return param._version, param.to_local()._version
    return param._version


def _local(t: Tensor | None) -> Tensor | None:
    """A ZeRO state DTensor's local chunk (a view of it: writes land in it); other tensors as they are."""
    return t.to_local() if isinstance(t, DTensor) else t


def _narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether floating `dtype` holds fewer bits than `than` (bf16 or fp16 master weights where the
    step keeps fp32 ones: a load cast them, their low bits are gone)."""
    return dtype.is_floating_point and than.is_floating_point and torch.finfo(dtype).bits < torch.finfo(than).bits
