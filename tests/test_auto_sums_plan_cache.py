"""`Offload(accumulate_on="auto")`'s sum placement kept on disk: a restarted job (a fresh step
object, the same model and config) reads each variant's predicted peaks from the plan cache
instead of compiling the placement's trials, and decides, compiles and trains exactly as the
first job did. The peaks do not depend on the budget, so another budget reuses them and decides
as a cold compile at that budget would; another calibration is another key; an unreadable
entry is tried again; plan_cache=False neither reads nor writes. Under ZeRO (one choice for the
whole step) each rank's trial outcomes are kept alike, each rank its own entries (a group of one
process, and of two), and the choice made from them is the cold one's."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from test_accumulation_offload import K, OPTIMIZERS, batches, mlp, step_fn
from ring_dist import run_ranks
from test_activation_plan import FAST_COMPUTE
from test_zero_offload_accumulation import _auto_step as _zero_auto_step, _gpt, _optimizer, _windows

import graphoffload
from graphoffload.api import CompiledStep
from graphoffload.passes import offload_optimizer as offload_pass
from graphoffload.passes import offload_plan_cache

OTHER_CALIBRATION = dataclasses.replace(FAST_COMPUTE, h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def _entries(cache) -> list:
    return sorted((cache / "graphoffload" / "plans").glob("sums-*.json"))


def _no_trials(monkeypatch):
    """Make any trial compile of the placement fail loudly: a reused placement must not run one."""
    def refuse(*args, **kwargs):
        raise AssertionError("compiled a trial of the sum placement although its peaks were cached")
    monkeypatch.setattr(offload_pass, "_trial", refuse)


def _run(budget, calibration=FAST_COMPUTE, **offload):
    """A fresh step (a job) over a fresh copy of the MLP: one window of K calls (both variants
    compiled and run). Returns per variant (updating?) its placement note, its peaks note and its
    graph node by node, and the trained parameters."""
    model = mlp()
    opt = OPTIMIZERS["adamw"](model)
    step = graphoffload.offload_compile(step_fn, accumulation_steps=K, offload=graphoffload.Offload(
        accumulate_on="auto", gpu_memory_budget=budget, calibration=calibration, **offload),
        config=graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=3000)))
    for x, y in batches(K):
        step(model, opt, x, y)
    out = {}
    for key, variant in step._variants.items():
        graph = variant.graph
        [placement] = graph.notes_of("offload_optimizer", "grad_sum_placement")
        [peaks] = graph.notes_of("offload_optimizer", "grad_sum_peaks")
        nodes = [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), n.meta.get("phase"), n.meta.get("stream"))
                 for n in graph.graph.nodes]
        out[key[0]] = ((str(placement), dict(placement.fields)), peaks.fields, nodes, repr(graph.signature))
    return out, [p.detach().clone() for p in model.parameters()]


def _same_decisions(a, b) -> None:
    for update in (False, True):
        assert a[update][0] == b[update][0]   # the grad_sum_placement note: text and fields
        assert a[update][2] == b[update][2]   # the final graph, node by node
        assert a[update][3] == b[update][3]   # and its inputs (which sums are host tensors)


def _mixed_budget(peaks: dict) -> tuple[int, int]:
    """A budget some but not all buckets' moves meet, and the count of buckets it moves."""
    need = [max(a, u) for a, u in zip(peaks["accumulate"], peaks["update"])]
    m = next(m for m in range(1, len(need)) if need[m] < need[0])
    return need[m], m


def test_a_restarted_job_reuses_the_placement_and_another_budget_decides_as_a_cold_compile(cache, monkeypatch):
    first, params = _run(10**12)   # every sum fits on the device; both variants' trials run and are stored
    for update in (False, True):
        assert first[update][1]["trial_compiles"] > 0 and first[update][1]["reused"] == {}
        assert first[update][0][1]["moved"] == 0
    assert len(_entries(cache)) == 2   # one per variant
    with monkeypatch.context() as m:
        _no_trials(m)
        restarted, restarted_params = _run(10**12)
        budget, moved = _mixed_budget(first[True][0][1]["peaks"])
        other_budget, _ = _run(budget)   # the same peaks: only the choice among them is made again
    for update in (False, True):
        assert restarted[update][1]["trial_compiles"] == 0
        assert set(restarted[update][1]["reused"]) == {"accumulate", "update"}
        assert other_budget[update][1]["trial_compiles"] == 0
        assert other_budget[update][0][1]["moved"] == moved > 0
    _same_decisions(first, restarted)
    for a, b in zip(params, restarted_params):   # and trains bit for bit alike
        assert torch.equal(a, b)
    cold, _ = _run(budget, plan_cache=False)
    assert cold[True][1]["trial_compiles"] > 0
    _same_decisions(cold, other_budget)
    assert len(_entries(cache)) == 2   # plan_cache=False wrote nothing


