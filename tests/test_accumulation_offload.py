"""Running gradient sums in host memory: `offload_compile(..., accumulation_steps=k,
offload=Offload(accumulate_on="host"))` adds each micro-batch's gradients into fp32 host sums
on the CPU worker instead of keeping a gradient set on the device; it trains like eager
accumulation, its predicted device peak is lower by about the gradients' bytes, and explain()
says where the sums live."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import graphoffload
from graphoffload.errors import StateError, StepRunError, UnsupportedError
from graphoffload.timeline import TRACKS

K = 3
OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8))


def step_fn(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def clipped_step_fn(model, optimizer, x, y):
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    optimizer.step()
    optimizer.zero_grad()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)) for _ in range(n)]


def compiled(where: str, fn=step_fn, **offload) -> graphoffload.CompiledStep:
    return graphoffload.offload_compile(fn, accumulation_steps=K,
                                        offload=graphoffload.Offload(accumulate_on=where, **offload))


def eager_micro_step(eager, opt_e, i, x, y) -> None:
    """Eager accumulation, the reference: micro-batch i's loss over K backward, an update every K-th."""
    (torch.nn.functional.mse_loss(eager(x), y) / K).backward()
    if i % K == K - 1:
        opt_e.step()
        opt_e.zero_grad()


def assert_like_eager(eager, model) -> None:
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(pc.detach(), pe.detach(), rtol=1e-5, atol=1e-7, msg=name)


def grad_sum_specs(step) -> list:
    return [s for s in step.train_graph.signature.inputs if s.kind == "grad_sum"]


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_host_sums_train_like_eager_accumulation(opt):
    eager = mlp()
    model = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS[opt](eager), OPTIMIZERS[opt](model)
    step = compiled("host")
    for i, (x, y) in enumerate(batches(3 * K)):
        before = [p.detach().clone() for p in model.parameters()]
        eager_micro_step(eager, opt_e, i, x, y)
        step(model, opt_c, x, y)
        # the running sums are host placeholders in both variants
        assert grad_sum_specs(step) and all(s.host for s in grad_sum_specs(step))
        if i % K != K - 1:
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            assert all(p.grad is None for p in model.parameters())
        else:
            assert_like_eager(eager, model)
    assert step.micro_step == 0
    # the accumulating call copies each gradient out and adds it on the host: no device add into a sum
    accumulate = [v for key, v in step._variants.items() if key[0] is False][0].graph.graph
    targets = [n.target for n in accumulate.nodes]
    assert targets.count(torch.ops.graphoffload.host_accumulate_.default) == len(list(model.parameters()))
    assert torch.ops.aten.add_.Tensor not in targets


def test_host_sums_with_uploads_handed_over_to_the_next_call_train_like_eager():
    eager = mlp()
    model = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["adamw"](eager), OPTIMIZERS["adamw"](model)
    step = graphoffload.offload_compile(step_fn, accumulation_steps=K, offload=graphoffload.Offload(
        accumulate_on="host", overlap_next_step=True), config=graphoffload.CompileConfig(
            fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=3000)))
    for i, (x, y) in enumerate(batches(3 * K)):
        eager_micro_step(eager, opt_e, i, x, y)
        step(model, opt_c, x, y)
    step.synchronize()
    assert_like_eager(eager, model)


def test_host_sums_lower_the_predicted_peak_by_about_the_gradients():
    peaks = {}
    for where in ("device", "host"):
        model = mlp()
        step = compiled(where)
        opt = OPTIMIZERS["adamw"](model)
        data = batches(K)
        step(model, opt, *data[0])                      # the accumulating variant
        peaks[where, "accumulate"] = step.memory().peak
        for x, y in data[1:]:
            step(model, opt, x, y)                      # the updating variant
        peaks[where, "update"] = step.memory().peak
    grad_bytes = sum(p.numel() * p.element_size() for p in mlp().parameters())
    n = len(list(mlp().parameters()))
    saved = peaks["device", "accumulate"] - peaks["host", "accumulate"]
    # a gradient set, give or take the allocator's rounding of each tensor (512-byte blocks)
    assert grad_bytes <= saved <= grad_bytes + 512 * n, (saved, grad_bytes)
    assert peaks["host", "update"] < peaks["device", "update"]


