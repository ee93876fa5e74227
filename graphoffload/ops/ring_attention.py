"""Ring attention's ops (schemas, fake kernels, autograd) and the sequence layouts they take.

`ring_attention` rewrites each captured `graphoffload::attention` (and its backward) into
these ops; the runtime (runtime/ring_attention.py) registers their kernels, which exchange
key/value blocks around the ring. The fake kernels run one block's attention on fake tensors,
so a fake output has the real output's shape and strides.

Layouts (`chunk_ranges`): ``contiguous`` gives rank r the r-th of N equal chunks; ``zigzag``
cuts the sequence into 2N chunks and gives rank r chunks r and 2N-1-r, so under a causal mask
every rank does the same work. `LAYOUTS` is the one list of them (SequenceParallel checks
against it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from graphoffload.ops.attention import _backward, _expand_kv, _forward, _reduce_kv_grad, _use_cuda_flash


def _no_kernel(name: str) -> RuntimeError:
    return RuntimeError(f"{name} has no kernel: its kernels live in the runtime (import graphoffload.runtime)")


# --------------------------------------------------------------------------- layouts

LAYOUTS = ("zigzag", "contiguous")


# --------------------------------------------------------------------------- layouts

def chunk_ranges(layout: str, rank: int, world: int, seq_len: int) -> list[tuple[int, int]]:
    """[start, end) ranges of the global sequence rank `rank` holds, in local order."""
    if layout == "contiguous":
        if seq_len % world:
            raise ValueError(f"sequence length {seq_len} is not divisible by the {world} ranks of the ring")
        n = seq_len // world
        return [(rank * n, (rank + 1) * n)]
    if layout == "zigzag":
        if seq_len % (2 * world):
            raise ValueError(f"zigzag needs a sequence length divisible by 2 x {world} ranks, got {seq_len}")
        c = seq_len // (2 * world)
        return [(rank * c, (rank + 1) * c), ((2 * world - 1 - rank) * c, (2 * world - rank) * c)]
    raise ValueError(f"unknown sequence layout {layout!r}; use one of {LAYOUTS}")


def shard(x: Tensor, dim: int, layout: str, rank: int, world: int) -> Tensor:
    """This rank's part of a full-sequence tensor along `dim`."""
    parts = [x.narrow(dim, a, b - a) for a, b in chunk_ranges(layout, rank, world, x.shape[dim])]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(parts: list[Tensor], dim: int, layout: str) -> Tensor:
    """The full-sequence tensor from every rank's part (in rank order)."""
    world = len(parts)
    seq = sum(p.shape[dim] for p in parts)
    pieces: list[tuple[int, Tensor]] = []
    for r, p in enumerate(parts):
        offset = 0
        for a, b in chunk_ranges(layout, r, world, seq):
            pieces.append((a, p.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([t for _, t in sorted(pieces, key=lambda x: x[0])], dim)


def positions(layout: str, rank: int, world: int, seq_len: int, device=None) -> Tensor:
    """Global positions of this rank's tokens (int64), in local order."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in chunk_ranges(layout, rank, world, seq_len)])


# --------------------------------------------------------------------------- per-block kernels

def _block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    heads = q.shape[-3]
    out, lse = _forward(q, _expand_kv(k, heads), _expand_kv(v, heads), None, causal, scale)
    return out, lse[..., :q.shape[-2]]   # efficient attention pads the lse to a multiple of 32


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    heads = q.shape[-3]
    if q.device.type == "cuda" and not _use_cuda_flash(q, k, v, None, causal):
        pad = (-lse.shape[-1]) % 32   # the efficient kernel reads a padded lse
        lse = F.pad(lse, (0, pad)) if pad else lse
    dq, dk, dv = _backward(dout.contiguous(), q, _expand_kv(k, heads), _expand_kv(v, heads), out,
                           lse.contiguous(), None, causal, scale)
    return dq, _reduce_kv_grad(dk, k.shape[-3]), _reduce_kv_grad(dv, v.shape[-3])


# --------------------------------------------------------------------------- the ops

@torch.library.custom_op("graphoffload::ring_attention", mutates_args=())
def ring_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None, layout: str,
                   group_name: str, timeout_s: float) -> tuple[Tensor, Tensor]:
    """`graphoffload::attention` over a sequence split across the ranks of `group_name`:
    (out, logsumexp) of this rank's queries; q, k, v hold this rank's part of the sequence."""
    raise _no_kernel("graphoffload::ring_attention")


@ring_attention.register_fake
def _ring_attention_fake(q, k, v, is_causal, scale, layout, group_name, timeout_s):
    out, lse = _block_forward(q, k.contiguous(), v.contiguous(), is_causal, scale)
    return torch.empty_like(out), torch.empty(lse.shape, dtype=lse.dtype, device=q.device)


@torch.library.custom_op("graphoffload::ring_attention_backward", mutates_args=())
def ring_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            is_causal: bool, scale: float | None, layout: str, group_name: str,
                            timeout_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of `ring_attention` for this rank's q, k, v."""
    raise _no_kernel("graphoffload::ring_attention_backward")


@ring_attention_backward.register_fake
def _ring_attention_backward_fake(grad_out, q, k, v, out, lse, is_causal, scale, layout, group_name, timeout_s):
    return tuple(torch.empty_like(t) for t in _block_backward(grad_out, q, k.contiguous(), v.contiguous(), out,
                                                              lse, is_causal, scale))


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, layout, group_name, timeout_s = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (is_causal, scale, layout, group_name, timeout_s)
    ctx.mark_non_differentiable(output[1])


def _ring_attention_grad(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward(grad_out, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


ring_attention.register_autograd(_ring_attention_grad, setup_context=_setup_context)
