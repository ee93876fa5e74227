"""Loss scaling: a torch.amp.GradScaler inside the step is captured (its scale and growth
tracker are graph inputs updated in place) and the fused kernels unscale and skip on inf,
with and without offloading."""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import GPT
from steps import TINY, token_batches
from test_offload_planner import BALANCED

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload


def scaled_step(model, optimizer, scaler, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss


def scaled_clipped_step(model, optimizer, scaler, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss


OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)}
OFFLOADS = {"none": None, "cpu": Offload(device_updates="never"),
            "hybrid": Offload(device_updates=2, calibration=BALANCED)}


@pytest.mark.parametrize("offload", sorted(OFFLOADS))
@pytest.mark.parametrize("step_fn", [scaled_step, scaled_clipped_step], ids=["scaled", "unscale-clip"])
@pytest.mark.parametrize("opt_name,init_scale", [("adamw", 2.0**8), ("sgd", 2.0**8), ("adamw", 2.0**127)],
                         ids=["adamw", "sgd", "adamw-overflow"])
def test_loss_scaled_training_matches_eager(offload, step_fn, opt_name, init_scale):
    # 2**127 overflows the scaled loss: those steps are skipped, the scale backs off, the step
    # counters do not move. (SGD is left out of overflow: after a skipped first step torch's
    # fused SGD keeps an uninitialised momentum buffer, graphoffload a zeroed one.)
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS[opt_name](eager.parameters()), OPTIMIZERS[opt_name](compiled.parameters())
    scaler_e = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    scaler_c = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    step = graphoffload.offload_compile(step_fn, offload=OFFLOADS[offload],
                                        config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=4000)))
    scales = []
    for b in token_batches(5):
        assert step_fn(eager, opt_e, scaler_e, b).item() == step(compiled, opt_c, scaler_c, b).item()
        assert scaler_c.get_scale() == scaler_e.get_scale()
        scales.append(scaler_c.get_scale())
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), name
        for key, value in opt_e.state[pe].items():
            assert torch.equal(value, opt_c.state[pc][key]), (name, key)
    if init_scale > 1e30:
        assert scales[0] < init_scale          # the overflow was seen and skipped
    else:
        assert max(scales) > init_scale        # growth_interval=2: the scale grew


def test_offloaded_scaled_gradients_leave_the_device_inside_backward():
    # the inf checks run per gradient inside backward, so although every update waits for all
    # of them, each gradient is copied to the host (and freed) as soon as it is final
    from gpt import GPTConfig
    from steps import train_step
    cfg = GPTConfig(vocab_size=256, seq_len=8, n_layer=8, n_head=4, d_model=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = OPTIMIZERS["adamw"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    batch = token_batches(1, cfg.vocab_size, cfg.seq_len, batch=1)[0]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    plain = graphoffload.offload_compile(train_step, offload=Offload(device_updates="never"))
    plain.compile(model, opt, batch)
    scaled = graphoffload.offload_compile(scaled_step, offload=Offload(device_updates="never"))
    scaled.compile(model, opt, scaler, batch)
    assert scaled.memory("final").peak <= plain.memory("final").peak + 0.1 * grad_bytes
    nodes = list(scaled.train_graph.graph.nodes)
    last_backward = max(i for i, n in enumerate(nodes) if n.meta["phase"] == "backward")
    copies = [i for i, n in enumerate(nodes) if n.target is torch.ops.graphoffload.copy_to_host.default
              and n.args[0] and n.args[0][0].meta["val"].dim() > 0]
    assert sum(i < last_backward for i in copies) >= len(list(model.parameters())) - 1


def test_an_overflow_in_the_last_gradient_skips_every_bucket():
    # only the embedding's gradient overflows, and it is final last in backward: the buckets
    # whose gradients were final (and checked) earlier must still wait for its check
    def poisoned_step(model, optimizer, scaler, batch):
        loss = model(batch["input_ids"], labels=batch["labels"])
        weight = model.tok.weight
        loss = loss + 1e37 * (weight - weight.detach()).sum()   # adds 0, but a gradient of 1e37
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss

    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["adamw"](eager.parameters()), OPTIMIZERS["adamw"](compiled.parameters())
    scaler_e, scaler_c = (torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in range(2))
    step = graphoffload.offload_compile(poisoned_step, config=CompileConfig(
        fuse_optimizer=FuseOptimizer(bucket_numel=1)))
    before = [p.detach().clone() for p in compiled.parameters()]
    for batch in token_batches(3, TINY.vocab_size, TINY.seq_len):
        assert step(compiled, opt_c, scaler_c, batch).item() == poisoned_step(eager, opt_e, scaler_e, batch).item()
    assert scaler_c.get_scale() == scaler_e.get_scale() == 2.0**8 / 8   # three skipped steps
    for pe, pc, p0 in zip(eager.parameters(), compiled.parameters(), before):
        assert torch.equal(pc, pe) and torch.equal(pc, p0)
