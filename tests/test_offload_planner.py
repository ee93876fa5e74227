"""The offload planner on synthetic calibrations, and hybrid (CPU + device) training."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from gpt import GPT, GPTConfig
from steps import TINY, token_batches, train_step

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload
from graphoffload.calibration import Calibration
from graphoffload.passes.offload_planner import BucketCost, StepCosts, plan, predict

# an H100 box as the research notes measured it
BALANCED = Calibration(h2d_bytes_per_s=55e9, d2h_bytes_per_s=55e9, duplex_bytes_per_s=72e9,
                       cpu_update_params_per_s=4.6e9, cpu_update_params_per_s_under_copy=2.7e9,
                       device_update_params_per_s=93e9, device_flops=700e12, device_bytes_per_s=3e12)
SLOW_PCIE = dataclasses.replace(BALANCED, h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9, duplex_bytes_per_s=2.5e9)
SLOW_CPU = dataclasses.replace(BALANCED, cpu_update_params_per_s=0.2e9, cpu_update_params_per_s_under_copy=0.1e9)


def synthetic_step(n_buckets: int = 16, numel: int = 50_000_000, backward_s: float = 0.1,
                   live: int = 8 << 30) -> StepCosts:
    """A 24-layer-like step: forward then backward, one bucket ready every backward slice."""
    nodes = 4 * n_buckets
    node_seconds = [backward_s / nodes] * nodes
    buckets = [BucketCost(f"b{i}", numel, ready_node=2 * n_buckets + 2 * i + 1, grad_bytes=2 * numel,
                          upload_bytes=2 * numel, state_bytes=12 * numel) for i in range(n_buckets)]
    return StepCosts(node_seconds, [live] * nodes, buckets)


def test_all_cpu_when_pcie_is_slow():
    best, _ = plan(synthetic_step(), SLOW_PCIE)
    assert set(best.assignment) == {"cpu"}


def test_all_device_when_the_cpu_is_slow():
    best, _ = plan(synthetic_step(), SLOW_CPU)
    assert set(best.assignment) == {"device"}


def test_a_mix_when_balanced_and_faster_than_either_extreme():
    best, scored = plan(synthetic_step(), BALANCED)
    assert 0 < best.assignment.count("device") < len(best.assignment)
    assert best.step_seconds < scored["all-cpu"] and best.step_seconds < scored["all-device"]


def test_gradients_scaled_after_backward_still_leave_during_backward_on_the_cpu_path():
    # with clipping every update waits for the end of backward, but the CPU path's copies need not
    costs = synthetic_step()
    end = len(costs.node_seconds) - 1
    waiting = StepCosts(costs.node_seconds, costs.live_bytes,
                        [dataclasses.replace(b, ready_node=end) for b in costs.buckets])
    copied_early = StepCosts(costs.node_seconds, costs.live_bytes,
                             [dataclasses.replace(b, ready_node=end, grads_final_node=b.ready_node)
                              for b in costs.buckets])
    all_cpu = ("cpu",) * len(costs.buckets)
    late, early = predict(waiting, all_cpu, BALANCED), predict(copied_early, all_cpu, BALANCED)
    assert early.step_seconds < late.step_seconds
    first_copy = min(e.start for e in early.events if e.track == "d2h")
    first_update = min(e.start for e in early.events if e.track == "cpu")
    assert first_copy < early.node_start[end] <= first_update   # copies in backward, updates after it


def test_handing_uploads_over_to_the_next_forward_hides_the_update_tail():
    costs = synthetic_step()
    n = len(costs.buckets)
    # backward finalises the last layers first: the last bucket ready is the first one forward reads
    buckets = [dataclasses.replace(b, first_use_node=2 * (n - 1 - i)) for i, b in enumerate(costs.buckets)]
    waited = StepCosts(costs.node_seconds, costs.live_bytes, buckets)
    handed_over = dataclasses.replace(waited, overlap_next_step=True)
    at_end, _ = plan(waited, BALANCED)
    overlapped, scored = plan(handed_over, BALANCED)
    assert sum(costs.node_seconds) <= overlapped.step_seconds < at_end.step_seconds
    assert overlapped.step_seconds <= min(scored.values()) + 1e-12
    # all on the CPU the worker is the bottleneck and the last bucket it uploads is the first
    # one forward reads: handing over gains nothing there, and the model says so
    all_cpu = ("cpu",) * n
    assert predict(handed_over, all_cpu, BALANCED).step_seconds == pytest.approx(
        predict(waited, all_cpu, BALANCED).step_seconds)


@pytest.mark.parametrize("cal", [BALANCED, SLOW_PCIE, SLOW_CPU], ids=["balanced", "slow-pcie", "slow-cpu"])
def test_never_worse_than_any_fixed_stride(cal):
    best, scored = plan(synthetic_step(), cal)
    for name, seconds in scored.items():
        assert best.step_seconds <= seconds + 1e-12, name


@pytest.mark.parametrize("budget_gib", [8.5, 9, 10])
def test_plan_stays_within_the_memory_budget(budget_gib):
    budget = int(budget_gib * 2**30)
    costs = synthetic_step(live=8 << 30)
    best, _ = plan(costs, SLOW_CPU, budget)
    assert best.peak_bytes <= budget
    assert max(best.device_bytes) <= budget
    # every device-path bucket holds 12 B/param of state: the budget caps how many fit at once
    assert best.assignment.count("device") <= (budget - (8 << 30)) // (12 * 50_000_000)
    assert predict(costs, ("device",) * 16, SLOW_CPU, budget) is None


def test_prediction_counts_contention():
    costs = synthetic_step(n_buckets=4)
    alone = dataclasses.replace(BALANCED, cpu_update_params_per_s_under_copy=BALANCED.cpu_update_params_per_s)
    slowed = predict(costs, ("cpu",) * 4, BALANCED).step_seconds
    assert slowed > predict(costs, ("cpu",) * 4, alone).step_seconds


@pytest.mark.parametrize("device_updates", [2, "auto"])
def test_hybrid_training_matches_eager_bit_for_bit(device_updates, tmp_path):
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    # a calibration under which a mix wins, so both paths run in the graph
    step = graphoffload.offload_compile(
        train_step, config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=2048)),
        offload=Offload(device_updates=device_updates, calibration=dataclasses.replace(
            BALANCED, device_update_params_per_s=1e6, cpu_update_params_per_s=1e6,
            cpu_update_params_per_s_under_copy=1e6)))
    for b in token_batches(8):
        assert train_step(eager, opt_e, b).item() == step(compiled, opt_c, b).item()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), name
        for key, value in opt_e.state[pe].items():
            assert torch.equal(value, opt_c.state[pc][key]), (name, key)
    schedule = step.train_graph.schedule
    assert 0 < schedule.assignment.count("device") < len(schedule.assignment)
    ops = [n.target.name() for n in step.train_graph.graph.nodes if hasattr(n.target, "name")]
    assert "graphoffload::prefetch_to_device" in ops and "graphoffload::host_adam_" in ops
    # prefetched state occupies device memory from the prefetch on, and the analysis counts it
    profile = step.memory()
    nodes = list(step.train_graph.graph.nodes)
    for fetch in (n for n in nodes if n.target is torch.ops.graphoffload.prefetch_to_device.default):
        fetched = sum(t.numel() * t.element_size() for t in fetch.meta["val"][:-1])
        before = profile.live_at(fetch.prev.name)
        assert profile.live_at(fetch.name) - before >= fetched > 0
    buckets = step.train_graph.notes_of("offload_optimizer", "bucket")
    assert {b.fields["path"] for b in buckets} == {"device", "cpu"}
    assert all(b.fields["moved_bytes"] > 0 and b.fields["end_s"] > b.fields["start_s"] for b in buckets)
    (chosen,) = step.train_graph.notes_of("offload_optimizer", "plan")
    assert chosen.fields["device_buckets"] == sum(b.fields["path"] == "device" for b in buckets)

    trace = json.loads(open(step.timeline(str(tmp_path / "t.json"))).read())
    tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {(1, 0), (1, 1), (1, 2), (1, 3)} <= tracks       # predicted: compute, h2d, d2h, cpu
    assert (2, 3) in tracks and (2, 0) in tracks             # measured: cpu worker and the step


def test_hybrid_schedule_plots_to_a_png(tmp_path):
    # its own test (issue 20 item 7): matplotlib, in the `test` extra, is imported here only
    import matplotlib  # noqa: F401  (missing fails rather than skips)

    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    step = graphoffload.offload_compile(
        train_step, config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=2048)),
        offload=Offload(device_updates=2, calibration=BALANCED))
    step(model, opt, token_batches(1)[0])
    png = step.plot(str(tmp_path / "s.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = Calibration.load_or_measure("cpu")
    path = Calibration.cache_path(torch.device("cpu"))
    assert json.loads(open(path).read())["cpu_update_params_per_s"] == first.cpu_update_params_per_s
    assert first.cpu_update_params_per_s > 0 and first.h2d_bytes_per_s > 0
    assert Calibration.load_or_measure("cpu") == first


def test_drifting_prediction_is_replanned_from_measured_node_times():
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=3e-3, fused=True)
    wrong = dataclasses.replace(BALANCED, device_flops=1e3, device_bytes_per_s=1e3)   # predicts hours
    step = graphoffload.offload_compile(train_step, offload=Offload(device_updates="auto", calibration=wrong,
                                                                     replan_after=2))
    data = token_batches(5)
    for b in data[:3]:
        train_step(eager, opt_e, b)
        step(compiled, opt_c, b)
    first = step.last
    assert first.replans == 0 and len(first.step_seconds) == 2
    for b in data[3:]:
        train_step(eager, opt_e, b)
        step(compiled, opt_c, b)
    replanned = step.last
    assert replanned is not first and replanned.replans == 1
    assert replanned.graph.schedule.step_seconds < first.graph.schedule.step_seconds / 100
    assert any("re-planned from measured node times" in line
               for line in replanned.stages["final"].notes["offload_optimizer"])
    for pe, pc in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(pe, pc)


def test_a_model_on_the_meta_device_compiles_and_plans_without_memory():
    # how a GPU-sized model is planned on any machine: nothing is allocated, nothing runs
    cfg = GPTConfig(vocab_size=1000, seq_len=256, n_layer=4, n_head=8, d_model=512)
    with torch.device("meta"):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = graphoffload.offload_compile(train_step, offload=Offload(calibration=BALANCED, device_updates="auto"))
    batch = torch.empty((2, 256), dtype=torch.long, device="meta")
    graph = step.compile(model, opt, {"input_ids": batch, "labels": batch})
    assert graph.schedule is not None and graph.schedule.step_seconds > 0
    assert step.memory().peak > sum(p.numel() * 4 for p in model.parameters())


def test_plans_on_a_gpu_keep_room_for_library_workspaces():
    """cuBLAS allocates its workspace through the caching allocator, outside any graph node."""
    from graphoffload.passes.manager import PassContext
    from graphoffload.passes.offload_optimizer import CUDA_WORKSPACE_RESERVE, _planning_budget

    config = CompileConfig(offload=Offload(gpu_memory_budget="1GiB"))
    assert _planning_budget(PassContext(config, torch.device("cuda"))) == (1 << 30) - CUDA_WORKSPACE_RESERVE
    assert _planning_budget(PassContext(config, torch.device("cpu"))) == 1 << 30
    assert _planning_budget(PassContext(CompileConfig(offload=Offload()), torch.device("cuda"))) is None


# ---- the planner against brute force (issue 20 item 3) ----
# plan() starts from the best of its named candidates (all-cpu, all-device, fixed strides) and
# improves by single flips; comparing it with those same candidates cannot fail. Here every one of
# the 2^n assignments is predicted for n = 8..10 on synthetic steps with uneven buckets, uneven
# node times and calibrations drawn around BALANCED, some under a memory budget.
# Measured (300 random cases of this family, before this test was written): plan() was optimal in
# most cases, at worst 1.162x the brute-force optimum; the best named candidate alone (no flips)
# reached 1.27x on seed 30 below. The bound is 1.2x: a planner that only picks among its named
# candidates fails it, as does any planner ignoring the calibration (see the mutants below).
PLANNER_FACTOR = 1.2
BRUTE_FORCE_SEEDS = list(range(12)) + [30]


def uneven_step(seed: int) -> tuple[StepCosts, Calibration, int | None]:
    import random

    rng = random.Random(seed)
    n = 8 + seed % 3
    nodes = 4 * n
    node_seconds = [rng.uniform(0.2, 2.0) * 0.1 / nodes for _ in range(nodes)]
    buckets = []
    for i in range(n):
        numel = rng.choice([5, 20, 50, 100]) * 1_000_000
        buckets.append(BucketCost(f"b{i}", numel, ready_node=2 * n + 2 * i + 1, grad_bytes=2 * numel,
                                  upload_bytes=2 * numel, state_bytes=12 * numel))
    cal = dataclasses.replace(
        BALANCED, h2d_bytes_per_s=BALANCED.h2d_bytes_per_s * rng.uniform(0.05, 2),
        d2h_bytes_per_s=BALANCED.d2h_bytes_per_s * rng.uniform(0.05, 2),
        cpu_update_params_per_s=BALANCED.cpu_update_params_per_s * rng.uniform(0.1, 3),
        device_update_params_per_s=BALANCED.device_update_params_per_s * rng.uniform(0.02, 1))
    live = 8 << 30
    # every fourth case: room for the state of about half the parameters on the device
    budget = live + 6 * sum(b.numel for b in buckets) if seed % 4 == 3 else None
    return StepCosts(node_seconds, [live] * nodes, buckets), cal, budget


def brute_force(costs: StepCosts, cal: Calibration, budget: int | None) -> float:
    import itertools

    times = [p.step_seconds for a in itertools.product(("cpu", "device"), repeat=len(costs.buckets))
             if (p := predict(costs, a, cal, budget)) is not None]
    return min(times)


def assert_near_optimal(planner, seeds=BRUTE_FORCE_SEEDS, factor: float = PLANNER_FACTOR) -> list[float]:
    ratios = []
    for seed in seeds:
        costs, cal, budget = uneven_step(seed)
        best = planner(costs, cal, budget)
        assert best is not None, seed   # the planner's pick fits the budget
        optimum = brute_force(costs, cal, budget)
        ratio = best.step_seconds / optimum
        assert ratio >= 1 - 1e-9, (seed, ratio)   # nothing beats the brute-force optimum
        assert ratio <= factor, f"seed {seed}: {ratio:.3f}x the brute-force optimum"
        ratios.append(ratio)
    return ratios


def test_plan_is_within_a_measured_factor_of_brute_force():
    ratios = assert_near_optimal(lambda costs, cal, budget: plan(costs, cal, budget)[0])
    # and exactly optimal in most of these cases
    assert sum(r <= 1 + 1e-9 for r in ratios) >= len(ratios) // 2, ratios


@pytest.mark.parametrize("cal", [BALANCED, SLOW_PCIE, SLOW_CPU], ids=["balanced", "slow-pcie", "slow-cpu"])
def test_plan_is_optimal_on_the_uniform_step(cal):
    costs = synthetic_step(n_buckets=10)
    assert plan(costs, cal)[0].step_seconds <= brute_force(costs, cal, None) * (1 + 1e-9)


def _named_candidates_only(costs, cal, budget):
    return plan(costs, cal, budget, max_sweeps=0)[0]


def _all_cpu(costs, cal, budget):
    return predict(costs, ("cpu",) * len(costs.buckets), cal, budget)


@pytest.mark.parametrize("mutant", [_named_candidates_only, _all_cpu], ids=["named-candidates-only", "all-cpu"])
def test_the_brute_force_check_rejects_a_worse_planner(mutant):
    with pytest.raises(AssertionError, match="the brute-force optimum"):
        assert_near_optimal(mutant)
# ---- plans and predictions recorded before the search was made incremental (planner_cases.py)

import math  # noqa: E402

import planner_cases  # noqa: E402
from graphoffload.passes.offload_planner import StepModel  # noqa: E402

RECORDED = json.load(open(planner_cases.RECORDED))
CASES = [c for c in planner_cases.cases() if planner_cases.key(c) in RECORDED]


def _case(case):
    n, variant, cal, budget = case
    return planner_cases.step_costs(n, variant), planner_cases.CALIBRATIONS[cal], planner_cases.budget_of(n, budget)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] <= 50], ids=planner_cases.key)
def test_plans_are_no_slower_than_recorded(case):
    costs, cal, budget = _case(case)
    recorded = RECORDED[planner_cases.key(case)]
    best, scored = plan(costs, cal, budget)
    assert best.step_seconds <= recorded["step_seconds"] * (1 + 1e-9)
    assert best.peak_bytes <= budget if budget is not None else True
    for name, seconds in scored.items():
        old = recorded["scored"][name]
        assert seconds == (math.inf if old is None else pytest.approx(old, rel=1e-9)), name


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in planner_cases.SCALING and c[0] <= 400],
                         ids=planner_cases.key)
def test_plans_of_the_scaling_steps_are_no_slower_than_recorded(case):
    """The steps benchmarks/compile_time.py times the planner on: a faster search must find
    plans predicted no slower there. The 800-bucket step is left out (its plan takes 6-20 s on
    two shared cores); its recorded plan's prediction is checked below."""
    costs, cal, budget = _case(case)
    recorded = RECORDED[planner_cases.key(case)]
    best, _ = plan(costs, cal, budget)
    assert best.step_seconds <= recorded["step_seconds"] * (1 + 1e-9)   # a different plan is allowed


