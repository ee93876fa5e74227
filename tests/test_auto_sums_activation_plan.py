"""`Offload(accumulate_on="auto", activations="auto")` under a budget that no placement of the
running sums meets with the saved activations kept: the placement's trial compiles keep the
activations, so "auto" sums used to refuse such a budget even where the activation planner could
meet it. Now the placement takes the count of buckets moved with the least need and leaves the rest
to the planner: the step compiles, both variants' predicted peaks fit, the `grad_sum_placement` note
says the choice was made without a fit, and it trains like eager accumulation (fp32, rel 1e-5) over
three windows; a budget below what the planner reaches is refused by the planner, naming the
budget and what to do; with activations kept the refusal stays. Under ZeRO the whole-step choice
(`choose_step_sums`) takes the lesser trial peak the same way, on every rank of a two-rank group
alike, and trains as the explicit choice."""

from __future__ import annotations

import copy

import pytest
import torch
from test_activation_plan import FAST_COMPUTE
from test_checkpointing import Mlp, adamw, mlp_batches, mlp_step

import graphoffload
from graphoffload import Offload, UnsupportedError
from graphoffload.memory import analyze_memory
from graphoffload.passes.host_accumulation import choose_step_sums

K = 2


def _model() -> Mlp:
    torch.manual_seed(0)
    return Mlp(width=32, depth=3, dropout=0.2, checkpointed=False)


def _batches(n: int) -> list[dict]:
    return mlp_batches(n, rows=256)


def _step(budget, **offload) -> graphoffload.CompiledStep:
    return graphoffload.offload_compile(mlp_step, accumulation_steps=K, offload=Offload(
        accumulate_on="auto", gpu_memory_budget=budget, device_updates="never", calibration=FAST_COMPUTE,
        plan_cache=False, **offload), config=graphoffload.CompileConfig(
            fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=6000)))


@pytest.fixture(scope="module")
def kept_needs() -> list[int]:
    """The step's device need (the max of both variants' predicted peaks, activations kept) for
    every count of buckets whose sums move to the host, as the placement predicts them."""
    model = _model()
    opt = adamw(model)
    step = _step(10**12)
    for batch in _batches(K):
        step(model, opt, batch)
    [placed] = step.train_graph.notes_of("offload_optimizer", "grad_sum_placement")
    peaks = placed.fields["peaks"]
    assert placed.fields["movable"] > 1 and not placed.fields["unfitted"]
    return [max(a, u) for a, u in zip(peaks["accumulate"], peaks["update"])]


def test_a_budget_no_placement_meets_with_activations_kept_is_met_by_the_activation_planner(kept_needs):
    budget = int(0.7 * min(kept_needs))
    model, batches = _model(), _batches(3 * K)
    # activations kept: the refusal stays, naming the least need
    kept = _step(budget)
    with pytest.raises(UnsupportedError, match=f"gpu_memory_budget {budget} cannot be met with "
                       f"accumulate_on='auto'.*\\({min(kept_needs):,} bytes\\)"):
        refused = copy.deepcopy(model)
        kept(refused, adamw(refused), batches[0])
    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    opt_e, opt_c = adamw(eager), adamw(compiled)
    step = _step(budget, activations="auto")
    torch.manual_seed(5)
    losses_c = [step(compiled, opt_c, batch) for batch in batches]
    torch.manual_seed(5)   # eager accumulation: the mean of the micro-batches' gradients, the same dropout masks
    losses_e = []
    for i, batch in enumerate(batches):
        loss = eager(batch["x"], batch["y"])
        (loss / K).backward()
        losses_e.append(loss.detach())
        if i % K == K - 1:
            opt_e.step()
            opt_e.zero_grad()
    torch.testing.assert_close(torch.stack(losses_c), torch.stack(losses_e), rtol=1e-5, atol=1e-7)
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(pc.detach(), pe.detach(), rtol=1e-5, atol=1e-7, msg=name)
    least = min(range(len(kept_needs)), key=kept_needs.__getitem__)
    on_host = {}
    for update, variant in ((key[0], v) for key, v in step._variants.items()):
        assert analyze_memory(variant.graph).peak <= budget, update
        [placed] = variant.graph.notes_of("offload_optimizer", "grad_sum_placement")
        assert placed.fields["unfitted"] and placed.fields["moved"] == least, placed.fields
        assert "activation planner (activations='auto') left to meet the budget" in placed
        activations = variant.graph.notes_of("offload_optimizer", "activations")[0].fields
        assert activations["recompute"] + activations["offload"] > 0, update
        on_host[update] = {s.target for s in variant.graph.signature.inputs if s.kind == "grad_sum" and s.host}
    assert on_host[False] == on_host[True] and bool(on_host[True]) == (least > 0)   # both variants agree


