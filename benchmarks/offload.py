"""Benchmark optimizer offload: step time and peak device memory of a GPT with its optimizer
state on the host, against all-on-GPU eager training and the offload anchors.

    python benchmarks/offload.py                    # GPU: GPT 1.34B (24 layers, d=2048), batch 4 x 2048
    python benchmarks/offload.py --batch 12
    python benchmarks/offload.py --smoke            # tiny model on the CPU (the offload schedule runs
                                                    # with real copies and the CPU worker)

Rows: `gpu` (eager, everything on the device, fused AdamW), `graphoffload-cpu` (this
project's `offload_optimizer`, every update on the CPU), `graphoffload-hybrid` (the performance
model picks CPU or device per bucket; `predicted_s` is its prediction; `-overlap`: with
`Offload(overlap_next_step=True)`, the last uploads finish in the next forward), `fixed-k2` (one bucket in
two on the device, Deep Optimizer States' schedule), `torchao`
(`torchao.optim.CPUOffloadOptimizer`) and `deepspeed` (ZeRO-2 with `offload_optimizer: cpu`)
where they import. Every row runs in its own process, so its
peak (`torch.cuda.max_memory_allocated` over the timed steps; `first_calls_peak_GiB` over the
warm-up calls, which include tracing and setup) is its own; rows of one invocation run back to back on
the same machine. All use bf16 autocast and AdamW(lr=1e-4, weight_decay=0.1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import (autocast_train_step, build_gpt, device_name, median, print_table,  # noqa: E402
                    time_steps, write_json)

LR, WEIGHT_DECAY = 1e-4, 0.1


def _gpu_eager(model, device):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return lambda batch: autocast_train_step(model, opt, batch)


def _graphoffload(device_updates, overlap_next_step=False):
    def build(model, device):
        import graphoffload

        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        step = graphoffload.offload_compile(autocast_train_step, offload=graphoffload.Offload(
            device_updates=device_updates, overlap_next_step=overlap_next_step))

        def run(batch):
            loss = step(model, opt, batch)
            schedule = step.train_graph.schedule
            run.predicted_s = schedule.step_seconds if schedule is not None else None
            return loss
        return run
    return build


def _torchao(model, device):
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:   # torchao releases before it left the prototypes
        from torchao.prototype.low_bit_optim import CPUOffloadOptimizer

    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, lr=LR, weight_decay=WEIGHT_DECAY)
    return lambda batch: autocast_train_step(model, opt, batch)


def _deepspeed(model, device):
    import deepspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(batch):
        loss = engine(batch, labels=batch)
        engine.backward(loss)
        engine.step()
        return loss
    return step


MODES = {"gpu": _gpu_eager, "graphoffload-cpu": _graphoffload("never"), "graphoffload-hybrid": _graphoffload("auto"),
         "graphoffload-hybrid-overlap": _graphoffload("auto", overlap_next_step=True),
         "fixed-k2": _graphoffload(2), "torchao": _torchao, "deepspeed": _deepspeed}


def run_one(args) -> dict:
    """Run one mode in this process and return its row."""
    device = torch.device(args.device)
    model, cfg = build_gpt(args, device)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    row = {"mode": args.mode, "params": sum(p.numel() for p in model.parameters())}
    try:
        step = MODES[args.mode](model, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.warmup):
            step(batch)
        if device.type == "cuda":
            # the first calls' peak (tracing; torchao and DeepSpeed set up) is not the
            # training peak, but a first call that needs more memory is a cost: report both
            torch.cuda.synchronize(device)
            row["first_calls_peak_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        times = time_steps(lambda: step(batch), device, 0, args.steps)
    except ImportError as exc:
        return {**row, "status": f"not installed ({exc.name})"}
    except torch.cuda.OutOfMemoryError:
        return {**row, "status": "out of memory"}
    row.update(status="ok", step_s=median(times), tokens_per_s=args.batch * args.seq / median(times),
               predicted_s=getattr(step, "predicted_s", None))
    if device.type == "cuda":
        row["peak_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def predict_rows(args) -> list[dict]:
    """Compile the GPT on the meta device (no memory, no GPU) and report the planner's
    predicted step for each offload schedule under a calibration file."""
    import graphoffload
    from graphoffload.calibration import Calibration

    with open(args.predict) as f:
        cal = Calibration(**json.load(f))
    cfg_args = argparse.Namespace(**{**vars(args), "device": "meta"})
    model, cfg = build_gpt(cfg_args, torch.device("meta"))
    batch = torch.empty((args.batch, args.seq), dtype=torch.long, device="meta")
    rows = []
    for name, updates, overlap in (("graphoffload-cpu", "never", False), ("fixed-k2", 2, False),
                                   ("graphoffload-hybrid", "auto", False), ("graphoffload-hybrid-overlap", "auto", True)):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        step = graphoffload.offload_compile(autocast_train_step, offload=graphoffload.Offload(
            device_updates=updates, calibration=cal, replan_after=0, overlap_next_step=overlap))
        graph = step.compile(model, opt, batch)
        # "never" has no schedule of its own: score the all-CPU assignment with the same model
        schedule = graph.schedule or graphoffload.offload_compile(
            autocast_train_step, offload=graphoffload.Offload(device_updates=10**9, calibration=cal)
        ).compile(model, torch.optim.AdamW(model.parameters(), lr=LR), batch).schedule
        rows.append({"mode": name, "status": "predicted", "predicted_s": schedule.step_seconds,
                     "device_buckets": f"{schedule.assignment.count('device')}/{len(schedule.assignment)}",
                     "peak_GiB": step.memory().peak / 2**30,
                     "params": sum(p.numel() for p in model.parameters())})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--mode", help=argparse.SUPPRESS)     # internal: run one mode, print its row
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--predict", metavar="CALIBRATION_JSON",
                   help="no run: compile on the meta device and print the planner's predictions under "
                        "this calibration (e.g. one measured on the target GPU machine)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "offload.json"))
    args = p.parse_args()
    if args.smoke:
        args.device, args.layers, args.d_model, args.heads, args.vocab, args.seq, args.batch = "cpu", 2, 64, 2, 256, 64, 2
        args.steps, args.warmup, args.modes = 3, 1, "gpu,graphoffload-cpu"
    if args.mode:
        print("ROW " + json.dumps(run_one(args)))
        return
    if args.predict:
        rows = predict_rows(args)
        print(f"GPT {rows[0]['params'] / 1e9:.2f}B params, batch {args.batch}x{args.seq}: predictions under "
              f"{args.predict} (meta device; bf16 autocast needs a GPU, so compute is modelled in fp32)")
        print_table(rows, ["mode", "status", "predicted_s", "device_buckets", "peak_GiB"])
        write_json(args.out, {"benchmark": "offload-predicted", "calibration": args.predict, "config": vars(args),
                              "rows": rows})
        return
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        if args.smoke:
            cmd = [sys.executable, __file__, "--smoke", "--mode", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        rows.append(json.loads(lines[-1][4:]) if lines else
                    {"mode": mode, "status": f"failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:120]}"})
        # after every row: a run cut short (gpu_suite.sh's per-part timeout) keeps the rows it finished
        write_json(args.out, {"benchmark": "offload", "device": device_name(torch.device(args.device)),
                              "config": vars(args), "rows": rows, "complete": False})
    base = next((r for r in rows if r["mode"] == "gpu" and r.get("step_s")), None)
    for r in rows:
        if base and r.get("step_s"):
            r["vs_gpu"] = r["step_s"] / base["step_s"]
    device = torch.device(args.device)
    print(f"GPT {rows[0].get('params', 0) / 1e9:.2f}B params ({args.layers} layers, d={args.d_model}), "
          f"batch {args.batch}x{args.seq}, on {device_name(device)}")
    print_table(rows, ["mode", "status", "step_s", "predicted_s", "vs_gpu", "tokens_per_s", "peak_GiB",
                       "first_calls_peak_GiB"])
    write_json(args.out, {"benchmark": "offload", "device": device_name(device), "config": vars(args), "rows": rows,
                          "complete": True})


if __name__ == "__main__":
    main()