@pytest.mark.parametrize("case", CASES, ids=planner_cases.key)
def test_predictions_of_given_plans_are_unchanged(case):
    costs, cal, budget = _case(case)
    recorded = RECORDED[planner_cases.key(case)]
    given = {**planner_cases.assignments(len(costs.buckets)),
             "recorded plan": tuple("device" if c == "d" else "cpu" for c in recorded["plan"])}
    expected = {**recorded["predict"], "recorded plan": recorded["step_seconds"]}
    for name, assignment in given.items():
        p = predict(costs, assignment, cal, budget)
        assert (p is None) == (expected[name] is None), name
        if p is not None:
            assert p.step_seconds == pytest.approx(expected[name], rel=1e-9), name
    p = predict(costs, given["recorded plan"], cal, budget)
    assert p.peak_bytes == recorded["peak_bytes"] and max(p.device_bytes) == p.peak_bytes


@pytest.mark.parametrize("case", [c for c in CASES if c[0] <= 50][:6], ids=planner_cases.key)
def test_a_prediction_at_given_prefetch_points_is_the_plans_own(case):
    """StepModel.predict(prefetch=...) (a step re-timed after the activation planner inserted
    replays keeps the graph's prefetch points): at the points the plan placed, the same step,
    events and device bytes; a later prefetch point makes that bucket land no earlier."""
    costs, cal, budget = _case(case)
    best, _ = plan(costs, cal, budget)
    again = StepModel(costs, cal).predict(best.assignment, prefetch=dict(best.prefetch_node))
    assert again.step_seconds == best.step_seconds and again.events == best.events
    assert again.device_bytes == best.device_bytes and again.peak_bytes == best.peak_bytes
    if best.prefetch_node:
        b, at = next(iter(best.prefetch_node.items()))
        later = StepModel(costs, cal).predict(best.assignment, prefetch={**best.prefetch_node, b: at + 5})
        first, then = (max(e.end for e in p.events if e.bucket == b and e.track == "h2d") for p in (best, later))
        assert then >= first