def test_another_calibration_misses_and_an_unreadable_entry_is_tried_again(cache):
    first, _ = _run(10**12)
    other, _ = _run(10**12, calibration=OTHER_CALIBRATION)
    assert other[True][1]["trial_compiles"] > 0 and other[True][1]["reused"] == {}
    assert len(_entries(cache)) == 4
    for path in _entries(cache):
        path.write_text('{"format": 1, "key": "tru')   # a writer that died half way
    again, _ = _run(10**12)
    assert again[True][1]["trial_compiles"] == first[True][1]["trial_compiles"]
    _same_decisions(first, again)
    restarted, _ = _run(10**12)   # the entries written again serve the next restart
    assert restarted[True][1]["trial_compiles"] == 0
    _same_decisions(first, restarted)


def test_plan_cache_false_neither_reads_nor_writes_the_placement(cache):
    _run(10**12)
    entries = _entries(cache)
    assert entries
    off, _ = _run(10**12, plan_cache=False)
    assert off[True][1]["trial_compiles"] > 0 and off[True][1]["reused"] == {}
    assert _entries(cache) == entries
    # the entries count toward the directory's cap and are evicted like plans, the one kept aside
    removed = offload_plan_cache.evict(str(entries[0].parent), keep=str(entries[0]), max_bytes=0)
    assert set(removed) >= {str(e) for e in entries[1:]} and _entries(cache) == entries[:1]


def _zero_run(budget, **offload):
    """A fresh ZeRO stage-2 step (`accumulate_on="auto"`, a group of this process alone) compiled
    for its accumulating call: its `sum_choice` note and graph node by node."""
    model = _gpt()
    step = _zero_auto_step(budget)
    if offload:
        step.config = dataclasses.replace(step.config, offload=dataclasses.replace(step.config.offload, **offload))
    graph = step.compile(model, _optimizer("adamw", model), _windows(1)[0][0])
    [choice] = graph.notes_of("zero", "sum_choice")
    # (a collective names its step's own group, made anew by every step: the graphs agree up to that)
    return (str(choice), dict(choice.fields)), [(n.name, n.op, str(n.target), re.sub("'[0-9a-f]{40}'", "G", str(n.args)))
                                                for n in graph.graph.nodes]


def test_under_zero_each_ranks_trials_are_reused_and_the_choice_is_the_cold_ones(cache, monkeypatch, one_process_group):
    trials = []
    real = CompiledStep._trial_compile

    def counted(self, graph, device, where):
        trials.append(where)
        return real(self, graph, device, where)
    monkeypatch.setattr(CompiledStep, "_trial_compile", counted)
    above, _ = _zero_run(1 << 40)   # device sums fit: the accumulating variant's two trials, stored
    assert trials == ["device", "host"] and above[1]["where"] == "device"
    peaks = (above[1]["device_peak"], above[1]["host_peak"])
    budget = sum(peaks) // 2   # between the two: host sums, so the updating call's trial of them runs too
    trials.clear()
    first, first_graph = _zero_run(budget)
    assert trials == ["host"] and first[1]["where"] == "host"   # the budget is not in the trials' key
    trials.clear()
    restarted, restarted_graph = _zero_run(budget)
    assert trials == []
    assert restarted == first and restarted_graph == first_graph
    cold, cold_graph = _zero_run(budget, plan_cache=False)
    assert trials == ["device", "host", "host"]
    assert cold == first and cold_graph == first_graph


def _zero_ranks(rank: int, world: int) -> None:
    """The test above on each rank of a real group: each rank keeps its own trial outcomes (the
    key names the rank), a restarted job on every rank runs no trial, and the choice, made from
    the outcomes reduced over the ranks, is the cold one's and the same on every rank."""
    import torch.distributed as dist

    trials = []
    real = CompiledStep._trial_compile

    def counted(self, graph, device, where):
        trials.append(where)
        return real(self, graph, device, where)
    CompiledStep._trial_compile = counted   # this rank's process only
    above, _ = _zero_run(1 << 40)
    assert trials == ["device", "host"] and above[1]["where"] == "device", (rank, trials, above)
    budget = (above[1]["device_peak"] + above[1]["host_peak"]) // 2
    trials.clear()
    first, first_graph = _zero_run(budget)
    assert trials == ["host"] and first[1]["where"] == "host", (rank, trials, first)
    trials.clear()
    restarted, restarted_graph = _zero_run(budget)
    assert trials == [], (rank, trials)
    assert restarted == first and restarted_graph == first_graph, rank
    cold, cold_graph = _zero_run(budget, plan_cache=False)
    assert trials == ["device", "host", "host"], (rank, trials)
    assert cold == first and cold_graph == first_graph, rank
    everyone = [None] * world
    dist.all_gather_object(everyone, (first[1]["where"], first[1]["device_peak"], first[1]["host_peak"]))
    assert all(e == everyone[0] for e in everyone), everyone


@pytest.mark.slow   # two processes
def test_under_zero_on_two_ranks_each_ranks_trials_are_reused(cache):
    run_ranks(_zero_ranks, 2, deadline_s=180)
    kept = sorted((cache / "graphoffload" / "plans").glob("stepsums-*.json"))
    # each rank's own two (its accumulating variant's trials, its updating call's), none shared
    assert len(kept) == 4, kept
