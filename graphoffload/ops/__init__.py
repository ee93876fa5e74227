"""The IR's op vocabulary: every `graphoffload::` op's schema, fake kernel and autograd formula.

Capture, the passes and the runtime all name ops from here; none of them declares one. Importing
this package declares them all, so a graph can be traced, rewritten and printed without the
runtime. Ops whose kernels are compositions of aten ops (attention, grouped_mm, the RNG state)
carry their kernel here too, since the fake kernel runs that same code on fake tensors; ops
whose kernels need the runtime's streams, worker or process groups (host transfers and
updates, ring attention) are declared here with a kernel that raises, and the runtime
registers the real one with `register_kernel` when it is imported.

    attention.py          attention, attention_backward, attention_mask_grad
    grouped_mm.py         grouped_mm (the CPU kernel's dtypes, with a fake kernel torch lacks)
    rng.py                rng_state, swap_rng_state (a recompute replays its random draws)
    host_transfer.py      copy_to_host, prefetch_to_device, copy_to_device, wait_host,
                          carry_host_write, wait_device, hand_over, wait_handed_over,
                          host_adam_, host_sgd_, host_accumulate_, host_grad_norm_, host_unscale_;
                          `VALUE_RULES`: each op's node value from its inputs' (its fake
                          kernel, called without dispatch)
    ring_attention.py     ring_attention, ring_attention_backward, and the sequence layouts
    fused_optimizer_meta.py  torch's fused optimizer ops as the IR knows them: the list of update
                          kernels (`FUSED_UPDATE_OPS`, `is_fused_update`) and their meta kernels
                          (registered into aten by an explicit call:
                          `register_fused_optimizer_meta_kernels()`)
"""

from graphoffload.ops import attention, grouped_mm, host_transfer, ring_attention, rng
from graphoffload.ops.fused_optimizer_meta import register_fused_optimizer_meta_kernels

__all__ = ["attention", "grouped_mm", "host_transfer", "register_fused_optimizer_meta_kernels", "ring_attention",
           "rng"]