@pytest.mark.parametrize("n", [100, 400])
def test_a_prediction_does_work_linear_in_buckets_and_logarithmic_in_nodes(n):
    costs, cal, budget = _case((n, "plain", "slow-cpu", "loose"))
    model = StepModel(costs, cal)
    assert model.predict(planner_cases.assignments(n)["scattered"], budget) is not None
    assert model.simulated == 2 * n     # each bucket once per pass
    devices = planner_cases.assignments(n)["scattered"].count("device")
    # a placement: one look-up and one addition, an undo; each a root-to-leaf path
    assert model.tree.visits <= 3 * devices * math.ceil(math.log2(len(costs.node_seconds)))


def test_plan_stops_simulating_flips_that_cannot_win(monkeypatch):
    costs, cal, budget = _case((100, "plain", "balanced", "none"))
    models = []
    original = StepModel.__init__

    def tracked(self, *args):
        original(self, *args)
        models.append(self)
    monkeypatch.setattr(StepModel, "__init__", tracked)
    plan(costs, cal, budget)
    (model,) = models   # one step model for the whole search
    assert 9 + 100 <= model.evaluated <= 9 + 3 * 100 + 1
    assert model.simulated < 0.95 * 2 * 100 * model.evaluated   # rejected flips stop early


def _planned(budget=None, calibration=BALANCED, plan_cache=True):
    """A fresh compile (as a restarted job makes) of the tiny GPT under the planner: its notes
    and its plan."""
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(
        train_step, config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=2048)),
        offload=Offload(device_updates="auto", calibration=calibration, gpu_memory_budget=budget,
                        plan_cache=plan_cache))
    graph = step.compile(model, opt, token_batches(1)[0])
    return graph.notes_of("offload_optimizer", "plan_reused"), graph.schedule


