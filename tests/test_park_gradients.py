"""park_gradients: with global-norm clipping, waiting gradients park in host memory during
backward; results stay bit-identical and the predicted device peak falls by the gradients."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from gpt import GPT, GPTConfig
from steps import TINY, clipped_step, foreach_clipped_step, token_batches, train_step
from test_grad_scaler import scaled_clipped_step
from test_offload_planner import BALANCED

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload

ops = torch.ops.graphoffload
PARKED = CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=4096, park_gradients=True))
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, fused=True),
}


def _targets(graph, op) -> list[int]:
    return [i for i, n in enumerate(graph.graph.nodes) if n.target is op.default]


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("step_fn", [clipped_step, foreach_clipped_step], ids=["clip_grad_norm_", "foreach"])
def test_parked_clipped_training_is_bit_identical_to_eager(opt_name, step_fn):
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS[opt_name](eager.parameters()), OPTIMIZERS[opt_name](compiled.parameters())
    step = graphoffload.offload_compile(step_fn, config=PARKED)
    for batch in token_batches(10, TINY.vocab_size, TINY.seq_len):
        assert step(compiled, opt_c, batch).item() == step_fn(eager, opt_e, batch).item()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), name
        for key, value in opt_e.state[pe].items():
            assert torch.equal(value, opt_c.state[pc][key]), (name, key)

    graph = step.train_graph
    nodes = list(graph.graph.nodes)
    last_backward = max(i for i, n in enumerate(nodes) if n.meta["phase"] == "backward")
    parks = _targets(graph, ops.copy_to_host)
    # every gradient parks as soon as it is final, inside backward, but the tied embedding/head
    # weight's, which is final only at the end of backward
    assert len(parks) == len(list(compiled.parameters())) - 1
    assert all(i < last_backward for i in parks)
    restores = _targets(graph, ops.prefetch_to_device)
    assert restores and min(restores) > last_backward
    # the scaling of each gradient was split off and runs beside its own bucket's update
    if step_fn is foreach_clipped_step:
        scalings = [n for n in nodes if getattr(n.target, "overloadpacket", None) is torch.ops.aten._foreach_mul_]
        assert len(scalings) == len(list(compiled.parameters()))


def test_parking_recovers_the_memory_that_clipping_keeps():
    cfg = GPTConfig(vocab_size=256, seq_len=8, n_layer=8, n_head=4, d_model=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = token_batches(1, cfg.vocab_size, cfg.seq_len, batch=1)[0]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    kept = graphoffload.offload_compile(clipped_step)
    kept.compile(model, opt, batch)
    parked = graphoffload.offload_compile(clipped_step, config=CompileConfig(
        fuse_optimizer=FuseOptimizer(park_gradients=True)))
    parked.compile(model, opt, batch)
    captured = parked.memory("captured").peak
    # exact clipping alone keeps every gradient to the end of backward ...
    assert captured - kept.memory("final").peak < 0.2 * grad_bytes
    # ... parking frees them as fusion does without clipping
    assert captured - parked.memory("final").peak >= 0.8 * grad_bytes, (captured, parked.memory("final").peak)
    (note,) = parked.train_graph.notes_of("park_gradients", "parked")
    assert note.fields["gradients"] > 0 and note.fields["peak_after"] < note.fields["peak_before"]


def test_nothing_waits_without_clipping_so_nothing_parks():
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = OPTIMIZERS["adamw"](model.parameters())
    step = graphoffload.offload_compile(train_step, config=PARKED)
    step.compile(model, opt, token_batches(1)[0])
    assert not _targets(step.train_graph, ops.copy_to_host)
    assert "nothing to park" in step.train_graph.notes["park_gradients"][-1]


@pytest.mark.parametrize("init_scale", [2.0**8, 2.0**127], ids=["scaled", "overflow"])
def test_loss_scaled_clipped_gradients_park_and_results_stay_exact(init_scale):
    # fusion splits the GradScaler's inf check per gradient and runs each in backward, so after
    # backward only the clipping and the update read a gradient: it can wait on the host
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["adamw"](eager.parameters()), OPTIMIZERS["adamw"](compiled.parameters())
    scaler_e, scaler_c = (torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2) for _ in range(2))
    step = graphoffload.offload_compile(scaled_clipped_step, config=PARKED)
    for batch in token_batches(6, TINY.vocab_size, TINY.seq_len):
        assert step(compiled, opt_c, scaler_c, batch).item() == scaled_clipped_step(eager, opt_e, scaler_e, batch).item()
    assert scaler_c.get_scale() == scaler_e.get_scale()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), name
        for key, value in opt_e.state[pe].items():
            assert torch.equal(value, opt_c.state[pc][key]), (name, key)
    assert len(_targets(step.train_graph, ops.copy_to_host)) == len(list(compiled.parameters())) - 1
    assert any("inf checks" in line for line in step.train_graph.notes["fuse_optimizer"])
    assert step.memory("final").peak < step.memory("fuse_optimizer").peak


@pytest.mark.parametrize("offload", ["cpu", "hybrid"])
@pytest.mark.parametrize("clip", [clipped_step, foreach_clipped_step], ids=["clip_grad_norm_", "foreach"])
def test_offload_takes_waiting_gradients_to_the_host_itself(offload, clip):
    # CPU-path buckets scale their gradients on the host; device-path ones keep them
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["adamw"](eager.parameters()), OPTIMIZERS["adamw"](compiled.parameters())
    step_fn = functools.partial(clip, max_norm=0.3)
    offload = Offload(device_updates="never") if offload == "cpu" else \
        Offload(device_updates=2, calibration=BALANCED)
    step = graphoffload.offload_compile(step_fn, offload=offload, config=PARKED)
    for batch in token_batches(5, TINY.vocab_size, TINY.seq_len):
        assert step(compiled, opt_c, batch).item() == step_fn(eager, opt_e, batch).item()
    for pe, pc in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(pe, pc)
    notes = step.train_graph.notes
    assert "left to offload_optimizer" in notes["park_gradients"][-1]
    assert not any(spec.target[1] == "parked_grad" for spec in step.train_graph.signature.inputs
                   if spec.kind == "host_scratch")


def test_park_gradients_needs_fuse_optimizer():
    with pytest.raises(graphoffload.PassError, match="requires"):
        step = graphoffload.offload_compile(clipped_step, config=CompileConfig(
            disable_passes=("fuse_optimizer",), fuse_optimizer=FuseOptimizer(park_gradients=True)))
        torch.manual_seed(0)
        model = GPT(TINY)
        step.compile(model, OPTIMIZERS["adamw"](model.parameters()), token_batches(1)[0])
