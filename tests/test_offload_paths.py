"""Every offload schedule against eager training, on the CPU and on a GPU (skipped without one).

On the CPU the "device" is the CPU and copies are synchronous; on a GPU the same graphs run
their copies on side streams, ordered by events, with CPU workers updating concurrently: the
races this file looks for exist only there. Each case trains a few steps and compares losses
and parameters with eager fused AdamW on the same device (on a GPU the CPU path's fused
AdamW rounds differently in the last bits, hence a tolerance)."""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import GPT
from steps import TINY, clipped_step, token_batches, train_step
from test_grad_scaler import scaled_step
from test_offload_planner import BALANCED

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload

# every CPU case runs a second time under the sanitizer (tests/conftest.py)
pytestmark = pytest.mark.sanitizer_matrix

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]

HYBRID = dict(device_updates=2, calibration=BALANCED)
CASES = {
    "cpu-path": (train_step, Offload(device_updates="never"), False),
    "device-path": (train_step, Offload(device_updates=1, calibration=BALANCED), False),
    "hybrid": (train_step, Offload(**HYBRID), False),
    "overlap-next-step": (train_step, Offload(device_updates="never", overlap_next_step=True), False),
    "hybrid-overlap": (train_step, Offload(overlap_next_step=True, **HYBRID), False),
    "clip": (clipped_step, Offload(**HYBRID), False),
    "grad-scaler": (scaled_step, Offload(**HYBRID), False),
    "park-gradients": (clipped_step, None, True),
}


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_offload_schedule_matches_eager(case, device):
    step_fn, offload, park = CASES[case]
    torch.manual_seed(0)
    eager = GPT(TINY).to(device)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = adamw(eager), adamw(compiled)
    step = graphoffload.offload_compile(step_fn, offload=offload, config=CompileConfig(
        fuse_optimizer=FuseOptimizer(bucket_numel=4096, park_gradients=park)))
    scalers = [torch.amp.GradScaler(device, init_scale=2.0**8, growth_interval=2) for _ in range(2)] \
        if step_fn is scaled_step else None
    for i, batch in enumerate(token_batches(5)):
        batch = {k: v.to(device) for k, v in batch.items()}
        if scalers:
            loss_e = step_fn(eager, opt_e, scalers[0], batch)
            loss_c = step(compiled, opt_c, scalers[1], batch)
        else:
            loss_e, loss_c = step_fn(eager, opt_e, batch), step(compiled, opt_c, batch)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i}: {m}")
    step.synchronize()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(pc, pe, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if offload is not None:
        state = opt_c.state[next(compiled.parameters())]
        assert state["exp_avg"].device.type == "cpu"
        assert state["exp_avg"].is_pinned() == (device == "cuda")
    if scalers:
        assert scalers[0].get_scale() == scalers[1].get_scale()