def test_explain_names_where_each_buckets_sums_live(tmp_path):
    for where in ("device", "host"):
        model = mlp()
        opt = OPTIMIZERS["sgd"](model)
        step = graphoffload.offload_compile(step_fn, accumulation_steps=K, offload=graphoffload.Offload(
            accumulate_on=where), config=graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(
                bucket_numel=3000)))
        names = {n for n, _ in model.named_parameters()}
        for i, (x, y) in enumerate(batches(K)):
            step(model, opt, x, y)
            graph = step.train_graph
            [summary] = graph.notes_of("offload_optimizer", "grad_sums")
            assert summary.fields["where"] == where and summary.fields["sums"] == len(names)
            per_bucket = graph.notes_of("offload_optimizer", "grad_sum")
            if i < K - 1:
                assert not per_bucket    # no buckets on an accumulating call
                if where == "host":      # the measured timeline shows the copies and the host adds
                    with open(step.timeline(str(tmp_path / "trace.json"))) as f:
                        spans = {(TRACKS[e["tid"]], e["name"]) for e in json.load(f)["traceEvents"]
                                 if e.get("ph") == "X" and e["pid"] == 2}
                    assert {("cpu", "accumulate"), ("d2h", "copy")} <= spans, spans
            else:
                assert len(per_bucket) > 1 and {n.fields["where"] for n in per_bucket} == {where}
                assert {p for n in per_bucket for p in n.fields["params"]} == names
        if where == "host":
            assert graph.notes_of("offload_optimizer", "no_plan")[0].fields["reason"] == "accumulate_on host"
            assert "running gradient sums on the host" in step.explain()


def logged_norm_step_fn(model, optimizer, x, y):
    torch.nn.functional.mse_loss(model(x), y).backward()
    grad = model[0].weight.grad   # None on an accumulating call
    norm = grad.norm() if grad is not None else torch.zeros(())
    optimizer.step()
    optimizer.zero_grad()
    return norm


def test_host_sums_refuse_a_step_that_reads_the_accumulated_gradient_on_the_device_at_the_first_call():
    # the accumulating call sees .grad as None after backward, yet capture records who reads it:
    # the refusal comes before the first micro-batch runs, not on the k-th call
    model = mlp()
    opt = OPTIMIZERS["adamw"](model)
    for p in model.parameters():   # optimizer state exists (a window already trained)
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    # judged on the updating variant, which the first call compiles as a probe
    step, args = compiled("host", logged_norm_step_fn), (model, opt)
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises(UnsupportedError, match="accumulate_on='device'") as info:
        step(*args, *batches(1)[0])
    # the user's line that reads the gradients
    assert "grad.norm()" in str(info.value) and "test_accumulation_offload.py" in str(info.value)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), params))
    assert all(p.grad is None for p in model.parameters())
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"] and after["state"].keys() == state["state"].keys()
    assert all(torch.equal(after["state"][i][k], v) for i, s in state["state"].items() for k, v in s.items())
    assert step.micro_step == 0


def test_host_sums_resume_a_window_from_a_checkpoint():
    data = batches(2 * K)
    reference, resumed = mlp(), mlp()
    opt_r, opt_s = OPTIMIZERS["adamw"](reference), OPTIMIZERS["adamw"](resumed)
    step_r = compiled("host")
    for x, y in data:
        step_r(reference, opt_r, x, y)
    first = compiled("host")
    for x, y in data[:K + 1]:
        first(resumed, opt_s, x, y)
    saved = first.state_dict()
    again = compiled("host")
    again.load_state_dict(saved, optimizers=[opt_s])
    assert again.micro_step == 1
    for x, y in data[K + 1:]:
        again(resumed, opt_s, x, y)
    for a, b in zip(reference.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_accumulate_on_is_validated():
    with pytest.raises(ValueError, match="accumulate_on"):
        graphoffload.Offload(accumulate_on="cpu")
    graphoffload.Offload(accumulate_on="auto")   # chosen per bucket from the budget
    with pytest.raises(ValueError, match="device_updates"):
        graphoffload.Offload(accumulate_on="host", device_updates=2)


def auto_step(budget, fn=step_fn):
    return graphoffload.offload_compile(fn, accumulation_steps=K, offload=graphoffload.Offload(
        accumulate_on="auto", gpu_memory_budget=budget), config=graphoffload.CompileConfig(
            fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=3000)))


def variant_peaks(where, fn=step_fn):
    """Measured predicted peaks (accumulating, updating) with every sum in one place."""
    model = mlp()
    opt = OPTIMIZERS["adamw"](model)
    step = auto_step(None, fn) if where == "device" else graphoffload.offload_compile(
        fn, accumulation_steps=K, offload=graphoffload.Offload(accumulate_on="host"),
        config=graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=3000)))
    peaks = []
    for i, (x, y) in enumerate(batches(K)):
        step(model, opt, x, y)
        if i >= K - 2:
            peaks.append(step.memory().peak)
    return peaks


