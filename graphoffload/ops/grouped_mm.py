"""graphoffload's grouped matrix multiply: `torch._grouped_mm` with a fake kernel for every dtype
the real kernel takes.

Mixture-of-experts layers multiply each expert's tokens by that expert's weights in one grouped
matmul (transformers' default experts implementation calls `F.grouped_mm`). torch's CPU kernel
takes float32, float16 and bfloat16, but torch's fake (meta) kernel checks the CUDA kernel's
dtypes and rejects all but bfloat16, so an fp32 MoE model cannot be traced. Capture routes such
calls here instead of replacing torch's meta kernel for everyone: the real kernel is
`torch._grouped_mm` itself (and the backward the same two grouped matmuls eager autograd runs),
so the numbers are eager's bit for bit; only the fake kernel is ours.

Layouts (as `torch._grouped_mm`): (tokens, k) x (groups, k, n) with `offs` the cumulative token
counts per group -> (tokens, n); (groups, m, k) x (groups, k, n) -> (groups, m, n); and, in the
backward, (k, tokens) x (tokens, n) with `offs` -> (groups, k, n).
"""

from __future__ import annotations

import torch
from torch import Tensor


def routes(mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> bool:
    """Whether a `torch._grouped_mm` call goes to graphoffload's op: a plain (unscaled, no bias)
    product in a dtype torch's fake kernel rejects, of a layout whose gradient is two grouped
    matmuls."""
    return (bias is None and out_dtype in (None, mat_a.dtype) and mat_a.dtype == mat_b.dtype
            and mat_a.dtype in (torch.float32, torch.float16) and (mat_a.dim(), mat_b.dim()) in ((2, 3), (3, 3))
            and (offs is not None) == (mat_a.dim() == 2))


@torch.library.custom_op("graphoffload::grouped_mm", mutates_args=())
def grouped_mm(mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None) -> Tensor:
    """`torch._grouped_mm(mat_a, mat_b, offs)`."""
    return torch._grouped_mm(mat_a, mat_b, offs)


@grouped_mm.register_fake
def _grouped_mm_fake(mat_a, mat_b, offs=None):
    if mat_a.dtype != mat_b.dtype:
        raise RuntimeError(f"grouped_mm: mat_a is {mat_a.dtype}, mat_b {mat_b.dtype}")
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        torch._check(offs is not None and offs.shape[0] == mat_b.shape[0] and mat_a.shape[1] == mat_b.shape[1],
                     lambda: f"grouped_mm: {tuple(mat_a.shape)} x {tuple(mat_b.shape)} needs one offset per group")
        shape = (mat_a.shape[0], mat_b.shape[2])
    elif mat_a.dim() == 3 and mat_b.dim() == 3:
        torch._check(mat_a.shape[0] == mat_b.shape[0] and mat_a.shape[2] == mat_b.shape[1],
                     lambda: f"grouped_mm: {tuple(mat_a.shape)} x {tuple(mat_b.shape)}")
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[2])
    elif mat_a.dim() == 2 and mat_b.dim() == 2:
        torch._check(offs is not None and mat_a.shape[1] == mat_b.shape[0],
                     lambda: f"grouped_mm: {tuple(mat_a.shape)} x {tuple(mat_b.shape)} needs offsets")
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    else:
        raise RuntimeError(f"grouped_mm: unsupported layout {tuple(mat_a.shape)} x {tuple(mat_b.shape)}")
    if mat_a.device.type != "cpu":   # the CUDA kernel pads rows to 16 bytes: torch's fake knows how
        raise RuntimeError("graphoffload::grouped_mm is for the CPU kernel's dtypes; on a GPU use bfloat16")
    return mat_a.new_empty(shape)   # the CPU kernel's output is contiguous


def _setup_context(ctx, inputs, output):
    mat_a, mat_b, offs = inputs
    ctx.save_for_backward(mat_a, mat_b, offs)


def _column_major(t: Tensor) -> bool:
    """Whether `t`'s last two dimensions are laid out column by column (a transposed weight)."""
    return t.stride(-2) == 1 and t.stride(-1) == t.shape[-2]


def _grouped_mm_grad(ctx, grad):
    # what eager autograd runs for torch._grouped_mm (its _grouped_mm_mat{1,2}_backward): for a
    # column-major mat_b, as for mm's, the transposed product, transposed back. The same values
    # on some CPUs' kernels, not on others' (AVX2's sum the other product in another order)
    mat_a, mat_b, offs = ctx.saved_tensors
    grad = grad.contiguous()   # the kernel refuses a broadcast (stride-0) gradient such as sum()'s; same values
    grad_a = grouped_mm(grad, mat_b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = None
    if ctx.needs_input_grad[1]:
        grad_b = grouped_mm(grad.transpose(-2, -1), mat_a, offs).transpose(-2, -1) if _column_major(mat_b) \
            else grouped_mm(mat_a.transpose(-2, -1), grad, offs)
    return grad_a, grad_b, None


grouped_mm.register_autograd(_grouped_mm_grad, setup_context=_setup_context)
