"""The running gradient sums of `offload_compile(..., accumulation_steps=k)`.

Called once per micro-batch, the step adds each gradient (scaled by 1/k) into a persistent
buffer and updates from it on every k-th call. The buffers outlive every call and are shared by
the step's two compiled variants (accumulate; accumulate and update), so they are held here,
by the step, and enter each graph as `grad_sum` placeholders the graph mutates in place.
Each is allocated once, on the parameter's device, zero-filled, the first time a graph needs it:
the update variant leaves it zeroed again for the next window, so it is never reallocated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphoffload.errors import StateError


class GradSums:
    """Parameter name -> its gradient's running sum over the current accumulation window."""

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = {}

    def tensor(self, name: str, param: Tensor) -> Tensor:
        """The buffer of `name` (allocated as zeros like `param` on first use)."""
        t = self._sums.get(name)
        if t is None:
            t = self._sums[name] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        elif t.shape != param.shape:
            raise StateError(f"the running gradient sum of {name} has shape {tuple(t.shape)} but the parameter "
                             f"{tuple(param.shape)}: was the accumulation window loaded from another model's "
                             "checkpoint? Load a matching one")
        elif t.device != param.device or t.dtype != param.dtype:   # e.g. loaded from a CPU checkpoint
            t = self._sums[name] = t.to(param.device, param.dtype, memory_format=torch.contiguous_format)
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