@pytest.mark.sanitizer_matrix   # the host and device sums' copies and adds are ordered by the schedule
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_auto_sums_under_a_budget_mix_host_and_device_and_train_like_eager(opt):
    on_device, on_host = variant_peaks("device"), variant_peaks("host")
    assert max(on_host) < max(on_device)
    budget = (max(on_host) + max(on_device)) // 2
    eager = mlp()
    model = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS[opt](eager), OPTIMIZERS[opt](model)
    step = auto_step(budget)
    for i, (x, y) in enumerate(batches(2 * K)):
        eager_micro_step(eager, opt_e, i, x, y)
        step(model, opt_c, x, y)
        assert step.memory().peak <= budget          # each variant's predicted peak fits
        assert all(p.grad is None for p in model.parameters())
    assert_like_eager(eager, model)
    variants = {key[0]: v.graph for key, v in step._variants.items()}
    where = {}
    for update, graph in variants.items():
        [summary] = graph.notes_of("offload_optimizer", "grad_sums")
        assert summary.fields["where"] == "mixed"
        where[update] = {s.target: s.host for s in graph.signature.inputs if s.kind == "grad_sum"}
        [placement] = graph.notes_of("offload_optimizer", "grad_sum_placement")
        assert max(placement.fields["accumulate_peak"], placement.fields["update_peak"]) <= budget
        assert 0 < placement.fields["moved"] < placement.fields["movable"]
    assert where[False] == where[True]              # both variants agree on every sum
    per_bucket = variants[True].notes_of("offload_optimizer", "grad_sum")
    assert {n.fields["where"] for n in per_bucket} == {"host", "device"}
    for note in per_bucket:   # a bucket is all on one side, and the note says which
        assert {where[True][p] for p in note.fields["params"]} == {note.fields["where"] == "host"}
    # the accumulating call copies and adds only the host sums; the device ones add in place
    targets = [n.target for n in variants[False].graph.nodes]
    assert targets.count(torch.ops.graphoffload.host_accumulate_.default) == sum(where[False].values())
    assert targets.count(torch.ops.aten.add_.Tensor) == len(where[False]) - sum(where[False].values())


def test_auto_sums_without_a_budget_stay_on_the_device():
    model = mlp()
    opt = OPTIMIZERS["sgd"](model)
    step = auto_step(None)
    for x, y in batches(K):
        step(model, opt, x, y)
        assert not any(s.host for s in step.train_graph.signature.inputs if s.kind == "grad_sum")
        [summary] = step.train_graph.notes_of("offload_optimizer", "grad_sums")
        assert summary.fields["where"] == "device" and summary.fields["host_sums"] == 0


def test_auto_sums_refuse_a_budget_below_the_all_host_peak_naming_the_minimum():
    least = max(variant_peaks("host"))
    model = mlp()
    opt = OPTIMIZERS["adamw"](model)
    params = [p.detach().clone() for p in model.parameters()]
    step = auto_step(least - 1024)
    with pytest.raises(UnsupportedError, match=f"at least .* \\({least:,} bytes\\)"):
        step(model, opt, *batches(1)[0])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), params))
    assert not opt.state and step.micro_step == 0
    step = auto_step(least)    # exactly the minimum fits: every movable sum on the host
    step(model, opt, *batches(1)[0])
    [placement] = step.train_graph.notes_of("offload_optimizer", "grad_sum_placement")
    assert placement.fields["moved"] == placement.fields["movable"]


def summed_grad_step_fn(model, optimizer, x, y):
    torch.nn.functional.mse_loss(model(x), y).backward()
    grad = model[0].weight.grad   # None on an accumulating call
    total = grad.sum() if grad is not None else torch.zeros(())
    optimizer.step()
    optimizer.zero_grad()
    return total


def test_auto_sums_keep_on_the_device_what_the_step_reads_there():
    # the step's own sum of one gradient reads that accumulated gradient on the device: its
    # sum cannot move, so a budget below the least peak is refused with that reason
    model = mlp()
    opt = OPTIMIZERS["adamw"](model)
    step = auto_step(1024, summed_grad_step_fn)
    with pytest.raises(UnsupportedError, match="reads their accumulated gradients there"):
        step(model, opt, *batches(1)[0])


