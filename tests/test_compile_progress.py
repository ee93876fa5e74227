"""Compile progress and the cheap fake-mode lookup: a compile logs one line per stage to the
"graphoffload" logger, and `fake_mode_of` (asked once per created node) finds the same mode
torch's full detection does."""

from __future__ import annotations

import logging

import torch
from helpers import run_steps, tiny_gpt, token_batches
from steps import train_step

import graphoffload
from graphoffload.graph import fake_mode_of


def test_compile_logs_a_line_per_stage(caplog):
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = graphoffload.offload_compile(train_step)
    with caplog.at_level(logging.INFO, logger="graphoffload"):
        run_steps(step, model, opt, token_batches(1))
    lines = [r.getMessage() for r in caplog.records if r.name == "graphoffload"]
    assert any(line.startswith("captured ") for line in lines), lines
    passes = [name for name in step.last.stages if name not in ("captured", "final")]
    assert passes
    for name in passes:
        assert any(line.startswith(f"pass {name}: ") and " s, " in line for line in lines), (name, lines)


def test_fake_mode_of_matches_full_detection():
    from torch._guards import detect_fake_mode

    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = graphoffload.offload_compile(train_step)
    run_steps(step, model, opt, token_batches(1))
    for stage in step.last.stages.values():
        graph = stage.graph
        full = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
        assert full is not None
        assert fake_mode_of(graph) is full


def test_the_activation_planner_logs_each_plan_and_its_progress(caplog, monkeypatch):
    """`activations="auto"`: one plan can search for seconds at 24 layers, so each plan logs when
    it starts and ends (what it chose, its peak against the budget), a line now and then while it
    searches (`PROGRESS_S`, 0 here: every round), and the comparison the compile kept one by."""
    from test_activation_plan import FAST_COMPUTE, _batches, _model
    from test_checkpointing import adamw, mlp_step

    from graphoffload.passes import offload_activations

    def compile_mlp(**offload):
        model = _model()
        step = graphoffload.offload_compile(mlp_step, offload=graphoffload.Offload(
            calibration=FAST_COMPUTE, device_updates="never", plan_cache=False, **offload))
        step.compile(model, adamw(model), _batches(1)[0])
        return step

    plain = compile_mlp(activations="keep")
    budget = int(0.7 * plain.train_graph.notes_of("offload_optimizer", "offloaded")[0].fields["device_peak_bytes"])
    monkeypatch.setattr(offload_activations, "PROGRESS_S", 0.0)
    with caplog.at_level(logging.INFO, logger="graphoffload"):
        step = compile_mlp(activations="auto", gpu_memory_budget=budget)
    lines = [r.getMessage() for r in caplog.records if r.name == "graphoffload"]
    (compared,) = step.train_graph.notes_of("offload_optimizer", "activation_plans")
    assert str(compared) in lines   # the comparison, as the note has it
    chosen = step.train_graph.notes_of("offload_optimizer", "activations")[0].fields
    for strategy in compared.fields["plans"]:
        started = [i for i, line in enumerate(lines) if line.startswith(f"activation plan '{strategy}': predicted peak")]
        ended = [i for i, line in enumerate(lines) if line.startswith(f"activation plan '{strategy}': ")
                 and " offloaded, predicted peak " in line]
        assert len(started) == len(ended) == 1 and started[0] < ended[0], (strategy, lines)
        if strategy == compared.fields["chosen"]:
            assert lines[ended[0]].startswith(f"activation plan '{strategy}': {chosen['recompute']} recomputed, "
                                              f"{chosen['offload']} offloaded"), lines[ended[0]]
    progress = [line for line in lines if " offloaded so far, predicted peak " in line]
    assert any(line.startswith("activation plan 'greedy': ") for line in progress), lines
