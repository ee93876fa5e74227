"""Ring attention: exact attention over a sequence split across the ranks of a process group.

Each rank holds its queries, keys and values for its part of the sequence. The forward op
computes attention of its queries against its own key/value block, then passes key/value
blocks around the ring (rank r sends to r+1 and receives from r-1) and merges each block's
partial output into the running one with its log-sum-exp, in float32 and in the overflow-safe
form (``lse - logsigmoid(lse - lse_b)``). The send/receive of the next block is posted with
`torch.distributed.batch_isend_irecv` *before* the current block is computed, so transfer and
compute overlap and no rank can deadlock on the order of its sends and receives.

The backward op takes the final output and log-sum-exp; key/value blocks travel the ring
again and, one step behind them, float32 accumulators of their gradients: each rank adds its
queries' contribution to the block it holds and passes the accumulator on, so after N steps
every block's gradient is back on its owner.

Layouts (`chunk_ranges`): ``contiguous`` gives rank r the r-th of N equal chunks;
``zigzag`` cuts the sequence into 2N chunks and gives rank r chunks r and 2N-1-r, so under a
causal mask every rank does the same work. Grouped-query attention sends the key/value heads
as they are; they are repeated only locally, for the per-block kernel.

Per-block attention runs the fused SDPA kernels that return the log-sum-exp (the table
`graphoffload/ops/attention.py` dispatches through: flash or efficient attention on CUDA, the CPU flash
kernel on CPU). Collectives per call: forward N-1 key/value exchanges; backward N-1 key/value
exchanges plus N gradient exchanges. On gloo every wait has a timeout, so a rank that fails or
never arrives makes every other rank raise RingTimeoutError instead of hang; on NCCL waits only
order the compute stream after the exchange (no host blocking, no polling each step), and the
process group's timeout covers a dead rank.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from graphoffload.errors import RingTimeoutError, describe
from graphoffload.ops import ring_attention as ring_ops
from graphoffload.ops.ring_attention import (LAYOUTS, _block_backward, _block_forward,  # noqa: F401  (layouts re-exported)
                                             chunk_ranges, positions, shard, unshard)
from graphoffload.torch_private import resolve_process_group

# --------------------------------------------------------------------------- communication

def resolve_group(group_name: str) -> dist.ProcessGroup:
    return resolve_process_group(group_name)


class _Ring:
    def __init__(self, group_name: str, timeout_s: float):
        self.group = resolve_group(group_name)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        # NCCL: a wait without a timeout orders the compute stream after the exchange and returns
        # at once; with one, it blocks the host polling the work every step. The process group's
        # own timeout (its watchdog) covers a dead rank there. gloo waits on the host either way,
        # and only a timeout turns a dead rank into RingTimeoutError instead of a hang.
        self.stream_ordered = dist.get_backend(self.group) == "nccl"

    def exchange(self, tensors: tuple[Tensor, ...]) -> tuple[list, list[Tensor]]:
        """Post: send `tensors` to the next rank, receive as many from the previous one."""
        tensors = tuple(t.contiguous() for t in tensors)
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors] + \
              [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
        try:
            return dist.batch_isend_irecv(ops), bufs
        except Exception as exc:  # noqa: BLE001 - a peer that died closes its connection
            raise self._error("to exchange a block", exc) from exc

    def _error(self, what: str, exc: BaseException) -> RingTimeoutError:
        return RingTimeoutError(
            f"ring attention: rank {self.rank} of {self.world} failed {what} with rank {self.prev}/{self.next} "
            f"(timeout {self.timeout_s:g} s): a rank failed or never reached this attention "
            f"({describe(exc)})")

    def wait(self, reqs: list, what: str) -> None:
        for req in reqs:
            try:
                ok = req.wait() if self.stream_ordered else req.wait(self.timeout)
            except Exception as exc:  # noqa: BLE001 - backends raise their own error types
                raise self._error(f"waiting for {what}", exc) from exc
            if ok is False:
                raise RingTimeoutError(f"ring attention: rank {self.rank} timed out after {self.timeout_s:g} s "
                                       f"waiting for {what}")


def block_plan(layout: str, is_causal: bool, rank: int, source: int, q_len: int,
               kv_len: int) -> tuple[slice, slice, bool] | None:
    """Which queries of this rank attend to which keys of `source`'s block, and whether
    causally; None when no query sees any of them."""
    whole_q, whole_kv = slice(0, q_len), slice(0, kv_len)
    if source == rank:
        return whole_q, whole_kv, is_causal
    if not is_causal:
        return whole_q, whole_kv, False
    if layout == "contiguous":
        return (whole_q, whole_kv, False) if source < rank else None
    # zigzag: rank r holds chunks (r, 2N-1-r); an earlier rank's first chunk is before both of
    # ours and its second after both; a later rank's chunks are both before our second chunk only
    if source < rank:
        return whole_q, slice(0, kv_len // 2), False
    return slice(q_len // 2, q_len), whole_kv, False


def _merge(out_acc: Tensor, lse_acc: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Merge a block's (out, lse) into the running float32 ones, in place."""
    lse_b = lse_b.to(lse_acc.dtype)
    weight = torch.sigmoid(lse_b - lse_acc).unsqueeze(-1)
    out_acc.sub_(weight * (out_acc - out_b.to(out_acc.dtype)))
    lse_acc.sub_(F.logsigmoid(lse_acc - lse_b))