def own_norm_step_fn(clip: bool):
    """The step's own norm of one accumulated gradient (returned, as one logs it), with or
    without clip_grad_norm_'s norms of every gradient beside it."""
    def own_norm_step(model, optimizer, x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()
        grad = model[0].weight.grad   # None on an accumulating call
        norm = torch.linalg.vector_norm(grad) if grad is not None else torch.zeros(())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad()
        return norm
    return own_norm_step


@pytest.mark.parametrize("clip", [False, True], ids=["own-norm", "own-norm-and-clip"])
def test_auto_sums_keep_on_the_device_a_norm_the_step_takes_of_one_gradient(clip):
    # a step's own norm of one gradient is no part of clip_grad_norm_'s global norm: it pins
    # that gradient's sum (and its bucket) to the device, while a budget moves the other buckets
    # to the host (it was taken for a clipping norm and the step refused "some but not all")
    fn = own_norm_step_fn(clip)
    budget = (max(variant_peaks("host", step_fn)) + max(variant_peaks("device", fn))) // 2
    eager = mlp()
    model = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["adamw"](eager), OPTIMIZERS["adamw"](model)
    step = auto_step(budget, fn)
    for i, (x, y) in enumerate(batches(2 * K)):
        (torch.nn.functional.mse_loss(eager(x), y) / K).backward()
        norm = step(model, opt_c, x, y)
        if i % K == K - 1:
            torch.testing.assert_close(norm, torch.linalg.vector_norm(eager[0].weight.grad), rtol=1e-6, atol=0)
            if clip:
                torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.1)
            opt_e.step()
            opt_e.zero_grad()
            assert_like_eager(eager, model)
        assert step.memory().peak <= budget
    [placement] = step._sum_placements.values()
    assert placement.pinned == frozenset({"0.weight"})
    assert all("0.weight" not in names for _, names in placement.groups)   # its bucket never moves
    assert placement.chosen > 0                                             # other buckets moved
    where = {s.target: s.host for s in grad_sum_specs(step)}
    assert not where["0.weight"] and not where["0.bias"] and any(where.values())
    if clip:   # the moved sums' clipping norms on the host, the pinned bucket's on the device
        assert host_norms(step) == sum(where.values())


def test_host_sums_refuse_a_norm_the_step_takes_of_one_gradient_naming_its_line():
    step = compiled("host", own_norm_step_fn(clip=True))
    model = mlp()
    with pytest.raises(UnsupportedError, match="0.weight on the host: the step reads the accumulated gradient on "
                       "the device besides its update") as info:
        step(model, OPTIMIZERS["adamw"](model), *batches(1)[0])
    assert "torch.linalg.vector_norm(grad)" in str(info.value) and "test_accumulation_offload.py" in str(info.value)
    assert step.micro_step == 0


def trial_compile_peaks(step) -> dict[bool, tuple[int, ...]]:
    """The exact method, per variant: one trial compile of offload_optimizer per number m of
    buckets whose sums move to the host (the oracle of the modelled peaks the step used)."""
    from graphoffload.passes.host_accumulation import trial_peaks
    from graphoffload.passes.manager import PassContext
    from graphoffload.passes.offload_optimizer import _trial

    [placement] = step._sum_placements.values()
    peaks = {}
    for key, variant in step._variants.items():
        stages = list(variant.stages)
        before = variant.stages[stages[stages.index("offload_optimizer") - 1]]   # the pass's input
        ctx = PassContext(step._pass_config(), variant.capture.bindings.device, grad_sum_placement=placement)
        peaks[key[0]] = trial_peaks(before.copy(), ctx, placement, _trial)
    return peaks


@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_auto_sums_modelled_peaks_equal_a_trial_compile_for_every_count_of_buckets_moved(case):
    # the placement predicts both variants' peaks for every m from one trial compile each (plus
    # one with every sum moved, as a check); one trial compile per m must give the same bytes
    from helpers import tiny_gpt, token_batches, train_step

    if case == "mlp":
        model, fn, data, budget = mlp(), step_fn, batches(K), 85_000
    else:
        model, fn, data, budget = tiny_gpt(), train_step, [(b,) for b in token_batches(K)], 10**12
    opt = OPTIMIZERS["adamw"](model)
    step = auto_step(budget, fn)
    for batch in data:
        step(model, opt, *batch)
    [placement] = step._sum_placements.values()
    assert placement.methods == {False: "model", True: "model"}
    assert len(placement.groups) >= (3 if case == "mlp" else 8)
    trials = trial_compile_peaks(step)
    for update in (False, True):
        assert placement.peaks[update] == trials[update], update
        assert len(set(trials[update])) > 1    # moving sums changes the peak
    [note] = step.train_graph.notes_of("offload_optimizer", "grad_sum_placement")
    assert note.fields["method"] == {"accumulate": "model", "update": "model"}


