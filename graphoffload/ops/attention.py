"""graphoffload's attention op: one forward node returning (out, logsumexp), one backward node.

Capture routes every `F.scaled_dot_product_attention` call here, so the captured graph holds
exactly these two nodes per attention whatever SDPA backend runs underneath; passes such as
`ring_attention` retarget them without knowing which kernel the device would pick. The fake
kernels run the very same dispatch on fake tensors (every aten SDPA kernel has a meta kernel),
so a fake output always has the real output's strides.

Layout follows SDPA: q is (batch, heads, q_len, head_dim), k/v are (batch, kv_heads, kv_len,
head_dim); logsumexp is float32 (batch, heads, q_len), except from CUDA's efficient-attention
kernel, which pads q_len to a multiple of 32 (its backward reads that layout). Grouped-query
attention (kv_heads divides heads) is expanded inside the kernel on CUDA, and its key/value
gradients are summed back (torch's CPU kernels take grouped K/V natively), so the graph carries
the small K/V tensors.

On CUDA the kernel is chosen from shapes, dtype and the device alone, so the fake kernel at
trace time and the real one pick the same and the logsumexp keeps its layout: flash attention
for fp16/bf16 without a mask on sm80 and newer, else memory-efficient attention. Both need a
head dim that is a multiple of 8 (eager SDPA pads for flash, or falls back to its math
kernel), so q, k and v are zero-padded to one here and the outputs cut back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

aten = torch.ops.aten


def _expand_kv(t: Tensor, heads: int) -> Tensor:
    groups = heads // t.shape[-3]
    # torch's CPU flash kernels take grouped K/V as they are (as eager SDPA with enable_gqa
    # calls them); expanding there would sum dk/dv in another order than eager does
    return t if groups == 1 or t.device.type == "cpu" else t.repeat_interleave(groups, dim=-3)


def _reduce_kv_grad(grad: Tensor, kv_heads: int) -> Tensor:
    groups = grad.shape[-3] // kv_heads
    if groups == 1:
        return grad
    return grad.unflatten(-3, (kv_heads, groups)).sum(-3)


def _additive_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _padded(d: int) -> int:
    return -(-d // 8) * 8


def _pad_head_dim(t: Tensor, width: int) -> Tensor:
    if t.shape[-1] != width:
        return F.pad(t, (0, width - t.shape[-1]))
    return t if t.stride(-1) == 1 else t.contiguous()


def _use_cuda_flash(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> bool:
    d = _padded(q.shape[-1])
    if (mask is not None or q.dtype not in (torch.float16, torch.bfloat16) or d > 256 or v.shape[-1] != q.shape[-1]
            or not torch.backends.cuda.is_flash_attention_available()):
        return False
    # flash aligns a causal mask to the bottom right when q_len != kv_len; SDPA (and the
    # efficient kernel) to the top left
    if is_causal and q.shape[-2] != k.shape[-2]:
        return False
    capability = torch.cuda.get_device_capability(q.device)
    # sm86-sm89 lack the shared memory for flash's backward at head dims in (192, 224]
    return capability >= (8, 0) and not ((8, 6) <= capability <= (8, 9) and 192 < d <= 224)


def _efficient_bias(mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    """The mask as the efficient kernel reads it: additive, of q's dtype, (batch, heads, q_len,
    kv_len) with every stride but the last a multiple of 8 (what eager SDPA's preprocessing does)."""
    if mask is None:
        return None
    bias = _additive_mask(mask, q.dtype).to(q.dtype)
    if bias.stride(-1) != 1 or any(s % 8 for s in bias.stride()[:-1]):
        width = bias.shape[-1]
        aligned = bias.new_empty((*bias.shape[:-1], _padded(width))).narrow(-1, 0, width)
        aligned.copy_(bias)
        bias = aligned
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _check_cuda(q: Tensor) -> None:
    if q.dtype not in _CUDA_DTYPES or (q.dtype == torch.bfloat16 and torch.cuda.get_device_capability(q.device) < (8, 0)):
        from graphoffload.errors import UnsupportedError

        raise UnsupportedError(f"attention in {q.dtype} on {torch.cuda.get_device_name(q.device)}: torch's fused CUDA "
                               "attention kernels take float16 and float32, and bfloat16 on sm80 (Ampere) and newer")


def _forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
             scale: float | None) -> tuple[Tensor, Tensor]:
    if q.device.type == "cuda":
        _check_cuda(q)
        d, dv = q.shape[-1], v.shape[-1]
        if scale is None and _padded(d) != d:   # the kernel would take it from the padded head dim
            scale = 1.0 / math.sqrt(d)
        qp, kp, vp = _pad_head_dim(q, _padded(d)), _pad_head_dim(k, _padded(d)), _pad_head_dim(v, _padded(dv))
        if _use_cuda_flash(q, k, v, mask, is_causal):
            res = aten._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, is_causal, False, scale=scale)
        else:
            res = aten._scaled_dot_product_efficient_attention(
                qp, kp, vp, _efficient_bias(mask, q, k), True, 0.0, is_causal, scale=scale)
        out = res[0] if _padded(dv) == dv else res[0].narrow(-1, 0, dv)
        return out, res[1]
    # torch's CPU kernel takes only an additive mask of q's dtype; eager SDPA converts bool masks so too
    res = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                           attn_mask=_additive_mask(mask, q.dtype), scale=scale)
    return res[0], res[1]


