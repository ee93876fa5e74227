"""Meta kernels for torch's fused optimizer ops, which ship none.

Without them, tracing an update with fake tensors falls back to running the real kernel on
real, zero-filled copies of every argument: on a GPU that allocates the parameters, gradients
and optimizer state for real while tracing (what graphoffload exists to avoid), and on the meta
device it fails. The ops update their arguments in place and return nothing, so the meta
kernel checks the lists line up and does nothing else.
"""

from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("aten", "IMPL")   # kept alive for the registrations' lifetime


def _check_lists(name: str, *lists) -> None:
    sizes = {len(lst) for lst in lists if len(lst)}
    if len(sizes) > 1:
        raise RuntimeError(f"{name}: tensor lists of different lengths {sorted(sizes)}")


def _adam_meta(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **_):
    _check_lists("_fused_adam(w)_", self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)


def _sgd_meta(self, grads, momentum_buffer_list, **_):
    _check_lists("_fused_sgd_", self, grads, momentum_buffer_list)


for _op, _kernel in (("_fused_adamw_", _adam_meta), ("_fused_adam_", _adam_meta), ("_fused_sgd_", _sgd_meta)):
    for _overload in getattr(torch.ops.aten, _op).overloads():
        _name = f"{_op}.{_overload}" if _overload != "default" else _op
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta"):
            _LIBRARY.impl(_name, _kernel, "Meta")
