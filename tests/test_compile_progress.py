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