def _padded_backward_inputs(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                            scale: float | None) -> tuple[float | None, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What the CUDA backward kernels take: the scale (fixed to the unpadded head dim's when
    padding would change the default), q, k, v, grad_out and out zero-padded to a head dim that is
    a multiple of 8, and the unused philox seed/offset tensor."""
    d, dv = q.shape[-1], v.shape[-1]
    if scale is None and _padded(d) != d:
        scale = 1.0 / math.sqrt(d)
    qp, kp, vp = _pad_head_dim(q, _padded(d)), _pad_head_dim(k, _padded(d)), _pad_head_dim(v, _padded(dv))
    # the padded columns of the output are zeros, as the forward computed them
    gp, op = _pad_head_dim(grad_out, _padded(dv)), _pad_head_dim(out, _padded(dv))
    unused = torch.empty((), dtype=torch.int64, device=q.device)   # philox seed/offset: read only with dropout
    return scale, qp, kp, vp, gp, op, unused


def _backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              mask: Tensor | None, is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cuda":
        d, dv = q.shape[-1], v.shape[-1]
        scale, qp, kp, vp, gp, op, unused = _padded_backward_inputs(grad_out, q, k, v, out, scale)
        if _use_cuda_flash(q, k, v, mask, is_causal):
            # cum_seq_q/k undefined (None), as the forward returns them, selects the dense kernel;
            # defined (even empty) ones select the variable-length one
            res = aten._scaled_dot_product_flash_attention_backward(
                gp, qp, kp, vp, op, lse, None, None, q.shape[-2], k.shape[-2], 0.0, is_causal,
                unused, unused, scale=scale)
        else:
            # no gradient for the mask: it is not differentiable here, and its gradient would be
            # a (batch, heads, q_len, kv_len) tensor
            res = aten._scaled_dot_product_efficient_attention_backward(
                gp, qp, kp, vp, _efficient_bias(mask, q, k), op, lse, unused, unused, 0.0,
                [True, True, True, False], is_causal, scale=scale)
        dq, dk, dvv = res[0], res[1], res[2]
        if _padded(d) != d:
            dq, dk = dq.narrow(-1, 0, d), dk.narrow(-1, 0, d)
        return dq, dk, (dvv if _padded(dv) == dv else dvv.narrow(-1, 0, dv))
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


def _mask_grad(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor,
               is_causal: bool, scale: float | None) -> Tensor:
    """d loss / d mask, summed over the dimensions the mask was broadcast along (as autograd
    sums an expanded tensor's gradient). The mask is added to the scores, so its gradient is the
    scores' gradient dS = P * (dO V^T - rowsum(dO * O)). On CUDA the efficient kernel, which
    eager SDPA runs for a mask that requires grad, computes it (again: dq, dk and dv come from
    `attention_backward`); on the CPU, where eager SDPA falls back to its math kernel, it is
    computed here from the saved logsumexp."""
    heads = q.shape[-3]
    k, v = k.repeat_interleave(heads // k.shape[-3], dim=-3), v.repeat_interleave(heads // v.shape[-3], dim=-3)
    if q.device.type == "cuda":
        scale, qp, kp, vp, gp, op, unused = _padded_backward_inputs(grad_out, q, k, v, out, scale)
        res = aten._scaled_dot_product_efficient_attention_backward(
            gp, qp, kp, vp, _efficient_bias(mask, q, k), op, lse, unused, unused, 0.0,
            [False, False, False, True], is_causal, scale=scale)
        return res[3].sum_to_size(mask.shape).to(mask.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    f32 = torch.promote_types(q.dtype, torch.float32)   # float64 stays float64
    scores = torch.matmul(q.to(f32), k.to(f32).transpose(-2, -1)) * scale + mask.to(f32)
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    # a row masked out entirely has logsumexp -inf and no probability anywhere
    probs = torch.exp(scores - lse.to(f32).unsqueeze(-1)).nan_to_num(0.0)
    dprobs = torch.matmul(grad_out.to(f32), v.to(f32).transpose(-2, -1))
    delta = (grad_out.to(f32) * out.to(f32)).sum(-1, keepdim=True)
    return (probs * (dprobs - delta)).sum_to_size(mask.shape).to(mask.dtype)


@torch.library.custom_op("graphoffload::attention_mask_grad", mutates_args=())
def attention_mask_grad(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        attn_mask: Tensor, is_causal: bool = False, scale: float | None = None) -> Tensor:
    """The gradient of `attention` for a floating-point mask that requires grad (a learned
    additive bias: T5's relative position bias, ALiBi-style learned slopes), of the mask's shape."""
    return _mask_grad(grad_out.contiguous(), q, k, v, out, lse, attn_mask, is_causal, scale)


@attention_mask_grad.register_fake
def _attention_mask_grad_fake(grad_out, q, k, v, out, lse, attn_mask, is_causal=False, scale=None):
    return _mask_grad(grad_out.contiguous(), q, k, v, out, lse, attn_mask, is_causal, scale)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.is_causal, ctx.scale = is_causal, scale
    ctx.mark_non_differentiable(lse)


def _attention_grad(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, attn_mask, ctx.is_causal, ctx.scale)
    # a learned mask gets its gradient, as from eager SDPA (a bool mask never requires grad)
    dmask = (attention_mask_grad(grad_out, q, k, v, out, lse, attn_mask, ctx.is_causal, ctx.scale)
             if len(ctx.needs_input_grad) > 3 and ctx.needs_input_grad[3] else None)   # mask passed
    return dq, dk, dv, dmask, None, None


attention.register_autograd(_attention_grad, setup_context=_setup_context)

# the overloads graph nodes target
ATTENTION = torch.ops.graphoffload.attention.default
ATTENTION_BACKWARD = torch.ops.graphoffload.attention_backward.default


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

