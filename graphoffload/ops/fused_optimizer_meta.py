"""torch's fused optimizer ops as the IR knows them: which ops they are, and their meta kernels.

`FUSED_UPDATE_OPS` is the one list of the update kernels graphoffload lowers optimizers to;
capture finds the update nodes with `is_fused_update`, and passes/update_kernels.py keeps one
rule per op of this list (a test holds the two to the same ops).

torch ships no meta kernels for these ops.
Without them, tracing an update with fake tensors falls back to running the real kernel on
real, zero-filled copies of every argument: on a GPU that allocates the parameters, gradients
and optimizer state for real while tracing (what graphoffload exists to avoid), and on the meta
device it fails. The ops update their arguments in place and return nothing, so the meta
kernel checks the lists line up and does nothing else.

Registering into `aten` changes torch for the whole process, so it is an explicit call
(`register_fused_optimizer_meta_kernels`, made by capture before it traces), idempotent, and
never an import side effect; it skips any op that already has a meta kernel (a later torch).
"""

from __future__ import annotations

import functools

import torch
from torch import fx

from graphoffload.torch_private import has_kernel_for_dispatch_key


def _check_lists(name: str, *lists) -> None:
    sizes = {len(lst) for lst in lists if len(lst)}
    if len(sizes) > 1:
        raise RuntimeError(f"{name}: tensor lists of different lengths {sorted(sizes)}")


def _adam_meta(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **_):
    _check_lists("_fused_adam(w)_", self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)


def _sgd_meta(self, grads, momentum_buffer_list, **_):
    _check_lists("_fused_sgd_", self, grads, momentum_buffer_list)


# op -> its meta kernel
FUSED_UPDATE_OPS = {
    torch.ops.aten._fused_adamw_: _adam_meta,
    torch.ops.aten._fused_adam_: _adam_meta,
    torch.ops.aten._fused_sgd_: _sgd_meta,
}


def is_fused_update(node: fx.Node) -> bool:
    """Whether the node runs one of torch's fused optimizer update kernels (any overload)."""
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in FUSED_UPDATE_OPS


@functools.cache
def register_fused_optimizer_meta_kernels() -> torch.library.Library:
    """Give `aten::_fused_adamw_`, `_fused_adam_` and `_fused_sgd_` (every overload) a meta
    kernel where they have none. Idempotent; returns the library holding the registrations,
    which the cache keeps alive for the process's lifetime (they end with it)."""
    library = torch.library.Library("aten", "IMPL")
    for packet, kernel in FUSED_UPDATE_OPS.items():
        op = packet.__name__
        for overload in packet.overloads():
            name = f"{op}.{overload}" if overload != "default" else op
            if not has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
                library.impl(name, kernel, "Meta")
    return library