def test_auto_sums_fall_back_to_a_trial_compile_per_count_when_the_model_disagrees():
    # a trial whose compile with every sum moved holds 512 bytes more than the graph shows (as an
    # allocator term the model knew nothing of would): the check at m = all fails, so the peaks
    # come from one trial per count, those bytes included
    from graphoffload.passes.host_accumulation import predicted_peaks, trial_peaks
    from graphoffload.passes.manager import PassContext
    from graphoffload.passes.offload_optimizer import _trial

    model = mlp()
    opt = OPTIMIZERS["adamw"](model)
    step = auto_step(85_000)
    for batch in batches(K):
        step(model, opt, *batch)
    [placement] = step._sum_placements.values()
    everything = placement.hosted(len(placement.groups))

    def skewed(graph, ctx):
        out, unseen = _trial(graph, ctx)
        return out, {**unseen, "unknown": 512 if ctx.grad_sum_placement.host == everything else 0}

    for key, variant in step._variants.items():
        stages = list(variant.stages)
        before = variant.stages[stages[stages.index("offload_optimizer") - 1]]
        ctx = PassContext(step._pass_config(), variant.capture.bindings.device, grad_sum_placement=placement)
        peaks, method = predicted_peaks(before.copy(), ctx, placement, key[0], skewed)
        assert method == "trials"
        assert peaks == trial_peaks(before.copy(), ctx, placement, skewed)
        assert peaks[-1] == placement.peaks[key[0]][-1] + 512 and peaks[:-1] == placement.peaks[key[0]][:-1]


# ---- the CPU adds of an accumulating call run on after it returns (issue 18): the next call
# waits for each right before it first touches that sum, every read from outside the step waits


def columns_step_fn(model, optimizer, x, y, cols):
    # `cols` out of range makes the call fail at run time (in forward), without a re-trace
    loss = torch.nn.functional.mse_loss(model(x).index_select(1, cols), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


COLS = torch.arange(8)


def hold_worker(step) -> threading.Event:
    """Hold the step's CPU worker until the returned event is set (at most 30 s): the adds the
    next call hands over queue behind it, so they are still running when that call returns."""
    gate = threading.Event()
    step.last.executor.offload_runtime.pool.submit(gate.wait, 30)
    return gate


def sums_of(step) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in step._grad_sums._sums.items()}   # without synchronizing


def carried_sums(step) -> list[str]:
    return sorted(k for k in step.last.executor.offload_runtime.carried if k.startswith("grad_sum "))


@pytest.mark.sanitizer_matrix   # the next call's copies into the sums' host buffers wait for the adds
def test_overlapped_host_sum_adds_train_bit_for_bit_like_waiting_for_them():
    # the waiting form: synchronize() after every call, as every call did before the adds overlapped
    data = batches(2 * K)
    runs = {}
    for form in ("overlapped", "waiting"):
        model = mlp()
        opt = OPTIMIZERS["adamw"](model)
        step = graphoffload.offload_compile(step_fn, accumulation_steps=K, offload=graphoffload.Offload(
            accumulate_on="host"), config=graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(
                bucket_numel=3000)))
        mid_window = None
        for i, (x, y) in enumerate(data):
            step(model, opt, x, y)
            if form == "waiting":
                step.synchronize()
            if i == K + 1:
                mid_window = step.state_dict()["accumulation"]["grad_sums"]
        step.synchronize()
        runs[form] = (model, opt, mid_window, step)
    (model, opt, sums, step), (model_w, opt_w, sums_w, _) = runs["overlapped"], runs["waiting"]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_w.parameters()))
    assert all(torch.equal(v, opt_w.state[pw][key]) for p, pw in zip(model.parameters(), model_w.parameters())
               for key, v in opt.state[p].items())
    assert sums.keys() == sums_w.keys() and all(torch.equal(sums[n], sums_w[n]) for n in sums)
    accumulate = [v for key, v in step._variants.items() if key[0] is False][0].graph
    targets = [n.target for n in accumulate.graph.nodes]
    n = len(list(model.parameters()))
    assert targets.count(torch.ops.graphoffload.hand_over.default) == n
    assert targets.count(torch.ops.graphoffload.wait_handed_over.default) == n
    assert accumulate.notes_of("offload_optimizer", "sums_handed_over")[0].fields["sums"] == n


READS = ["step.state_dict", "optimizer.state_dict", "step.synchronize", "recompile", "exception"]