def test_a_restarted_job_reuses_the_cached_plan(tmp_path, monkeypatch):
    from graphoffload.passes import offload_optimizer as offload_pass

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    reused, first = _planned()
    assert not reused
    files = list((tmp_path / "graphoffload" / "plans").glob("plan-*.json"))
    assert len(files) == 1

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again although the same plan was cached")

    monkeypatch.setattr(offload_pass, "plan", no_planning)
    reused, second = _planned()
    assert len(reused) == 1 and reused[0].fields["path"] == str(files[0])
    assert second.assignment == first.assignment and 0 < first.assignment.count("device") < len(first.assignment)
    assert second.step_seconds == first.step_seconds and second.prefetch_node == first.prefetch_node
    assert second.peak_bytes == first.peak_bytes and second.events == first.events
    # another calibration or budget is another key: planned (and here, refused by the stub)
    with pytest.raises(graphoffload.errors.PassError, match="planned again"):
        _planned(calibration=dataclasses.replace(BALANCED, h2d_bytes_per_s=BALANCED.h2d_bytes_per_s / 2))
    with pytest.raises(graphoffload.errors.PassError, match="planned again"):
        _planned(budget=10 * 2**30)
    monkeypatch.undo()


def test_an_unreadable_cached_plan_is_planned_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _, first = _planned()
    (path,) = (tmp_path / "graphoffload" / "plans").glob("plan-*.json")
    path.write_text('{"format": 1, "key": "')   # a torn write from another tool
    reused, again = _planned()
    assert not reused and again.assignment == first.assignment
    _, off = _planned(plan_cache=False)   # plan_cache=False neither reads nor writes
    assert len(list(path.parent.glob("plan-*.json"))) == 1 and off.assignment == first.assignment