def test_a_budget_below_what_the_activation_planner_reaches_is_refused_by_it(kept_needs):
    budget = int(0.3 * min(kept_needs))
    model = _model()
    opt = adamw(model)
    params = [p.detach().clone() for p in model.parameters()]
    step = _step(budget, activations="auto")
    with pytest.raises(UnsupportedError, match=f"gpu_memory_budget {budget} cannot be met: .*activations='auto' "
                       "recomputed .*Raise the budget"):
        step(model, opt, _batches(1)[0])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), params))
    assert not opt.state and step.micro_step == 0


def test_zero_whole_step_sums_without_a_fit_take_the_lesser_peak_only_with_activation_planning():
    # some trial peak fits: decisions as before, with or without activation planning
    for planned in (False, True):
        assert choose_step_sums(100, 90, 80, None, planned).where == "device"
        assert choose_step_sums(100, 120, 80, None, planned).where == "host"
        assert not choose_step_sums(100, 120, 80, None, planned).unfitted
    # neither fits, activations kept: host sums, as before (the real compile refuses the budget)
    kept = choose_step_sums(100, 150, 120, None, False)
    assert kept.where == "host" and not kept.unfitted
    # neither fits, activations="auto": the lesser, the planner left to meet the budget
    for device_peak, host_peak, want in ((150, 120, "host"), (150, 160, "device"), (150, 150, "device")):
        choice = choose_step_sums(100, device_peak, host_peak, None, True)
        assert (choice.where, choice.unfitted) == (want, True), (device_peak, host_peak)
        assert "left to meet the budget" in choice.describe()
    # host sums refused: device sums, whatever the peaks
    assert choose_step_sums(100, 150, 120, "refused", True).where == "device"


def _zero_sums_left_to_the_activation_planner(rank: int, world: int) -> None:
    """ZeRO stage 2, `accumulate_on="auto"` and `activations="auto"` under a budget 0.8x the
    lesser trial peak (activations kept): every rank chooses the lesser one's sums (host),
    marked unfitted, in both variants; the activation planner brings each variant's predicted
    peak under the budget; and a window and its update train bit for bit as the explicit
    host-sums step with activations="auto" at the same budget (which plans the same graph)."""
    import torch.distributed as dist
    from helpers import whole
    from test_zero_offload_accumulation import _auto_step, _gpt, _mine, _optimizer, _windows

    def batches():
        return [_mine(batch, rank, world) for batch in _windows(1)[0]]

    def auto_step(budget, where="auto", activations="keep"):
        # a fixed calibration: with this machine's measured one the plan (and so what a budget
        # can reach) would depend on the machine and its load
        return _auto_step(budget, where, activations, calibration=FAST_COMPUTE)

    probe_model = _gpt()
    probe = auto_step(1 << 40)
    probe.compile(probe_model, _optimizer("adamw", probe_model), batches()[0])
    peaks = probe.last.graph.notes_of("zero", "sum_choice")[0].fields
    assert peaks["host_peak"] < peaks["device_peak"], peaks
    budget = int(0.8 * peaks["host_peak"])
    runs = {}
    for where in ("auto", "host"):
        model = _gpt()
        opt = _optimizer("adamw", model)
        step = auto_step(budget, where, activations="auto")
        runs[where] = (step, model, opt, [step(model, opt, batch) for batch in batches()])
    step = runs["auto"][0]
    assert len(step._variants) == 2
    for variant in step._variants.values():
        [choice] = variant.graph.notes_of("zero", "sum_choice")
        assert (choice.fields["where"], choice.fields["unfitted"]) == ("host", True), choice.fields
        assert "left to meet the budget" in str(choice)
        [planned] = variant.graph.notes_of("offload_optimizer", "activations")
        assert planned.fields["peak_bytes"] <= budget < planned.fields["keep_peak_bytes"], planned.fields
    (_, model, opt, losses), (_, ref_model, ref_opt, ref_losses) = runs["auto"], runs["host"]
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (rank, losses, ref_losses)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(whole(p), whole(q)), (rank, name)
        for key, t in opt.state[p].items():
            assert torch.equal(whole(t), whole(ref_opt.state[q][key])), (rank, name, key)
    everyone = [None] * world
    dist.all_gather_object(everyone, (budget, peaks["device_peak"], peaks["host_peak"]))
    assert all(e == everyone[0] for e in everyone), everyone   # one choice from peaks reduced over ranks


@pytest.mark.slow   # two processes
def test_zero_sums_without_a_fit_are_left_to_the_activation_planner_on_two_ranks():
    from ring_dist import run_ranks

    run_ranks(_zero_sums_left_to_the_activation_planner, 2, deadline_s=240)