@pytest.mark.parametrize("read", READS)
def test_host_sum_adds_run_on_after_the_call_and_every_outside_read_waits_for_them(read):
    data = batches(3)
    model, twin_model = mlp(), mlp()
    opt, twin_opt = OPTIMIZERS["adamw"](model), OPTIMIZERS["adamw"](twin_model)
    # k=4: the calls below are all accumulating calls of one variant (no re-trace, no switch)
    step, twin = (graphoffload.offload_compile(columns_step_fn, accumulation_steps=4, offload=graphoffload.Offload(
        accumulate_on="host")) for _ in range(2))
    for x, y in data[:2]:
        twin(twin_model, twin_opt, x, y, COLS)
        twin.synchronize()
    step(model, opt, *data[0], COLS)
    gate = hold_worker(step)
    try:
        step(model, opt, *data[1], COLS)
        names = sorted(n for n, _ in model.named_parameters())
        runtime = step.last.executor.offload_runtime
        # the call returned with every add still to run, handed over to the next call
        assert sorted(runtime.sums_in_flight()) == names
        assert carried_sums(step) == [f"grad_sum {n}" for n in names]
        # a counter of the calls that returned, and .grad (None between accumulating calls), do not wait
        assert step.micro_step == 2 and all(p.grad is None for p in model.parameters())
        assert sorted(runtime.sums_in_flight()) == names
        threading.Timer(0.3, gate.set).start()    # the read below must wait for it
        if read == "step.state_dict":
            saved = step.state_dict()["accumulation"]["grad_sums"]
            assert all(torch.equal(saved[n], twin._grad_sums._sums[n]) for n in names)
        elif read == "optimizer.state_dict":
            opt.state_dict()          # a hook of the step's synchronizes first
        elif read == "step.synchronize":
            step.synchronize()
        elif read == "recompile":     # another batch size: the step traces again, reading the parameters
            step.compile(model, opt, data[2][0][:8], data[2][1][:8], COLS)
        else:                         # the next call fails in forward, before it touches a sum
            with pytest.raises(StepRunError, match="index_select"):
                step(model, opt, *data[2], torch.tensor([0, 1, 2, 3, 4, 5, 6, 99]))
        assert runtime.sums_in_flight() == []
        if read != "exception":       # synchronized: nothing left in flight
            assert carried_sums(step) == []
        sums = sums_of(step)
        assert all(torch.equal(sums[n], twin._grad_sums._sums[n]) for n in names)
    finally:
        gate.set()


@pytest.mark.parametrize("surfaces_at", ["next call", "step.state_dict"])
def test_an_error_in_a_handed_over_add_surfaces_at_the_next_call_or_sync_point(surfaces_at):
    model = mlp()
    opt = OPTIMIZERS["adamw"](model)
    step = compiled("host")
    x, y = batches(1)[0]
    step.compile(model, opt, x, y)      # the accumulating variant, not run yet
    gate = hold_worker(step)
    try:
        step(model, opt, x, y)
        # the add into 4.weight's sum will read a host buffer of the wrong shape and raise
        step.last.executor.host_state.scratch[("4.weight", "grad")].set_(torch.zeros(3))
    finally:
        gate.set()
    with pytest.raises(StateError, match="running gradient sum of 4.weight failed after that call returned") as info:
        if surfaces_at == "next call":
            step(model, opt, x, y)
        else:
            step.state_dict()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "step.load_state_dict" in str(info.value)


def test_after_a_failed_handed_over_add_every_call_refuses_until_the_step_is_restored():
    eager = mlp()
    model = copy.deepcopy(eager)
    opt_e, opt = OPTIMIZERS["adamw"](eager), OPTIMIZERS["adamw"](model)
    step = compiled("host")
    data = batches(2 * K)
    step.compile(model, opt, *data[0])
    checkpoint = (copy.deepcopy(model.state_dict()), step.state_dict())   # at an update boundary
    gate = hold_worker(step)
    try:
        step(model, opt, *data[0])
        scratch = step.last.executor.host_state.scratch
        intact = scratch[("4.weight", "grad")].detach()   # the buffer's own memory, to put back
        scratch[("4.weight", "grad")].set_(torch.zeros(3))   # the add handed over will fail
    finally:
        gate.set()
    with pytest.raises(StateError, match="running gradient sum of 4.weight failed after that call returned"):
        step(model, opt, *data[1])
    for _ in range(2):   # not only the call that met the error: every later one, until restored
        with pytest.raises(StateError, match="refusing to run .*4.weight failed.*step.load_state_dict") as info:
            step(model, opt, *data[1])
        assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(StateError, match="refusing to save the window"):
        step.state_dict()    # a checkpoint of incomplete sums would resume them
    assert step.micro_step == 1
    # restored from the checkpoint (and the broken buffer repaired), the step trains like eager
    scratch[("4.weight", "grad")].set_(intact)
    model.load_state_dict(checkpoint[0])
    step.load_state_dict(checkpoint[1])
    assert step.micro_step == 0
    for i, (x, y) in enumerate(data):
        eager_micro_step(eager, opt_e, i, x, y)
        step(model, opt, x, y)
    step.synchronize()
    assert_like_eager(eager, model)


