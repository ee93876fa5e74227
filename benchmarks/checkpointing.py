"""Activation checkpointing in a compiled step: predicted peak device memory and step time of the
benchmark GPT with every block under `torch.utils.checkpoint(use_reentrant=False)` against the
same GPT without, both with optimizer state offloaded (the planner's hybrid schedule).

    python benchmarks/checkpointing.py --predict benchmarks/calibrations/h100-research-notes.json
    python benchmarks/checkpointing.py --predict ... --batch 12     # 24,576 tokens per step
    python benchmarks/checkpointing.py --predict ... --batch 12 --activation-budgets 60,40,24
    python benchmarks/checkpointing.py --predict ... --batch 12 --activation-budgets 60,40,24 --dtype bfloat16

`--activation-budgets` adds the plain GPT compiled with `Offload(activations="auto")` under each
budget: the planner keeps, recomputes or offloads each saved activation to fit it (a budget it
cannot meet is reported with the least peak it reached). Each such row is compiled twice, by two
step objects, as a job and its restart would (`compile_cpu_s`, then `reused_compile_cpu_s`): the
plan cache (in a fresh directory, so the first compile plans) lets the second re-apply the
stored activation and bucket plans instead of searching; `reused` says whether it did, and the
row records that the second compile predicted the same step and peak.

Everything is compiled on the meta device (no memory, no GPU): the peak is the liveness analysis
of the final graph (`step.memory().peak`), the step time the planner's prediction under the
calibration, in which the recomputed nodes cost their compute like any other node. bf16 autocast
needs a GPU, so by default the meta graph computes (and keeps activations) in fp32: absolute
activation bytes are about twice those of the bf16 GPU step. `--dtype bfloat16` makes the
parameters bf16 instead (the offload keeps fp32 master weights and optimizer state on the host),
so activations and gradients are bf16 as under autocast; the loss still takes its logits in fp32
(`.float()`), as the benchmark GPT does on a GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(__file__))

from common import autocast_train_step, build_gpt, print_table, write_json  # noqa: E402
from gpt import GPT  # noqa: E402

LR, WEIGHT_DECAY = 1e-4, 0.1


class CheckpointedGPT(GPT):
    """The benchmark GPT with every block checkpointed, as a user would write it."""

    def forward(self, idx, labels=None):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def predict_rows(args) -> list[dict]:
    import graphoffload
    from graphoffload.calibration import Calibration

    with open(args.predict) as f:
        cal = Calibration(**json.load(f))
    model, _ = build_gpt(argparse.Namespace(**{**vars(args), "device": "meta"}), torch.device("meta"))
    model = model.to(getattr(torch, args.dtype))
    batch = torch.empty((args.batch, args.seq), dtype=torch.long, device="meta")
    rows = []
    for name, checkpointed in (("no checkpointing", False), ("every block checkpointed", True)):
        model.__class__ = CheckpointedGPT if checkpointed else GPT
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        step = graphoffload.offload_compile(autocast_train_step, offload=graphoffload.Offload(
            device_updates="auto", calibration=cal, replan_after=0))
        start, cpu = time.perf_counter(), time.process_time()
        graph = step.compile(model, opt, batch)
        recomputed = sum("recompute" in n.meta for n in graph.graph.nodes)
        rows.append({"mode": name, "status": "predicted", "predicted_s": graph.schedule.step_seconds,
                     "peak_GiB": step.memory().peak / 2**30, "captured_peak_GiB": step.memory("captured").peak / 2**30,
                     "recomputed_nodes": recomputed, "compile_s": time.perf_counter() - start,
                     "compile_cpu_s": time.process_time() - cpu,
                     "params": sum(p.numel() for p in model.parameters())})
    model.__class__ = GPT
    saved_cache = os.environ.get("XDG_CACHE_HOME")
    try:
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="graphoffload-checkpointing-")   # plans cold
        for gib in args.activation_budgets:   # the plain GPT, its activations planned under a budget
            rows.append(_activation_row(model, batch, cal, gib, rows[0]["params"]))
    finally:
        if saved_cache is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = saved_cache
    return rows


def _activation_row(model, batch, cal, gib: float, params: int) -> dict:
    """The plain GPT with Offload(activations="auto") under `gib`, compiled, then compiled again by
    a fresh step object (a restarted job: the plan cache's entry reused)."""
    import graphoffload

    def make():
        return graphoffload.offload_compile(autocast_train_step, offload=graphoffload.Offload(
            device_updates="auto", calibration=cal, replan_after=0, gpu_memory_budget=int(gib * 2**30),
            activations="auto"))

    def optimizer():
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    step, opt = make(), optimizer()
    start, cpu = time.perf_counter(), time.process_time()
    row = {"mode": f"activations='auto', {gib:g} GiB budget", "params": params}
    try:
        graph = step.compile(model, opt, batch)
    except graphoffload.UnsupportedError as err:
        least = int(str(err).split("(")[1].split(" bytes")[0].replace(",", ""))
        return {**row, "status": "over budget", "peak_GiB": least / 2**30, "error": str(err),
                "compile_s": time.perf_counter() - start, "compile_cpu_s": time.process_time() - cpu}
    compile_s, compile_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    again = make()
    cpu = time.process_time()
    reused = again.compile(model, optimizer(), batch)
    reused_cpu_s = time.process_time() - cpu
    chosen = graph.notes_of("offload_optimizer", "activations")[0].fields
    # which activation plan was kept, and which one the buckets were planned again on
    replanned = graph.notes_of("offload_optimizer", "state_replanned")
    return {**row, "status": "predicted", "predicted_s": graph.schedule.step_seconds,
            "peak_GiB": step.memory().peak / 2**30, "captured_peak_GiB": step.memory("captured").peak / 2**30,
            "recomputed_nodes": sum("recompute" in n.meta for n in graph.graph.nodes),
            "recomputed": chosen["recompute"], "offloaded": chosen["offload"], "plan": chosen["strategy"],
            "buckets_planned_on": replanned[0].fields["made_on"] if replanned else "-",
            "compile_s": compile_s, "compile_cpu_s": compile_cpu_s,
            "reused": bool(reused.notes_of("offload_optimizer", "activations_reused")),
            "reused_compile_cpu_s": reused_cpu_s,
            "reused_same_prediction": (reused.schedule.step_seconds == graph.schedule.step_seconds
                                       and again.memory().peak == step.memory().peak)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--predict", metavar="CALIBRATION_JSON", required=True,
                   help="compile on the meta device and report the predictions under this calibration")
    p.add_argument("--activation-budgets", type=lambda v: [float(x) for x in v.split(",") if x], default=[],
                   metavar="GIB,...", help="also compile the plain GPT with Offload(activations='auto') under "
                   "each of these budgets (GiB); a budget it cannot meet reports the least peak reached")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the parameters' dtype (bfloat16: fp32 master weights on the host, bf16 activations)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = predict_rows(args)
    print(f"GPT {rows[0]['params'] / 1e9:.2f}B params, batch {args.batch}x{args.seq}: predictions under "
          f"{args.predict} (meta device, {args.dtype} parameters and activations)")
    print_table(rows, ["mode", "status", "predicted_s", "peak_GiB", "captured_peak_GiB", "recomputed_nodes",
                       "recomputed", "offloaded", "plan", "buckets_planned_on", "compile_s", "compile_cpu_s",
                       "reused", "reused_compile_cpu_s", "reused_same_prediction"])
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"checkpointing_predicted_b{args.batch}{suffix}.json")
    write_json(out, {"benchmark": "checkpointing-predicted", "calibration": args.predict, "config": vars(args),
                     "rows": rows})


if __name__ == "__main__":
    main()
