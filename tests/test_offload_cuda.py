"""fuse_optimizer and offload_optimizer on a GPU (skipped without one)."""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import GPT, GPTConfig

import graphoffload
from graphoffload import Offload
from graphoffload.calibration import measure
from graphoffload.passes.offload_optimizer import unseen_device_bytes

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def train_step(model, optimizer, batch):
    loss = model(batch, labels=batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_offloaded_training_on_gpu_matches_eager():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64)
    eager = GPT(cfg).cuda()
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    step = graphoffload.offload_compile(train_step, offload=Offload())
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(5):
        batch = torch.randint(0, 256, (2, 64), device="cuda", generator=g)
        loss_e, loss_c = train_step(eager, opt_e, batch), step(compiled, opt_c, batch)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for pe, pc in zip(eager.parameters(), compiled.parameters()):
        # GPU and CPU fused AdamW round differently in the last bits
        torch.testing.assert_close(pc, pe, rtol=1e-5, atol=1e-6)
    state = opt_c.state[next(compiled.parameters())]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].is_pinned()


def test_model_whose_adam_state_exceeds_the_budget_trains_within_it():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=8192, seq_len=128, n_layer=8, n_head=8, d_model=512)
    model = GPT(cfg).cuda()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    budget = int(param_bytes * 2.5)   # params + grads fit; params + grads + 2 moments would not
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # measured up front: calibration's own buffers are not the step's
    calibration = measure(torch.device("cuda"))
    step = graphoffload.offload_compile(train_step, offload=Offload(gpu_memory_budget=budget, calibration=calibration))
    batch = torch.randint(0, 8192, (1, 128), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()   # the calibration's cached blocks are not the step's reserved memory
    torch.cuda.reset_peak_memory_stats()
    # the first call too: the optimizer state is created in host memory, never on the GPU
    for _ in range(4):
        step(model, opt, batch)
    torch.cuda.synchronize()
    assert 4 * param_bytes > budget
    assert torch.cuda.max_memory_allocated() <= budget
    # the liveness analysis plus what the allocator holds outside the graph's tensors (cuBLAS
    # workspaces, created before the peak counter was reset and still allocated; attention
    # backward's accumulator; blocks record_stream keeps until their copy ends)
    unseen = unseen_device_bytes(step.train_graph.graph, torch.device("cuda"))
    predicted = step.memory().peak + sum(unseen.values())
    for what, measured in (("allocated", torch.cuda.max_memory_allocated()),
                           ("reserved", torch.cuda.max_memory_reserved())):
        assert abs(predicted - measured) <= 0.1 * measured, \
            f"predicted {predicted} bytes ({unseen}), measured {measured} {what}"
