"""The benchmark scripts still run (tiny settings); their numbers are not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str, out) -> dict:
    # one intra-op thread (the numbers are not asserted): on a busy machine spinning OpenMP
    # workers made the tiny models' steps many times slower
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("script,extra", [("fuse_optimizer.py", ()), ("fuse_optimizer.py", ("--clip", "1.0")),
                                          ("offload.py", ()), ("grad_accumulation.py", ())],
                         ids=["fuse", "fuse-clip", "offload", "grad-accumulation"])
def test_benchmark_smoke_run_writes_rows(script, extra, tmp_path):
    result = _run(script, "--smoke", *extra, out=tmp_path / "r.json")
    assert len(result["rows"]) >= 2
    assert all(r.get("status", "ok") == "ok" for r in result["rows"])
    if extra:
        rows = {r["mode"]: r for r in result["rows"]}
        assert rows["compiled+fused+parked"]["peak_predicted_MiB"] < rows["compiled+fused"]["peak_predicted_MiB"]


def test_offload_predictions_on_the_meta_device(tmp_path):
    result = _run("offload.py", "--predict", os.path.join(ROOT, "benchmarks", "calibrations", "h100-research-notes.json"),
                  "--layers", "2", "--d-model", "128", "--heads", "4", "--vocab", "256", "--seq", "64", "--batch", "1",
                  out=tmp_path / "p.json")
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows["graphoffload-hybrid"]["predicted_s"] <= rows["fixed-k2"]["predicted_s"]
    assert rows["graphoffload-hybrid"]["predicted_s"] <= rows["graphoffload-cpu"]["predicted_s"]


def test_checkpointing_predictions_on_the_meta_device(tmp_path):
    result = _run("checkpointing.py", "--predict", os.path.join(ROOT, "benchmarks", "calibrations", "h100-research-notes.json"),
                  "--layers", "2", "--d-model", "128", "--heads", "4", "--vocab", "256", "--seq", "256", "--batch", "4",
                  out=tmp_path / "c.json")
    plain, checkpointed = result["rows"]
    assert plain["recomputed_nodes"] == 0 < checkpointed["recomputed_nodes"]
    assert checkpointed["peak_GiB"] < plain["peak_GiB"]
    assert checkpointed["predicted_s"] > plain["predicted_s"]   # the recompute costs compute


def test_checkpointing_benchmark_plans_activations_under_budgets(tmp_path):
    result = _run("checkpointing.py", "--predict", os.path.join(ROOT, "benchmarks", "calibrations", "h100-research-notes.json"),
                  "--layers", "2", "--d-model", "128", "--heads", "4", "--vocab", "256", "--seq", "256", "--batch", "4",
                  "--activation-budgets", "0.02,0.001", out=tmp_path / "c.json")
    plain, _, fits, cannot = result["rows"]
    assert fits["status"] == "predicted" and fits["peak_GiB"] <= 0.02 < plain["peak_GiB"]
    assert fits["recomputed"] + fits["offloaded"] > 0
    # compiled again by a fresh step object, as a restarted job: the stored plan re-applied, same prediction
    assert fits["reused"] and fits["reused_same_prediction"] and fits["reused_compile_cpu_s"] > 0
    assert cannot["status"] == "over budget" and cannot["peak_GiB"] > 0.001 and "needs at least" in cannot["error"]


def test_compile_time_smoke_run_reports_every_stage(tmp_path):
    result = _run("compile_time.py", "--smoke", "--activations-fraction", "0.6", out=tmp_path / "t.json")
    assert [r["layers"] for r in result["rows"]] == [2, 4]
    for row in result["rows"]:
        assert row["make_fx_s"] > 0 and row["capture_s"] > 0 and row["planning_s"] is not None
        assert {"fuse_optimizer", "offload_optimizer"} <= set(row["passes_s"])
        assert row["buckets"] > 0 and row["nodes"] > row["make_fx_nodes"]
        # every verification's CPU time, as the PassManager logs it, is part of the compile's
        assert 0 < row["verify_cpu_s"] and 0 < row["verify_share_cpu"] < 1
        # activations="auto" under 0.6 of the plain compile's peak: planned to fit, and timed
        assert row["activations_peak"] <= row["activations_budget"] and row["activations_cpu_s"] > 0
        assert row["activations_recomputed"] + row["activations_offloaded"] > 0
        # the same step from moved lines of another file finds that plan on disk
        assert row["activations_moved_reused"] and row["activations_moved_cpu_s"] > 0
    # the planner alone on synthetic steps: each size's work, and its growth against the one before
    assert [r["buckets"] for r in result["planner"]] == [20, 40]
    assert all(r["planner_s"] > 0 and r["simulated"] >= 2 * r["buckets"] for r in result["planner"])
    assert result["planner"][1]["buckets_growth"] == 2 and result["planner"][1]["growth"] > 0


@pytest.mark.slow   # spawns 2 ranks twice
def test_zero_benchmark_smoke_run_measures_each_rank(tmp_path):
    result = _run("zero.py", "--smoke", "--worlds", "2", "--modes", "zero2", "zero3", "ddp", out=tmp_path / "z.json")
    rows = {r["mode"]: r for r in result["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    # measured: ZeRO keeps half the optimizer state on each of 2 ranks (up to the largest parameter), DDP all of it
    assert rows["ddp"]["state_share"] == 1.0
    assert 0.3 < rows["zero2"]["state_share"] < 0.7 and sum(rows["zero2"]["state_MiB_each"]) == \
        pytest.approx(rows["ddp"]["state_MiB"])
    assert all(r["step_ms"] > 0 and r["peak_MiB"] > 0 for r in rows.values())
    # stage 3 holds about half the parameters on each of 2 ranks between steps, stage 2 and DDP all
    assert rows["zero2"]["params_MiB"] == rows["ddp"]["params_MiB"]
    assert 0.4 < rows["zero3"]["params_MiB"] / rows["ddp"]["params_MiB"] < 0.6
    assert rows["zero3"]["predicted_peak_MiB"] > 0 and rows["ddp"]["predicted_peak_MiB"] is None