@pytest.mark.slow   # a fresh interpreter imports torch and compiles (~4 s; more on a busy machine)
def test_the_process_exits_after_the_adds_a_last_call_handed_over_have_run(tmp_path):
    script = tmp_path / "exit_mid_window.py"
    script.write_text(textwrap.dedent("""
        import atexit, threading
        import torch
        import graphoffload

        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.AdamW(model.parameters())

        def step_fn(model, opt, x):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        step = graphoffload.offload_compile(step_fn, accumulation_steps=3,
                                            offload=graphoffload.Offload(accumulate_on="host"))
        x = torch.randn(4, 8)
        # the sums the adds must leave, taken before the step: the model's forward after it would
        # wait for the adds in flight (reads after a step do), and so would land them before exit
        expected = {n: torch.autograd.grad((model(x).square().mean() / 3), p)[0] for n, p in model.named_parameters()}
        step.compile(model, opt, x)
        gate = threading.Event()
        runtime = step.last.executor.offload_runtime
        runtime.pool.submit(gate.wait, 30)
        step(model, opt, x)
        assert sorted(runtime.sums_in_flight()) == ["bias", "weight"]

        def at_exit():   # runs after the interpreter joined the worker threads
            done = runtime.sums_in_flight() == [] and all(
                torch.equal(step._grad_sums._sums[n], g) for n, g in expected.items())
            print("adds landed" if done else "adds lost", flush=True)
        atexit.register(at_exit)
        threading.Timer(0.5, gate.set).start()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "adds landed" in proc.stdout, proc.stdout + proc.stderr[-2000:]


# ---- clip_grad_norm_ with host sums (issue 18): each host sum's part of the global norm is taken
# on the host from the accumulated gradient, the device sums' on the device, and the host update
# applies the clip coefficient


def clip_step_fn(max_norm: float, foreach: bool):
    def clip_step(model, optimizer, x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=foreach)
        optimizer.step()
        optimizer.zero_grad()
        return norm
    return clip_step


def eager_clipped_micro_step(eager, opt_e, i, x, y, max_norm, foreach) -> torch.Tensor | None:
    (torch.nn.functional.mse_loss(eager(x), y) / K).backward()
    if i % K != K - 1:
        return None
    norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm, foreach=foreach)
    opt_e.step()
    opt_e.zero_grad()
    return norm


def assert_clipped_like_eager(step, max_norm, foreach, windows=3) -> list[float]:
    """Trains `step` and eager accumulation side by side; returns eager's global norms."""
    eager = mlp()
    model = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["adamw"](eager), OPTIMIZERS["adamw"](model)
    norms = []
    for i, (x, y) in enumerate(batches(windows * K)):
        expected = eager_clipped_micro_step(eager, opt_e, i, x, y, max_norm, foreach)
        norm = step(model, opt_c, x, y)
        if expected is not None:   # the updating call: the global norm over the accumulated gradients
            torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
            norms.append(float(expected))
            assert_like_eager(eager, model)
    return norms


def host_norms(step) -> int:
    update = [v for key, v in step._variants.items() if key[0] is True][0].graph
    return [n.target for n in update.graph.nodes].count(torch.ops.graphoffload.host_grad_norm_.default)


@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
@pytest.mark.parametrize("max_norm", [0.1, 100.0], ids=["clips", "does-not-clip"])
def test_host_sums_clip_grad_norm_like_eager(max_norm, foreach):
    step = compiled("host", clip_step_fn(max_norm, foreach))
    norms = assert_clipped_like_eager(step, max_norm, foreach)
    # the case clips (or not) on every update
    assert all((n > max_norm) == (max_norm == 0.1) for n in norms), norms
    assert all(s.host for s in grad_sum_specs(step))
    assert host_norms(step) == len(list(mlp().parameters()))   # every gradient's norm taken on the host


def test_auto_sums_with_clip_grad_norm_move_under_a_budget_and_train_like_eager():
    fn = clip_step_fn(0.1, False)
    on_device, on_host = variant_peaks("device", fn), variant_peaks("host", fn)
    budget = (max(on_host) + max(on_device)) // 2
    step = auto_step(budget, fn)
    assert_clipped_like_eager(step, 0.1, False, windows=2)
    [placement] = step._sum_placements.values()
    assert placement.pinned == frozenset()   # clipping no longer pins its sums to the device
    assert 0 < placement.chosen < len(placement.groups)
    hosted = sum(s.host for s in grad_sum_specs(step))
    assert 0 < hosted < len(grad_sum_specs(step))
    assert host_norms(step) == hosted        # the host sums' norms on the host, the others on the device
    assert step.memory().peak <= budget


# A GradScaler with host sums: on the updating call each host-sum gradient's inf check (and
# unscale) runs on the host after its drain, and its flag joins the device's by their max
# before the updates and scaler.update() read it


def returned_loss_scaled_step_fn(model, optimizer, scaler, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.detach()


MAX_NORM = 0.1


def scaled_clipped_step_fn(model, optimizer, scaler, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.detach()


def overflowing_batches(windows: int, poisoned: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`batches`, with an inf in micro-batch `poisoned`'s input: its loss and gradients are not
    finite, so the window it belongs to must skip its update and halve the scale."""
    out = batches(windows * K)
    x, y = out[poisoned]
    x = x.clone()
    x[0, 0] = float("inf")
    out[poisoned] = (x, y)
    return out


def host_checks(step) -> int:
    update = [v for key, v in step._variants.items() if key[0] is True][0].graph
    return [n.target for n in update.graph.nodes].count(torch.ops.graphoffload.host_unscale_.default)


def assert_scaled_like_eager(step, windows=4, poisoned=K + 1, clip=False) -> list[float]:
    """Trains `step` and eager accumulation with a GradScaler side by side over `windows`
    windows, window poisoned // K overflowing; `clip`: unscale_ then clip_grad_norm_ before the
    step (scaled_clipped_step_fn). Returns the scale after each update."""
    eager = mlp()
    model = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["adamw"](eager), OPTIMIZERS["adamw"](model)
    scaler_e, scaler_c = (torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2))
    scales, before = [], None
    for i, (x, y) in enumerate(overflowing_batches(windows, poisoned)):
        if i % K == 0:
            before = [p.detach().clone() for p in model.parameters()]
        loss_e = torch.nn.functional.mse_loss(eager(x), y)
        scaler_e.scale(loss_e / K).backward()
        if i % K == K - 1:
            if clip:
                scaler_e.unscale_(opt_e)
                torch.nn.utils.clip_grad_norm_(eager.parameters(), MAX_NORM)
            scaler_e.step(opt_e)
            scaler_e.update()
            opt_e.zero_grad()
        loss = step(model, opt_c, scaler_c, x, y)
        torch.testing.assert_close(loss, loss_e.detach(), rtol=1e-5, atol=1e-7, equal_nan=True)
        if i % K == K - 1:
            assert scaler_c.get_scale() == scaler_e.get_scale(), i
            scales.append(scaler_c.get_scale())
            assert_like_eager(eager, model)
            if i // K == poisoned // K:   # the skipped update changed nothing
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return scales


@pytest.mark.sanitizer_matrix   # the inv_scale copy, drains, host checks and the flags' fetch are ordered by the schedule
@pytest.mark.parametrize("clip", [False, True], ids=["scaled", "unscale-clip"])
def test_host_sums_grad_scaler_checks_on_the_host_and_skips_an_overflowing_window_like_eager(clip):
    step = compiled("host", scaled_clipped_step_fn if clip else returned_loss_scaled_step_fn)
    scales = assert_scaled_like_eager(step, clip=clip)
    # window 1 overflowed (the scale halves), the others grew it every second update
    assert scales == [2.0**10, 2.0**9, 2.0**9, 2.0**10], scales
    assert all(s.host for s in grad_sum_specs(step))
    params = len(list(mlp().parameters()))
    assert host_checks(step) == params                           # every gradient's check on the host
    assert host_norms(step) == (params if clip else 0)           # and, clipping, its norm after it


def test_auto_sums_with_a_grad_scaler_move_under_a_budget_and_skip_like_eager():
    def peaks(step) -> int:
        model = mlp()
        opt = OPTIMIZERS["adamw"](model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        out = []
        for i, (x, y) in enumerate(batches(K)):
            step(model, opt, scaler, x, y)
            if i >= K - 2:
                out.append(step.memory().peak)
        return max(out)

    fn = scaled_clipped_step_fn   # host checks and norms beside device ones
    on_device, on_host = peaks(auto_step(None, fn)), peaks(graphoffload.offload_compile(
        fn, accumulation_steps=K, offload=graphoffload.Offload(accumulate_on="host"),
        config=graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=3000))))
    budget = (on_host + on_device) // 2
    step = auto_step(budget, fn)
    assert_scaled_like_eager(step, windows=3, clip=True)
    [placement] = step._sum_placements.values()
    assert placement.pinned == frozenset()   # the GradScaler no longer pins its sums to the device
    assert 0 < placement.chosen < len(placement.groups)
    hosted = sum(s.host for s in grad_sum_specs(step))
    assert 0 < hosted < len(grad_sum_specs(step))
    assert host_checks(step) == host_norms(step) == hosted   # the host sums' checks and norms on the host
    assert step.memory().peak <= budget
