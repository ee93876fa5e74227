"""Skipping the update of a step whose loss or global gradient norm is not finite
(`CompileConfig(skip_nonfinite=True)`), without a GradScaler.

A NaN or inf loss (a bad batch, an overflow) would otherwise write NaN into every parameter
and moment, and the run is lost. Eagerly one would check `torch.isfinite(loss)` and the norm
and skip `optimizer.step()`; that is a data-dependent branch, which a captured graph cannot
take. Instead the step computes one flag in the graph and hands it to the fused update
kernels as their `found_inf`, the argument a GradScaler uses: a flagged step updates nothing
(parameters, moments, and Adam's step counter, which is counted back as torch.optim does),
and an unflagged one runs the same kernels on the same values, so it is exact. The decision
needs every gradient, so fused updates wait for it as they wait for global-norm clipping.
The flag is also an output of the graph; the compiled step sums it into `skipped_steps`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def backward_roots(args: tuple, kwargs: dict, key: str) -> list[Tensor]:
    """The tensors a `backward()` / `autograd.backward` / `autograd.grad` call differentiates."""
    roots = args[0] if args else kwargs.get(key)
    if isinstance(roots, Tensor):
        return [roots]
    return [t for t in (roots or ()) if isinstance(t, Tensor)]


def nonfinite_flag(losses: Sequence[Tensor], grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """A float32 scalar on `device`: 1 when a loss has a non-finite element or the global 2-norm
    of `grads` (computed in fp32, as `clip_grad_norm_` does; an fp64 gradient's in fp64, which
    `vector_norm` cannot narrow) is not finite, else 0."""
    bad = torch.zeros((), dtype=torch.bool, device=device)
    if grads:
        norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.promote_types(g.dtype, torch.float32)).to(device)
                 for g in grads]
        bad = bad | ~torch.isfinite(torch.linalg.vector_norm(torch.stack(norms), 2.0))
    for loss in losses:
        bad = bad | ~torch.isfinite(loss.detach()).all().to(device)
    return bad.to(torch.float32)
