"""The running gradient sums of `offload_compile(..., accumulation_steps=k)`.

Called once per micro-batch, the step adds each gradient (scaled by 1/k) into a persistent
buffer and updates from it on every k-th call. The buffers outlive every call and are shared by
the step's two compiled variants (accumulate; accumulate and update), so they are held here,
by the step, and enter each graph as `grad_sum` placeholders the graph mutates in place.
Each is allocated once, on the parameter's device, zero-filled, the first time a graph needs it:
the update variant leaves it zeroed again for the next window, so it is never reallocated.
It is a plain tensor shaped like the whole parameter, also when ZeRO stage 3 holds the parameter
as a `Shard(0)` DTensor of this rank's rows (passes/zero.py says why the sums stay whole).
With `Offload(accumulate_on="host")` a sum lives in host memory in fp32 instead (pinned when the
parameter is on a GPU, so the copies into it are asynchronous): the graphs mark those
placeholders `host`, and the buffer is made there once. Under ZeRO a host sum holds only this
rank's chunk of the reduced gradient (dim-0 rows, as `data_parallel.shard_rows` cuts them: the
`zero` pass reduce-scatters every micro-batch's gradients before they reach it), so the buffer
is shaped as the graph's placeholder says, not as the parameter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphoffload.errors import StateError


def _shape_error(name: str, t: Tensor, shape: torch.Size) -> StateError:
    return StateError(f"the running gradient sum of {name} has shape {tuple(t.shape)} but the step's is "
                      f"{tuple(shape)} (the parameter's, or under ZeRO with host sums this rank's chunk of it): was "
                      "the accumulation window loaded from another model's checkpoint, or another rank's or world "
                      "size's? Load a matching one")


class GradSums:
    """Parameter name -> its gradient's running sum over the current accumulation window."""

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = {}

    def tensor(self, name: str, param: Tensor, on_host: bool = False, shape: torch.Size | None = None) -> Tensor:
        """The buffer of `name` (allocated as zeros like `param` on first use; `on_host`: as
        fp32 zeros in host memory, pinned when `param` is on a GPU). `shape`: the buffer's shape
        when it is not the parameter's (a ZeRO rank's chunk of a host sum)."""
        t = self._sums.get(name)
        if on_host:
            return self._host_tensor(name, param, t, param.shape if shape is None else torch.Size(shape))
        if t is None:
            # a plain tensor of the whole parameter's shape, also for a ZeRO stage 3 parameter (a
            # `Shard(0)` DTensor): each rank sums its own micro-batches' whole gradients until the
            # updating call reduce-scatters them (passes/zero.py)
            t = self._sums[name] = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
        elif t.shape != param.shape:
            raise _shape_error(name, t, param.shape)
        elif t.device != param.device or t.dtype != param.dtype:   # e.g. loaded from a CPU checkpoint
            t = self._sums[name] = t.to(param.device, param.dtype, memory_format=torch.contiguous_format)
        return t

    def _host_tensor(self, name: str, param: Tensor, t: Tensor | None, shape: torch.Size) -> Tensor:
        pin = param.device.type == "cuda"
        if t is not None and t.shape != shape:
            raise _shape_error(name, t, shape)
        if t is None or t.device.type != "cpu" or t.dtype != torch.float32 or (pin and not t.is_pinned()):
            placed = torch.zeros(shape, dtype=torch.float32, pin_memory=pin)
            if t is not None:   # loaded from a checkpoint, or was on the device
                placed.copy_(t)
            t = self._sums[name] = placed
        return t

    def discard(self, names: set[str]) -> None:
        """Free the buffers of parameters no graph reads (those without a gradient)."""
        for name in names:
            self._sums.pop(name, None)

    def state_dict(self) -> dict[str, Tensor]:
        """Copies in host memory (a checkpoint need not hold a second gradient set on the device)."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self._sums.items()}

    def load_state_dict(self, sums: dict[str, Tensor]) -> None:
        for name, value in sums.items():
            if name in self._sums and self._sums[name].shape == value.shape:
                self._sums[name].copy_(value)
            else:
                self._sums[name] = value.detach().clone()
        for name in set(self._sums) - set(sums):
            self._sums[name].zero_()
