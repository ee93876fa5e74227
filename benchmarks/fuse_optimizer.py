"""Benchmark fuse_optimizer: eager vs compiled vs compiled+fused, step time and peak memory.

    python benchmarks/fuse_optimizer.py                 # GPU if present, else CPU
    python benchmarks/fuse_optimizer.py --smoke         # tiny CPU run (seconds)
    python benchmarks/fuse_optimizer.py --clip 1.0      # with clip_grad_norm_, plus a row with
                                                        # the waiting gradients parked on the host

On a GPU the peak is measured (`torch.cuda.max_memory_allocated` over one step) beside the
prediction of the memory analysis; on a CPU only the prediction exists (the eager row shows the
prediction of the captured graph, which runs in eager order). All rows run in one process on
the same model and batch, so ratios between rows are comparable; absolute numbers are noisy.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import (autocast_train_step, build_gpt, device_name, median, print_table,  # noqa: E402
                    time_interleaved, write_json)

import graphoffload  # noqa: E402
from graphoffload import CompileConfig, FuseOptimizer  # noqa: E402


def peak_row(step, model, opt, batch, device) -> dict:
    row = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step(model, opt, batch)
        torch.cuda.synchronize(device)
        row["peak_measured_MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
        row["peak_above_start_MiB"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    if isinstance(step, graphoffload.CompiledStep):
        row["peak_predicted_MiB"] = step.memory("final").peak / 2**20
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                   help="clip gradients by global norm in the step (adds the compiled+fused+parked row)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fuse_optimizer.json"))
    args = p.parse_args()
    if args.smoke:
        args.device, args.layers, args.d_model, args.heads, args.vocab, args.seq = "cpu", 4, 128, 4, 256, 32
        args.steps, args.warmup = 3, 1
    device = torch.device(args.device)
    base, cfg = build_gpt(args, device)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    n_params = sum(p.numel() for p in base.parameters())
    grad_mib = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20

    train_step = functools.partial(autocast_train_step, max_norm=args.clip)
    compiled = graphoffload.offload_compile(train_step, config=CompileConfig(disable_passes=("fuse_optimizer",)))
    fused = graphoffload.offload_compile(train_step)
    steps = [("eager", train_step), ("compiled", compiled), ("compiled+fused", fused)]
    if args.clip is not None:
        steps.append(("compiled+fused+parked", graphoffload.offload_compile(train_step, config=CompileConfig(
            fuse_optimizer=FuseOptimizer(park_gradients=True)))))
    variants = {}
    for name, step in steps:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        variants[name] = (step, model, opt)
    times = time_interleaved({name: (lambda s=s, m=m, o=o: s(m, o, batch)) for name, (s, m, o) in variants.items()},
                             device, args.warmup, args.steps)
    rows = [{"mode": name, "step_ms": median(times[name]) * 1e3, **peak_row(s, m, o, batch, device)}
            for name, (s, m, o) in variants.items()]
    if device.type != "cuda":
        rows[0]["peak_predicted_MiB"] = compiled.memory("captured").peak / 2**20
    for r in rows:
        r["vs_compiled_time"] = r["step_ms"] / rows[1]["step_ms"]
    print(f"GPT {n_params / 1e6:.1f}M params ({cfg.n_layer} layers, d={cfg.d_model}), batch {args.batch}x{args.seq}, "
          f"gradients {grad_mib:.1f} MiB, clip {args.clip}, on {device_name(device)}")
    columns = ["mode", "step_ms", "vs_compiled_time", "peak_predicted_MiB", "peak_measured_MiB", "peak_above_start_MiB"]
    print_table(rows, columns)
    for r in rows[2:]:
        drop = rows[1]["peak_predicted_MiB"] - r["peak_predicted_MiB"]
        print(f"predicted peak drop of {r['mode']}: {drop:.1f} MiB = {drop / grad_mib:.2f} x gradient bytes")
    write_json(args.out, {"benchmark": "fuse_optimizer", "device": device_name(device), "params": n_params,
                          "gradient_MiB": grad_mib, "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
