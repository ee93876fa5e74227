"""The memory prediction held to real allocations on the CPU (issue 20 item 5): an allocation-
tracking dispatch mode (helpers.AllocationTracker) measures the bytes the step's ops allocate
beyond what was alive before it, and the liveness analysis' `peak - resident` must match it.

Measured when this was written (GPT 4 layers, d_model 128, AdamW): plain, fused, offload and
parked gradients all 1.0001-1.0005x the prediction. Until the aliasing analysis knew that
`split`'s list of outputs are views of its input (the schema puts that alias on the list's
elements), each q/k/v view counted as a storage of its own and the prediction overestimated
by 12-17% wherever the peak fell inside backward (fused 0.876x, parked 0.832x). The bound below
is [0.99, 1.01]: a prediction that missed an allocation or counted a freed or aliased storage
fails."""

from __future__ import annotations

import functools

import pytest
import torch
from gpt import GPT, GPTConfig
from helpers import AllocationTracker
from steps import clipped_step, token_batches, train_step

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload

CFG = GPTConfig(vocab_size=256, seq_len=8, n_layer=4, n_head=4, d_model=128)
LOW, HIGH = 0.99, 1.01
CASES = {
    "plain": (train_step, dict(config=CompileConfig(disable_passes=("fuse_optimizer",)))),
    "plain-clipped": (clipped_step, dict(config=CompileConfig(disable_passes=("fuse_optimizer",)))),
    "fused": (train_step, {}),
    "offload": (train_step, dict(offload=Offload())),
    "park_gradients": (clipped_step, dict(config=CompileConfig(fuse_optimizer=FuseOptimizer(park_gradients=True)))),
}


@functools.lru_cache(maxsize=None)
def measure(case: str) -> tuple[int, int, int]:
    """(measured, predicted) transient peak of a second step, and the parameters' bytes."""
    fn, kwargs = CASES[case]
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = graphoffload.offload_compile(fn, **kwargs)
    first, second = token_batches(2, CFG.vocab_size, CFG.seq_len)
    step(model, opt, first)   # compiled, and the optimizer state exists
    with AllocationTracker() as tracker:
        step(model, opt, second)
    profile = step.memory()
    return tracker.peak, profile.peak - profile.resident, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_predicted_peak_matches_the_measured_allocations(case):
    measured, predicted, _ = measure(case)
    assert LOW * predicted <= measured <= HIGH * predicted, (case, measured, predicted, measured / predicted)


def test_fusion_and_parking_save_the_gradient_bytes_in_measured_memory():
    plain, _, grad_bytes = measure("plain")
    fused, _, _ = measure("fused")
    assert plain - fused >= 0.6 * grad_bytes, (plain, fused, grad_bytes)
    kept, _, _ = measure("plain-clipped")
    parked, _, _ = measure("park_gradients")
    assert kept - parked >= 0.6 * grad_bytes, (kept, parked, grad_bytes)


def test_the_tracker_sees_what_it_should():
    x = torch.randn(1000)
    with AllocationTracker() as tracker:
        y = x * 2            # 4000 B -> 4096
        z = y.view(10, 100)  # a view: no new storage
        y.mul_(3)            # in place: none
        del y, z
        w = x + 1            # the first one is freed: the peak stays one block run
        v = w[:10].clone()   # 40 B -> 512
    assert tracker.peak == 4096 + 512 and tracker.live == 4096 + 512
    del w, v
