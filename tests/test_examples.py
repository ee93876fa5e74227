"""The example scripts run end to end (tiny settings, as subprocesses, like a user would)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ARGS = ["--layers", "1", "--heads", "2", "--d-model", "32", "--seq-len", "16", "--batch-size", "4",
             "--log-every", "10"]


def run_example(script: str, *args: str) -> str:
    # one intra-op thread: the tiny models gain nothing from more, and on a busy machine (the
    # suite's own ranks beside it) spinning OpenMP workers made each step ~30x slower
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def final_losses(stdout: str) -> tuple[float, float]:
    match = re.search(r"loss ([\d.]+) -> ([\d.]+) in \d+ steps", stdout)
    assert match, stdout[-2000:]
    return float(match.group(1)), float(match.group(2))


def test_train_gpt_smoke_run_on_the_stdlib_corpus():
    out = run_example("train_gpt.py", "--steps", "3", "--corpus-mb", "1", *TINY_ARGS)
    assert "Python stdlib source" in out
    assert "(1 trace)" in out


def test_train_gpt_learns_a_text_file_given_with_data(tmp_path):
    text = tmp_path / "abc.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = run_example("train_gpt.py", "--data", str(text), "--steps", "40", "--lr", "1e-2", "--warmup", "5",
                      *TINY_ARGS)
    first, last = final_losses(out)
    assert last < 0.7 * first     # a repetitive text: the loss must fall well below its start


def test_custom_pass_example_runs_and_reports_its_nodes():
    out = run_example("custom_pass.py")
    assert len(re.findall(r"step \d: loss", out)) == 5
    assert "by cast_grads_to_bf16" in out
    assert re.search(r"rounded \d+ gradients to bfloat16", out)
