"""Host memory of offloaded state: a few allocations of exactly the state's size (an arena of
views), and persistent scratch for widening low-precision gradients on the host."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_gpt, token_batches, train_step

import graphoffload
from graphoffload import Offload
from graphoffload.runtime.host_arena import ALIGN, HostArena


def _host_inputs(step):
    """The host tensors the last run's graph took, by input name."""
    executor = step.last.executor
    batch = token_batches(1)[0]
    values = executor.inputs((executor.capture.bindings.modules[0], executor.capture.bindings.optimizers[0], batch), {})
    return {s.name: v for s, v in zip(executor.graph.signature.inputs, values) if s.host}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_state_lives_in_one_allocation_of_its_exact_size(dtype):
    model = tiny_gpt(d_model=64).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = graphoffload.offload_compile(train_step, offload=Offload(device_updates="never"))
    for b in token_batches(2):
        step(model, opt, b)
    arena = step.last.executor.host_state.arena
    host = _host_inputs(step)
    exact = sum(t.numel() * t.element_size() for t in host.values())
    assert all(arena.holds(t) for t in host.values()), [n for n, t in host.items() if not arena.holds(t)]
    # master weights, moments, step counters and gradient scratch: one allocation, made on the
    # first run, within 2% of the bytes they need (alignment padding only)
    assert len(arena.chunks) == 1
    assert exact <= arena.allocated_bytes <= 1.02 * exact, (arena.allocated_bytes, exact)
    # the optimizer's own state dict sees the arena's tensors
    for p in model.parameters():
        assert all(arena.holds(v) for v in opt.state[p].values())
    # distinct tensors never share bytes
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in host.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_low_precision_gradients_are_widened_into_persistent_scratch():
    model = tiny_gpt().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = graphoffload.offload_compile(train_step, offload=Offload(device_updates="never"))
    batches = token_batches(3)
    step(model, opt, batches[0])
    runtime = step.last.executor.offload_runtime
    first = {key: t.data_ptr() for key, t in runtime.widened_grads.items()}
    assert len(first) == len(list(model.parameters()))
    assert all(t.dtype == torch.float32 for t in runtime.widened_grads.values())
    for b in batches[1:]:
        step(model, opt, b)
    assert {key: t.data_ptr() for key, t in runtime.widened_grads.items()} == first


def test_arena_views_are_aligned_and_unreserved_requests_get_their_own_allocation():
    arena = HostArena(pin=False)
    arena.reserve([((3,), torch.float32), ((5, 7), torch.bfloat16), ((), torch.float32)])
    a = arena.empty((3,), torch.float32)
    b = arena.empty((5, 7), torch.bfloat16)
    c = arena.empty((), torch.float32)
    assert len(arena.chunks) == 1 and arena.allocated_bytes == ALIGN + 2 * ALIGN + ALIGN   # 70 bytes of bf16 take two
    assert all(t.data_ptr() % ALIGN == 0 for t in (a, b, c)) and b.shape == (5, 7) and c.dim() == 0
    a.fill_(1.0), b.fill_(2.0), c.fill_(3.0)
    assert a.sum() == 3 and b.float().sum() == 70 and c.item() == 3   # no overlap
    d = arena.empty((1000,), torch.float32)
    assert len(arena.chunks) == 2 and arena.holds(d) and not arena.holds(torch.empty(3))
