"""Parameters read after `optimizer.step()` inside the step (issue 12, item 1), in every offload
schedule, against eager.

A step that logs a weight norm or returns a weight statistic after the update must see the
updated weights, as eager does. With offloading the update lands through an asynchronous
upload (CPU path) or a device kernel over prefetched state (device path): the step must wait
for a bucket's upload before the first node that reads its parameters after the update, and a
bucket read later in the step is never handed over to the next step. Under the sanitizer
(tests/conftest.py runs this module with it on too) a read not ordered after its wait sees NaN.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import GPT
from steps import TINY, token_batches
from test_offload_planner import BALANCED

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload

pytestmark = pytest.mark.sanitizer_matrix


def _weights_read(model):
    # the tied embedding/head is the last bucket updated (its gradient is final last) and the
    # first one the forward reads; the final norm's weight is among the first updated
    return model.head.weight.norm(), model.ln_f.weight.sum(), model.blocks[-1].mlp[0].weight.abs().mean()


def norm_after_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return (loss, *_weights_read(model))


def clipped_norm_after_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()
    return (loss, *_weights_read(model))


HYBRID = dict(device_updates=2, calibration=BALANCED)
SCHEDULES = {
    "cpu-path": (norm_after_step, Offload(device_updates="never"), False),
    "device-path": (norm_after_step, Offload(device_updates=1, calibration=BALANCED), False),
    "hybrid": (norm_after_step, Offload(**HYBRID), False),
    "overlap-next-step": (norm_after_step, Offload(device_updates="never", overlap_next_step=True), False),
    "hybrid-overlap": (norm_after_step, Offload(overlap_next_step=True, **HYBRID), False),
    "clip": (clipped_norm_after_step, Offload(device_updates="never"), False),
    "park-gradients": (clipped_norm_after_step, Offload(device_updates="never"), True),
}


def _run(schedule: str, sanitize: bool = False) -> None:
    step_fn, offload, park = SCHEDULES[schedule]
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    step = graphoffload.offload_compile(step_fn, offload=offload, config=CompileConfig(
        sanitize=sanitize, fuse_optimizer=FuseOptimizer(bucket_numel=4096, park_gradients=park)))
    for i, batch in enumerate(token_batches(2)):
        expected, got = step_fn(eager, opt_e, batch), step(compiled, opt_c, batch)
        for what, e, g in zip(("loss", "head norm", "ln_f sum", "mlp mean"), expected, got):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i}, {what}: {m}")
    step.synchronize()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(pc, pe, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_parameters_read_after_step_match_eager(schedule):
    _run(schedule)


@pytest.mark.parametrize("schedule", ["overlap-next-step", "hybrid-overlap"])
def test_bucket_read_after_step_is_not_handed_over(schedule):
    step_fn, offload, _ = SCHEDULES[schedule]
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = graphoffload.offload_compile(step_fn, offload=offload, config=CompileConfig(
        fuse_optimizer=FuseOptimizer(bucket_numel=4096)))
    step.compile(model, optimizer, token_batches(1)[0])
    # the tied embedding is read after the update: its bucket waits in this step. Buckets
    # nobody reads after the update are still handed over.
    graph = step.train_graph
    names = {s.name: s.target for s in graph.signature.inputs if s.kind == "param"}
    handed = [{names[p.name] for p in n.args[1]} for n in graph.graph.nodes
              if n.target is torch.ops.graphoffload.hand_over.default]
    assert handed, "no bucket is handed over any more"
    for read in ("tok.weight", "ln_f.weight", f"blocks.{TINY.n_layer - 1}.mlp.0.weight"):
        assert not any(read in params for params in handed), f"{read} is read after the update but handed over"


def test_sanitizer_poisons_a_read_before_its_wait():
    """The sanitizer makes an unordered read visible: a graph that reads a parameter between its
    upload's launch and its wait sees NaN (here built by hand, as the unfixed pass did)."""
    from concurrent.futures import Future

    from graphoffload.runtime.host_offload import OffloadRuntime
    from graphoffload.runtime.sanitizer import Sanitizer
    ops = torch.ops.graphoffload
    param, master = torch.zeros(8), torch.arange(8.0)
    runtime = OffloadRuntime("cpu", sanitizer=Sanitizer(seed=1))
    update_done: Future = Future()   # the host update the upload waits for, still running
    with runtime.active():
        ticket = ops.copy_to_device(runtime.issue(update_done), [master], [], [param])
        early = param.clone()
        update_done.set_result(None)
        ops.wait_device(ticket, [param])
    assert torch.isnan(early).all()
    assert torch.equal(param, master)