def ring_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None, layout: str,
                 ring: _Ring) -> tuple[Tensor, Tensor]:
    """(out, lse) of this rank's queries against the whole sequence."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    cur = (k.contiguous(), v.contiguous())
    out0 = out_acc = lse_acc = None
    for s in range(ring.world):
        if s < ring.world - 1:
            reqs, incoming = ring.exchange(cur)    # the next block travels while this one computes
        source = (ring.rank - s) % ring.world
        plan = block_plan(layout, is_causal, ring.rank, source, q_len, kv_len)
        if s == 0:    # own block: full shapes, so its output has the kernel's layout
            out0, lse0 = _block_forward(q, cur[0], cur[1], is_causal, scale)
            acc = torch.promote_types(lse0.dtype, torch.float32)   # float32, float64 for float64 inputs
            out_acc, lse_acc = out0.to(acc), lse0.to(acc).contiguous()
        elif plan is not None:
            qs, ks, causal = plan
            out_b, lse_b = _block_forward(q[..., qs, :], cur[0][..., ks, :], cur[1][..., ks, :], causal, scale)
            _merge(out_acc[..., qs, :], lse_acc[..., qs], out_b, lse_b)
        if s < ring.world - 1:
            ring.wait(reqs, f"the key/value block of step {s + 1}")
            cur = tuple(incoming)
    out = torch.empty_like(out0)
    out.copy_(out_acc)
    return out, lse_acc.to(lse0.dtype)


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool,
                  scale: float | None, layout: str, ring: _Ring) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) for this rank's q, k, v from the final output and log-sum-exp."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    cur = (k.contiguous(), v.contiguous())
    templates = None
    acc = torch.promote_types(q.dtype, torch.float32)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv_reqs, dkv_in = None, None
    for s in range(ring.world):
        if s < ring.world - 1:
            kv_reqs, incoming = ring.exchange(cur)
        source = (ring.rank - s) % ring.world
        plan = block_plan(layout, is_causal, ring.rank, source, q_len, kv_len)
        dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
        if s == 0:
            templates = _block_backward(dout, q, cur[0], cur[1], out, lse, is_causal, scale)
            dq_acc += templates[0]
            dk_acc += templates[1]
            dv_acc += templates[2]
        elif plan is not None:
            qs, ks, causal = plan
            dq_b, dk_b, dv_b = _block_backward(dout[..., qs, :], q[..., qs, :], cur[0][..., ks, :],
                                               cur[1][..., ks, :], out[..., qs, :], lse[..., qs], causal, scale)
            dq_acc[..., qs, :] += dq_b
            dk_acc[..., ks, :] += dk_b
            dv_acc[..., ks, :] += dv_b
        if s > 0:   # this block's gradient so far, from the ranks it visited before
            ring.wait(dkv_reqs, f"the key/value gradient of step {s}")
            dk_acc += dkv_in[0]
            dv_acc += dkv_in[1]
        if ring.world > 1:
            dkv_reqs, dkv_in = ring.exchange((dk_acc, dv_acc))
        if s < ring.world - 1:
            ring.wait(kv_reqs, f"the key/value block of step {s + 1}")
            cur = tuple(incoming)
    if ring.world > 1:   # the last pass brought each rank its own block's gradient
        ring.wait(dkv_reqs, "the gradient of its own key/value block")
        dk_acc, dv_acc = dkv_in
    results = []
    for template, acc in zip(templates, (dq_acc, dk_acc, dv_acc)):
        r = torch.empty_like(template)
        r.copy_(acc)
        results.append(r)
    return tuple(results)


# --------------------------------------------------------------------------- kernels
# of the ops graphoffload/ops/ring_attention.py declares

@ring_ops.ring_attention.register_kernel(None)
def ring_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None, layout: str,
                   group_name: str, timeout_s: float) -> tuple[Tensor, Tensor]:
    return ring_forward(q, k, v, is_causal, scale, layout, _Ring(group_name, timeout_s))


@ring_ops.ring_attention_backward.register_kernel(None)
def ring_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            is_causal: bool, scale: float | None, layout: str, group_name: str,
                            timeout_s: float) -> tuple[Tensor, Tensor, Tensor]:
    return ring_backward(grad_out, q, k, v, out, lse, is_causal, scale, layout, _Ring(group_name, timeout_s))
