"""Gradient accumulation: a step that loops over micro-batches and calls backward for each
(the second backward adds into the first's `.grad`, as eagerly), then clips and steps once,
trains exactly like the same function run eagerly; fusion runs each bucket's update inside the
last micro-batch's backward."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_tensors_match, assert_training_matches, hf_gpt2, hf_llama, snapshot, assert_unchanged, tiny_gpt, token_batches

import graphoffload
from graphoffload.errors import UnsupportedError
from graphoffload.passes.update_kernels import find_update_kernels

pytest.importorskip("transformers")

K = 3
MODELS = {
    "llama-adamw": (hf_llama, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, fused=True)),
    "gpt2-sgd": (hf_gpt2, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True)),
}


def micro_batch_step(model, optimizer, micro_batches):
    for mb in micro_batches:
        (model(input_ids=mb["input_ids"], labels=mb["labels"]).loss / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()


def unclipped_micro_batch_step(model, optimizer, micro_batches):
    losses = []
    for mb in micro_batches:
        loss = model(input_ids=mb["input_ids"], labels=mb["labels"]).loss
        (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    optimizer.step()
    optimizer.zero_grad()
    return torch.stack(losses)


def assert_matches_eager(eager, opt_e, compiled, opt_c, exact: bool) -> None:
    """Parameters and the eager optimizer's state agree (an offloaded step also keeps an fp32
    master copy in the state, which eager has not)."""
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert_tensors_match(pe.detach(), pc.detach(), exact, f"parameter {name}")
        assert set(opt_e.state[pe]) <= set(opt_c.state[pc]), name
        for key, value in opt_e.state[pe].items():
            assert_tensors_match(value, opt_c.state[pc][key].to(value.device), exact, f"state {key} of {name}")


def windows(n_steps: int, k: int = K) -> list[list[dict]]:
    batches = token_batches(n_steps * k)
    return [batches[i * k:(i + 1) * k] for i in range(n_steps)]


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_micro_batch_loop_with_clipping_trains_like_eager(name, offload):
    make_model, make_opt = MODELS[name]
    eager = make_model()
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = make_opt(eager), make_opt(compiled)
    step = graphoffload.offload_compile(
        micro_batch_step, offload=graphoffload.Offload(device_updates="never") if offload else None)
    for window in windows(2):
        micro_batch_step(eager, opt_e, window)
        step(compiled, opt_c, window)
    # same kernels in the same order: bit for bit without offload (the host update within 1e-5)
    assert_matches_eager(eager, opt_e, compiled, opt_c, exact=not offload)
    assert all(p.grad is None for p in compiled.parameters())
    # one graph holds the k forwards and backwards: the accumulation adds are in it
    captured = step.graphs["captured"].graph
    adds = [n for n in captured.nodes if n.meta.get("phase") == "backward" and n.target is torch.ops.aten.add_.Tensor]
    n_grads = sum(p.requires_grad for p in compiled.parameters())
    assert len(adds) >= (K - 1) * n_grads


def test_each_update_runs_in_the_last_micro_batch_backward_once_its_gradient_is_final():
    eager = hf_gpt2()
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9, fused=True)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.05, momentum=0.9, fused=True)
    step = graphoffload.offload_compile(unclipped_micro_batch_step, config=graphoffload.CompileConfig(
        fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=5000)))
    for window in windows(2):
        torch.testing.assert_close(step(compiled, opt_c, window), unclipped_micro_batch_step(eager, opt_e, window),
                                   rtol=0, atol=0)
    assert_training_matches(eager, opt_e, [], compiled, opt_c, [], exact=True)

    nodes = list(step.train_graph.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last_backward = max(i for i, n in enumerate(nodes) if n.meta.get("phase") == "backward")
    last_forward = max(i for i, n in enumerate(nodes[:last_backward]) if n.meta.get("phase") == "forward")
    kernels = find_update_kernels(step.train_graph.graph)
    assert len(kernels) > 2
    # inside the last micro-batch's backward: after its forward; all but the embeddings' bucket
    # (final at the very last backward op) before backward ends
    assert all(pos[k.node] > last_forward for k in kernels)
    assert sum(pos[k.node] < last_backward for k in kernels) >= len(kernels) - 1
    assert f"{len(kernels)} run inside backward" in step.explain()
    for k in kernels:
        for grad in k.node.args[1]:
            # after the last write of its gradient: the last micro-batch's accumulation
            writes = [u for u in grad.users if u.target is torch.ops.aten.add_.Tensor and u.args[0] is grad]
            assert grad.target is torch.ops.aten.add_.Tensor and not writes
            assert pos[grad] > last_forward and pos[grad] < pos[k.node]


def two_updates_step(model, optimizer, micro_batches):
    for mb in micro_batches:
        loss = model(mb["input_ids"], labels=mb["labels"])
        loss.backward()  # backward-after-step
        optimizer.step()
        optimizer.zero_grad()


def test_backward_after_step_is_refused_naming_the_line():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    before = snapshot(model, opt)
    with pytest.raises(UnsupportedError, match="backward after optimizer.step") as info:
        graphoffload.offload_compile(two_updates_step)(model, opt, token_batches(2))
    assert "test_grad_accumulation.py" in str(info.value) and "two_updates_step" in str(info.value)
    assert_unchanged(model, opt, before)
