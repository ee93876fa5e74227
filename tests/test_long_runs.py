"""Long runs: re-tracing for new shapes does not add worker threads, a dropped step ends its
workers, and hand-over between calls stays exact when calls alternate between variants
(issue 17 item 2). The 2,000-step soak is benchmarks/soak.py; a short version is marked slow."""

from __future__ import annotations

import copy
import gc
import threading
import time

import pytest
import torch
from helpers import tiny_gpt, token_batches, train_step

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload


def host_workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("graphoffload-host")}


def offloaded_step(**offload):
    return graphoffload.offload_compile(
        train_step, offload=Offload(device_updates="never", **offload),
        config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=4096)))


def test_retracing_for_new_shapes_adds_no_worker_threads_and_a_dropped_step_ends_them():
    before = host_workers()
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = offloaded_step()
    counts = []
    for seq in (16, 12, 8, 6, 4):
        step(model, opt, token_batches(1, seq=seq)[0])
        counts.append(len(host_workers() - before))
    assert step.trace_count == 5
    assert counts == [1] * 5, f"worker threads after each new shape: {counts}"
    ours = host_workers() - before
    del step
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in ours) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in ours), "the dropped step's worker threads are still running"
    # the model and optimizer stay usable eagerly
    train_step(model, opt, token_batches(1)[0])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_hand_over_stays_exact_when_calls_alternate_between_shapes(fused):
    torch.manual_seed(0)
    eager = tiny_gpt()
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=3e-3, weight_decay=0.1)
    step = graphoffload.offload_compile(
        train_step, offload=Offload(device_updates="never", overlap_next_step=True),
        config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=4096),
                             disable_passes=() if fused else ("fuse_optimizer",)))
    before = host_workers()
    long, short = token_batches(4, seq=16, seed=1), token_batches(4, seq=8, seed=2)
    for i in range(8):   # long, short, long, short, ...: each call switches variant
        b = (long if i % 2 == 0 else short)[i // 2]
        assert train_step(eager, opt_e, b).item() == step(compiled, opt_c, b).item(), f"loss of call {i}"
        assert len(host_workers() - before) <= 1
    assert step.trace_count == 2
    step.synchronize()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), name
    variants = list(step._variants.values())
    assert variants[0].executor.offload_runtime is variants[1].executor.offload_runtime


def test_a_step_dropped_with_uploads_in_flight_still_lands_them():
    before = host_workers()
    torch.manual_seed(0)
    eager = tiny_gpt()
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=3e-3)
    step = offloaded_step(overlap_next_step=True)
    for b in token_batches(2):
        train_step(eager, opt_e, b)
        step(compiled, opt_c, b)
    # this step's workers only: a worker of a step another test still holds never ends, and
    # waiting out its join timeout cost 10 s each in a whole-suite run
    ours = host_workers() - before
    assert ours
    del step
    gc.collect()
    for t in ours:
        t.join(timeout=10)
        assert not t.is_alive(), "the dropped step's worker thread is still running"
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), name


@pytest.mark.slow
def test_soak_script_stays_flat(tmp_path):
    """A short run of benchmarks/soak.py (the 2,000-step soak is the script itself)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "soak.py"), "--steps", "40",
                           "--warmup", "10", "--interval", "10", "--modes", "hand-over+shapes", "--out", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["flat"] and row["traces"] == 4 and row["workers"] == "1->1"
