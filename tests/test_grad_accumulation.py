"""Gradient accumulation: a step that loops over micro-batches and calls backward for each
(the second backward adds into the first's `.grad`, as eagerly), then clips and steps once,
trains exactly like the same function run eagerly; fusion runs each bucket's update inside the
last micro-batch's backward."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (assert_tensors_match, assert_training_matches, assert_unchanged, hf_gpt2, hf_llama, snapshot,
                     tiny_gpt, token_batches, train_step)
from steps import hf_step

import graphoffload
from graphoffload.errors import StateError, UnsupportedError
from graphoffload.passes.update_kernels import find_update_kernels

import transformers  # noqa: E402,F401  (in the `test` extra: missing fails rather than skips)

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


def test_micro_batch_loop_with_a_grad_scaler_trains_like_eager():
    # each micro-batch's loss scaled, one unscale_ + clip + scaler.step() on the sums
    def make():
        model = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

        def step(model, optimizer, micro_batches):
            for mb in micro_batches:
                scaler.scale(model(mb["input_ids"], labels=mb["labels"]) / len(micro_batches)).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return model, opt, scaler, step

    eager, opt_e, scaler_e, step_e = make()
    compiled, opt_c, scaler_c, step_fn = make()
    step = graphoffload.offload_compile(step_fn)
    for window in windows(3):
        step_e(eager, opt_e, window)
        step(compiled, opt_c, window)
        assert scaler_c.get_scale() == scaler_e.get_scale()
    assert scaler_c.get_scale() > 2.0**10     # it grew: the steps were not skipped
    assert_training_matches(eager, opt_e, [], compiled, opt_c, [], exact=True)


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


# --------------------------------------------------------------------------- accumulation_steps=k

OPTIMIZERS = {name: make_opt for name, (_, make_opt) in MODELS.items()}


def eager_window(model, optimizer, micro_batches, step_fn=None, max_norm=None):
    """The eager reference of k calls: k forward/backward with loss/k, then (clip and) step."""
    losses = []
    for mb in micro_batches:
        loss = model(input_ids=mb["input_ids"], labels=mb["labels"]).loss
        (loss / len(micro_batches)).backward()
        losses.append(loss.detach())
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return losses


def hf_clipped_step(model, optimizer, batch):
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_accumulation_steps_updates_every_kth_call_like_eager_accumulation(name, offload):
    make_model, make_opt = MODELS[name]
    eager = make_model()
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = make_opt(eager), make_opt(compiled)
    # an lr schedule outside the step, stepped at each update
    sched_e = torch.optim.lr_scheduler.StepLR(opt_e, 1, gamma=0.5)
    sched_c = torch.optim.lr_scheduler.StepLR(opt_c, 1, gamma=0.5)
    step = graphoffload.offload_compile(hf_step, accumulation_steps=K,
                                        offload=graphoffload.Offload(device_updates="never") if offload else None)
    for w, window in enumerate(windows(3)):
        before = [p.detach().clone() for p in compiled.parameters()]
        losses_e = eager_window(eager, opt_e, window)
        for i, mb in enumerate(window):
            assert step.micro_step == i
            loss = step(compiled, opt_c, mb)
            # the loss returned is the micro-batch's own, not divided by k
            assert_tensors_match(loss, losses_e[i], not offload, f"loss of micro-batch {i} of window {w}")
            if i < K - 1:   # no update before the k-th call; the sum is not on .grad
                assert all(torch.equal(p, b) for p, b in zip(compiled.parameters(), before))
                assert all(p.grad is None for p in compiled.parameters())
        assert step.micro_step == 0
        sched_e.step()
        sched_c.step()
        assert_matches_eager(eager, opt_e, compiled, opt_c, exact=not offload)
    # two variants (accumulate; accumulate and update), SGD's first momentum step a third
    assert step.trace_count == (3 if "sgd" in name else 2)


def test_compile_variants_compiles_both_calls_before_any_runs_them():
    """What a budget is checked against before training: compile_variants gives the accumulating
    and the updating call's graphs without running (micro_step stays, `last` is the next call's
    variant, also when asked mid-window), and the calls then run exactly those graphs, tracing
    nothing more, and train as eager accumulation."""
    make_model, make_opt = MODELS["llama-adamw"]
    eager = make_model()
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = make_opt(eager), make_opt(compiled)
    step = graphoffload.offload_compile(hf_step, accumulation_steps=K,
                                        offload=graphoffload.Offload(device_updates="never"))
    batches = windows(2)
    graphs = step.compile_variants(compiled, opt_c, batches[0][0])
    assert set(graphs) == {"accumulate", "update"} and step.trace_count == 2 and step.micro_step == 0
    # only the updating call updates: its buckets, offloaded to the host
    assert [not g.notes_of("offload_optimizer", "offloaded") for g in graphs.values()] == [True, False]
    assert [not g.notes_of("fuse_optimizer", "buckets") for g in graphs.values()] == [True, False]
    assert step.train_graph is graphs["accumulate"]
    # nothing ran (the optimizer's state is placed on the host, as `compile` places it)
    assert all(p.grad is None and torch.equal(p, q) for p, q in zip(compiled.parameters(), eager.parameters()))
    for w, window in enumerate(batches):
        eager_window(eager, opt_e, window)
        for i, mb in enumerate(window):
            step(compiled, opt_c, mb)
            assert step.train_graph is graphs["update" if i == K - 1 else "accumulate"], (w, i)
            assert step.memory().peak == graphoffload.analyze_memory(step.train_graph).peak
            if w == 0 and i == K - 2:   # mid-window: the next call updates
                assert step.compile_variants(compiled, opt_c, mb) == graphs
                assert step.micro_step == K - 1 and step.train_graph is graphs["update"]
    assert step.trace_count == 2
    assert_matches_eager(eager, opt_e, compiled, opt_c, exact=False)
    plain = graphoffload.offload_compile(hf_step)
    other = copy.deepcopy(eager)
    assert set(plain.compile_variants(other, make_opt(other), batches[0][0])) == {"step"}


def test_clipping_applies_to_the_accumulated_gradient_at_the_update():
    eager = hf_gpt2()
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["llama-adamw"](eager), OPTIMIZERS["llama-adamw"](compiled)
    step = graphoffload.offload_compile(hf_clipped_step, accumulation_steps=K)
    for window in windows(2):
        eager_window(eager, opt_e, window, max_norm=0.05)
        for mb in window:
            step(compiled, opt_c, mb)
    assert_matches_eager(eager, opt_e, compiled, opt_c, exact=True)
    # max_norm is small enough to clip: without clipping (or clipping each micro-batch) it differs
    unclipped = hf_gpt2()
    opt_u = OPTIMIZERS["llama-adamw"](unclipped)
    for window in windows(2):
        eager_window(unclipped, opt_u, window)
    assert not torch.equal(unclipped.transformer.wte.weight, compiled.transformer.wte.weight)


def test_accumulating_call_only_adds_and_the_update_runs_inside_backward():
    model = hf_gpt2()
    opt = OPTIMIZERS["gpt2-sgd"](model)
    step = graphoffload.offload_compile(hf_step, accumulation_steps=K, config=graphoffload.CompileConfig(
        fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=5000)))
    batches = token_batches(K)
    step(model, opt, batches[0])
    accumulate = step.train_graph
    sums = [s for s in accumulate.signature.inputs if s.kind == "grad_sum"]
    assert len(sums) == sum(p.requires_grad for p in model.parameters())
    assert all(s.mutable for s in sums)     # autograd adds into them in place
    assert not find_update_kernels(accumulate.graph)
    assert not [o for o in accumulate.signature.outputs if o.kind == "grad"]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert f"{len(sums)} running gradient sums, {grad_bytes:,} bytes" in step.explain()
    for mb in batches[1:]:
        step(model, opt, mb)
    update = step.train_graph
    kernels = find_update_kernels(update.graph)
    assert len(kernels) > 2 and f"{len(kernels)} run inside backward" in step.explain()
    # the running sums are device memory the predicted peak counts: a gradient set more than
    # the same step without accumulation (whose fused updates free each gradient early)
    plain = graphoffload.offload_compile(hf_step)
    plain.compile(model, opt, batches[0])
    assert step.memory().peak - plain.memory().peak >= grad_bytes


def test_checkpoint_in_the_middle_of_a_window_resumes_it_exactly():
    make_opt = OPTIMIZERS["llama-adamw"]
    batches = token_batches(2 * K)
    reference = hf_llama()
    opt_r = make_opt(reference)
    step_r = graphoffload.offload_compile(hf_step, accumulation_steps=K)
    for mb in batches:
        step_r(reference, opt_r, mb)

    model = hf_llama()
    opt = make_opt(model)
    step = graphoffload.offload_compile(hf_step, accumulation_steps=K)
    for mb in batches[:K + 1]:
        step(model, opt, mb)
    assert step.micro_step == 1
    saved_model, saved_step = copy.deepcopy(model.state_dict()), copy.deepcopy(step.state_dict())
    assert saved_step["accumulation"]["micro_step"] == 1

    resumed = hf_llama(seed=1)
    resumed.load_state_dict(saved_model)
    opt_2 = make_opt(resumed)
    step_2 = graphoffload.offload_compile(hf_step, accumulation_steps=K)
    step_2.load_state_dict(saved_step, optimizers=[opt_2])
    assert step_2.micro_step == 1
    for mb in batches[K + 1:]:
        step_2(resumed, opt_2, mb)
    assert_training_matches(reference, opt_r, [], resumed, opt_2, [], exact=True)

    # a checkpoint without the window cannot be loaded in the middle of one, nor a window of another k
    fresh = graphoffload.offload_compile(hf_step, accumulation_steps=K)
    fresh(model, opt, batches[0])
    with pytest.raises(StateError, match="micro-batch 1 of 3"):
        fresh.load_state_dict({"optimizers": saved_step["optimizers"]})
    with pytest.raises(StateError, match="accumulation_steps=3"):
        graphoffload.offload_compile(hf_step, accumulation_steps=2).load_state_dict(saved_step, optimizers=[opt])


def test_accumulation_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="accumulation_steps"):
        graphoffload.offload_compile(hf_step, accumulation_steps=0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    before = snapshot(model, opt)

    def grad_step(model, optimizer, batch):
        loss = model(batch["input_ids"], labels=batch["labels"])
        grads = torch.autograd.grad(loss, list(model.parameters()))  # autograd-grad-line
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        optimizer.step()
        return loss

    with pytest.raises(UnsupportedError, match="autograd.grad") as info:
        graphoffload.offload_compile(grad_step, accumulation_steps=K)(model, opt, token_batches(1)[0])
    assert "grad_step" in str(info.value)
    assert_unchanged(model, opt, before)


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale-clip-step"])
@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
def test_accumulation_steps_with_a_grad_scaler_trains_like_eager_accumulation(clip, offload):
    """The ordinary scaled step called once per micro-batch: the accumulating calls skip the
    scaler's unscale_/step/update (eager calls them once a window), the updating call unscales,
    checks and steps on the sums, and updates the scale once -- equal to eager to the bit."""
    def make():
        model = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    eager, opt_e, scaler_e = make()
    compiled, opt_c, scaler_c = make()

    def scaled_step(model, optimizer, batch):
        loss = model(batch["input_ids"], labels=batch["labels"])
        scaler_c.scale(loss).backward()
        if clip:
            scaler_c.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler_c.step(optimizer)
        scaler_c.update()
        optimizer.zero_grad()
        return loss

    step = graphoffload.offload_compile(scaled_step, accumulation_steps=K,
                                        offload=graphoffload.Offload(device_updates="never") if offload else None)
    losses_e, losses_c = [], []
    for window in windows(3):
        for mb in window:
            loss = eager(mb["input_ids"], labels=mb["labels"])
            scaler_e.scale(loss / K).backward()
            losses_e.append(loss.detach())
            losses_c.append(step(compiled, opt_c, mb))
            if step.micro_step:   # mid-window: the scale has not moved, as in eager
                assert scaler_c.get_scale() == scaler_e.get_scale()
        if clip:
            scaler_e.unscale_(opt_e)
            torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
        scaler_e.step(opt_e)
        scaler_e.update()
        opt_e.zero_grad()
        assert scaler_c.get_scale() == scaler_e.get_scale()
    assert scaler_c.get_scale() > 2.0**10     # it grew: the updates were not skipped
    step.synchronize()
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True, offloaded=offload)


def test_accumulation_with_uploads_handed_over_to_the_next_call_stays_exact():
    # the updating call's uploads land while the next window's first call runs its forward
    eager = tiny_gpt()
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2, fused=True)
    step = graphoffload.offload_compile(
        train_step, accumulation_steps=K,
        offload=graphoffload.Offload(device_updates="never", overlap_next_step=True),
        config=graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=4096)))
    for window in windows(3):
        for mb in window:
            (eager(mb["input_ids"], labels=mb["labels"]) / K).backward()
            step(compiled, opt_c, mb)
        opt_e.step()
        opt_e.zero_grad()
    step.synchronize()
    assert step.last.executor.handed_over
    assert_matches_eager(eager, opt_e, compiled, opt_c, exact=True)
