"""The sequence-parallel example runs under torchrun on CPU, and the ring attention benchmark's
CPU part runs (tiny settings; its numbers are not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_long_context_example_under_torchrun():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(ROOT, "examples", "train_long_context.py"), "--seq-len", "64", "--steps", "2",
         "--layers", "1", "--d-model", "32", "--heads", "2", "--sharded-batch"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: loss" in proc.stdout and "32 of 64 tokens per rank, 2 ranks" in proc.stdout


def test_ring_attention_benchmark_cpu_smoke(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ring_attention.py"), "--cpu", "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["world"] for r in rows} == {1, 2}
    assert all(r["exchanges"] == r["expected_exchanges"] for r in rows)
