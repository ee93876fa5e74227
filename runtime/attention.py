"""graphoffload's attention op: one forward node returning (out, logsumexp), one backward node.

Capture routes every `F.scaled_dot_product_attention` call here, so the captured graph holds
exactly these two nodes per attention whatever SDPA backend runs underneath; passes such as
`ring_attention` retarget them without knowing which kernel the device would pick. The fake
kernels run the very same dispatch on fake tensors (every aten SDPA kernel has a meta kernel),
so a fake output always has the real output's strides.

Layout follows SDPA: q is (batch, heads, q_len, head_dim), k/v are (batch, kv_heads, kv_len,
head_dim); logsumexp is float32 (batch, heads, q_len). Grouped-query attention (kv_heads
divides heads) is expanded inside the kernel on CUDA, and its key/value gradients are summed
back (torch's CPU kernels take grouped K/V natively), so the graph carries the small K/V tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

aten = torch.ops.aten


def _expand_kv(t: Tensor, heads: int) -> Tensor:
    groups = heads // t.shape[-3]
    # torch's CPU flash kernels take grouped K/V as they are (as eager SDPA with enable_gqa
    # calls them); expanding there would sum dk/dv in another order than eager does
    return t if groups == 1 or t.device.type == "cpu" else t.repeat_interleave(groups, dim=-3)


def _reduce_kv_grad(g: Tensor, kv_heads: int) -> Tensor:
    groups = g.shape[-3] // kv_heads
    if groups == 1:
        return g
    return g.unflatten(-3, (kv_heads, groups)).sum(-3)


def _additive_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _use_cuda_flash(q: Tensor, mask: Tensor | None) -> bool:
    return mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
             scale: float | None) -> tuple[Tensor, Tensor]:
    if q.device.type == "cuda":
        if _use_cuda_flash(q, mask):
            res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
            return res[0], res[1]
        res = aten._scaled_dot_product_efficient_attention(
            q, k, v, _additive_mask(mask, q.dtype), True, 0.0, is_causal, scale=scale)
        return res[0], res[1]
    # torch's CPU kernel takes only an additive mask of q's dtype; eager SDPA converts bool masks so too
    res = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                           attn_mask=_additive_mask(mask, q.dtype), scale=scale)
    return res[0], res[1]


def _backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              mask: Tensor | None, is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cuda":
        if _use_cuda_flash(q, mask):
            empty = torch.empty(0, dtype=torch.int64, device=q.device)
            res = aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse, empty, empty, q.shape[-2], k.shape[-2], 0.0, is_causal,
                torch.empty((), dtype=torch.int64, device=q.device),
                torch.empty((), dtype=torch.int64, device=q.device), scale=scale)
            return res[0], res[1], res[2]
        bias = _additive_mask(mask, q.dtype)
        empty = torch.empty((), dtype=torch.int64, device=q.device)
        res = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, bias, out, lse, empty, empty, 0.0, [True, True, True, bias is not None],
            is_causal, scale=scale)
        return res[0], res[1], res[2]
    res = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=_additive_mask(mask, q.dtype), scale=scale)
    return res[0], res[1], res[2]


@torch.library.custom_op("graphoffload::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
              is_causal: bool = False, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention returning (out, logsumexp); no dropout."""
    return _forward(q, _expand_kv(k, q.shape[-3]), _expand_kv(v, q.shape[-3]), attn_mask, is_causal, scale)


@attention.register_fake
def _attention_fake(q, k, v, attn_mask=None, is_causal=False, scale=None):
    return _forward(q, _expand_kv(k, q.shape[-3]), _expand_kv(v, q.shape[-3]), attn_mask, is_causal, scale)


@torch.library.custom_op("graphoffload::attention_backward", mutates_args=())
def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       attn_mask: Tensor | None = None, is_causal: bool = False,
                       scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of `attention`, from its final output and logsumexp."""
    heads = q.shape[-3]
    dq, dk, dv = _backward(grad_out.contiguous(), q, _expand_kv(k, heads), _expand_kv(v, heads),
                           out, lse, attn_mask, is_causal, scale)
    return dq, _reduce_kv_grad(dk, k.shape[-3]), _reduce_kv_grad(dv, v.shape[-3])


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, attn_mask=None, is_causal=False, scale=None):
    heads = q.shape[-3]
    dq, dk, dv = _backward(grad_out.contiguous(), q, _expand_kv(k, heads), _expand_kv(v, heads),
                           out, lse, attn_mask, is_causal, scale)
    return dq, _reduce_kv_grad(dk, k.shape[-3]), _reduce_kv_grad(dv, v.shape[-3])


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.is_causal, ctx.scale = is_causal, scale
    ctx.mark_non_differentiable(lse)


def _attention_grad(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, attn_mask, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None


attention.register_autograd(_attention_grad, setup_context=_setup_context)


def sdpa_via_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                       dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False) -> Tensor:
    """`F.scaled_dot_product_attention` with graphoffload's op underneath (what capture calls)."""
    from graphoffload.errors import UnsupportedError

    if dropout_p:
        raise UnsupportedError(
            f"scaled_dot_product_attention with dropout_p={dropout_p} is not supported inside a "
            "compiled step; set the attention dropout to 0 (residual/MLP dropout works).")
    if key.shape[-3] != query.shape[-3] and not enable_gqa:
        raise UnsupportedError("scaled_dot_product_attention got fewer key/value heads than query "
                               "heads without enable_gqa=True")
    if query.dim() == 3:  # unbatched call: (heads, len, dim)
        out, _ = attention(query[None], key[None], value[None], attn_mask, is_causal, scale)
        return out[0]
    out, _ = attention(query, key, value, attn_mask, is_causal, scale)
    return out

