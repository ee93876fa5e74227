"""Benchmark gradient accumulation: what unrolling k micro-batches costs at compile time, and
the time and predicted peak of a window of k micro-batches, eager vs both compiled forms.

    python benchmarks/grad_accumulation.py             # GPU if present, else CPU
    python benchmarks/grad_accumulation.py --smoke     # tiny CPU run (seconds)
    python benchmarks/grad_accumulation.py --forms plan-reuse --out benchmarks/results/grad_accumulation_plan_reuse_meta.json

Form A is a step that loops over its k micro-batches (one graph with k forwards and
backwards); form B is the ordinary step compiled with `accumulation_steps=k`, called k times.
The compile rows trace form A for several k: nodes, trace time and pass time grow about
linearly with k (the graph is unrolled). The window rows time k micro-batches and one update,
interleaved so that machine drift hits all alike; their peaks are the memory analysis'
predictions (form B: its updating call; the running sums it keeps between calls count).

The host-sum rows run form B with `Offload(accumulate_on="host")` (the running sums in host
memory, added on the CPU worker; without clipping, which host sums refuse), twice: "waiting"
calls `step.synchronize()` after every call, so each call's CPU adds end before the next call
starts (what every call did before the adds were handed over), "overlapping" lets them run on
beside the next call's forward, as the step does by itself. `--forms host` runs only those.

`--forms auto-cost` measures instead what `Offload(accumulate_on="auto")` adds to compiling
form B, on the meta device (nothing runs; compile_time.py's GPT sizes, `--auto-layers`): both
variants compiled with every sum on the device vs with "auto" under a budget (which probes the
other variant, and per variant predicts the peak for every candidate count of buckets moved from
two trial rewrites: passes/host_accumulation.py, `modelled_peaks`). Wall and CPU seconds (this
process's), the CPU ones less disturbed by other load on a shared machine.

`--forms plan-reuse` measures what the on-disk plan cache saves a restarted job whose step
accumulates: form B with `Offload(activations="auto")`, sums on the device under `--reuse-budget`
GiB and with `accumulate_on="auto"` under `--reuse-auto-budget` GiB (`--reuse-modes` picks which),
on the meta device (the benchmark GPT, `--reuse-layers`
layers, d=2048, bf16 parameters, micro-batches of `--reuse-batch`x2048). Each configuration's
two variants (accumulating, then updating) are compiled by a fresh process on an empty cache
(it plans and stores both plans), then by another fresh process on that cache (a restarted job:
it re-applies them); `--reuse-runs` such pairs, one after the other. CPU seconds of each
process's two compiles (capture and every pass included), whether each variant's plan was
reused, whether the restart predicted the same step and peak, and with "auto" how many trial
compiles the sum placement ran in each process (none where its peaks came from the cache).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import (autocast_train_step, build_gpt, device_name, median, print_table,  # noqa: E402
                    synchronize, time_interleaved, write_json)

import graphoffload  # noqa: E402


def window_step(model, optimizer, micro_batches, max_norm: float | None = None):
    """Form A: k forward/backward with loss/k, then (clip and) one update."""
    on_gpu = micro_batches[0].device.type == "cuda"
    for mb in micro_batches:
        with torch.autocast("cuda" if on_gpu else "cpu", dtype=torch.bfloat16, enabled=on_gpu):
            loss = model(mb, labels=mb)
        (loss / len(micro_batches)).backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()


def make_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)


def compile_row(base, micro_batches: list[torch.Tensor], k: int, device: torch.device, max_norm) -> dict:
    model = copy.deepcopy(base)
    opt = make_opt(model)
    step = graphoffload.offload_compile(functools.partial(window_step, max_norm=max_norm))
    synchronize(device)
    start = time.perf_counter()
    step.compile(model, opt, micro_batches[:k])
    total = time.perf_counter() - start
    passes = sum(step.last.timings.values())
    return {"mode": f"form A compile, k={k}", "k": k, "nodes_captured": len(step.graphs["captured"].graph.nodes),
            "nodes_final": len(step.graphs["final"].graph.nodes), "compile_s": total,
            "passes_s": passes, "trace_s": total - passes}


def auto_cost_rows(args) -> list[dict]:
    """Seconds to compile both variants of form B (the accumulating one first, as a training
    loop meets them), sums on the device vs accumulate_on="auto", on the meta device."""
    from graphoffload.calibration import Calibration

    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations",
                           "h100-research-notes.json")) as f:
        cal = Calibration(**json.load(f))
    sizes = argparse.Namespace(**{**vars(args), "d_model": 2048, "heads": 16, "vocab": 32000, "seq": 2048})
    rows = []
    for layers in (int(x) for x in args.auto_layers.split(",")):
        sizes.layers = layers
        model, _ = build_gpt(sizes, torch.device("meta"))
        batch = torch.empty((4, sizes.seq), dtype=torch.long, device="meta")
        row = {"mode": f"compile both variants, {layers} layers", "params": sum(p.numel() for p in model.parameters())}
        for where, budget in (("device", None), ("auto", "1TiB")):   # a budget: "auto" runs its trials
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
            step = graphoffload.offload_compile(autocast_train_step, accumulation_steps=args.k, offload=graphoffload.Offload(
                accumulate_on=where, gpu_memory_budget=budget, calibration=cal, replan_after=0, plan_cache=False))
            start, cpu = time.perf_counter(), time.process_time()
            step.compile(model, opt, batch)                   # the accumulating variant (with "auto": probe, peaks)
            row[f"{where}_accumulate_s"] = time.perf_counter() - start
            start = time.perf_counter()                       # the updating variant (the other is compiled)
            graph = step.compile_variants(model, opt, batch)["update"]
            row[f"{where}_update_s"] = time.perf_counter() - start
            row[f"{where}_s"] = row[f"{where}_accumulate_s"] + row[f"{where}_update_s"]
            row[f"{where}_cpu_s"] = time.process_time() - cpu   # this process' CPU time: less hit by others' load
            if where == "auto":
                [placement] = graph.notes_of("offload_optimizer", "grad_sum_placement")
                row["candidates"] = placement.fields["movable"] + 1
                row["method"] = "/".join(sorted(set(placement.fields["method"].values())))
        row["auto_extra_s"] = row["auto_s"] - row["device_s"]
        row["auto_vs_device"] = row["auto_s"] / row["device_s"]
        row["auto_vs_device_cpu"] = row["auto_cpu_s"] / row["device_cpu_s"]
        rows.append(row)
        print(f"{layers} layers: device {row['device_s']:.1f} s, auto {row['auto_s']:.1f} s", flush=True)
    return rows


def reuse_child(args) -> dict:
    """One process's compiles of both variants of the accumulating step (plan-reuse), on the
    plan cache under $XDG_CACHE_HOME: CPU seconds, reuse and predictions per variant."""
    from graphoffload.calibration import Calibration

    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations",
                           "h100-research-notes.json")) as f:
        cal = Calibration(**json.load(f))
    sizes = argparse.Namespace(**{**vars(args), "layers": args.reuse_layers, "d_model": 2048, "heads": 16,
                                  "vocab": 32000, "seq": 2048})
    model, _ = build_gpt(sizes, torch.device("meta"))
    model = model.to(torch.bfloat16)
    batch = torch.empty((args.reuse_batch, sizes.seq), dtype=torch.long, device="meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    step = graphoffload.offload_compile(autocast_train_step, accumulation_steps=args.k, offload=graphoffload.Offload(
        accumulate_on=args.reuse_child, activations="auto", gpu_memory_budget=int(args.reuse_budget * 2**30),
        calibration=cal, replan_after=0))
    out = {"accumulate_on": args.reuse_child, "variants": []}
    cpu = time.process_time()
    for name in ("accumulating", "updating"):
        start = time.process_time()   # the updating variant: compile_variants (the other is compiled by then)
        graph = step.compile(model, opt, batch) if name == "accumulating" else \
            step.compile_variants(model, opt, batch)["update"]
        out["variants"].append({
            "variant": name, "cpu_s": time.process_time() - start,
            "reused": bool(graph.notes_of("offload_optimizer", "activations_reused")),
            # accumulate_on="auto": the placement's trial compiles this process ran (none where its
            # peaks came from the plan cache); None for other placements
            "sum_trials": next((n.fields["trial_compiles"] for n in graph.notes_of("offload_optimizer", "grad_sum_peaks")),
                               None),
            # the accumulating variant updates nothing: no bucket schedule, its peak is the prediction
            "predicted_s": graph.schedule.step_seconds if graph.schedule is not None else None,
            "peak_bytes": step.memory().peak,
            "plan": [n.fields["strategy"] for n in graph.notes_of("offload_optimizer", "activations")],
            "recomputed_nodes": sum("recompute" in n.meta for n in graph.graph.nodes)})
    out["cpu_s"] = time.process_time() - cpu
    return out


def plan_reuse_rows(args) -> list[dict]:
    """Cold-cache and warm-cache compiles of the accumulating step in fresh processes."""
    rows = []
    for where in args.reuse_modes.split(","):
        for run in range(args.reuse_runs):
            found = {}
            budget = args.reuse_budget if where == "device" else args.reuse_auto_budget
            # empty: the first process plans; removed once the pair is done
            with tempfile.TemporaryDirectory(prefix="graphoffload-plan-reuse-") as cache:
                for label in ("cold", "warm"):
                    cmd = [sys.executable, os.path.abspath(__file__), "--forms", "plan-reuse", "--reuse-child", where,
                           "--reuse-layers", str(args.reuse_layers), "--reuse-batch", str(args.reuse_batch),
                           "--reuse-budget", str(budget), "--k", str(args.k)]
                    done = subprocess.run(cmd, env={**os.environ, "XDG_CACHE_HOME": cache}, capture_output=True,
                                          text=True)
                    if done.returncode:
                        raise SystemExit(f"the {label} compile of accumulate_on={where!r} failed:\n"
                                         f"{done.stderr[-3000:]}")
                    found[label] = json.loads(done.stdout.strip().splitlines()[-1])
            cold, warm = found["cold"], found["warm"]
            row = {"mode": f"accumulate_on={where!r}, {budget:g} GiB, run {run + 1}", "cold_cpu_s": cold["cpu_s"],
                   "warm_cpu_s": warm["cpu_s"], "saved_x": cold["cpu_s"] / warm["cpu_s"]}
            for c, w in zip(cold["variants"], warm["variants"]):
                v = c["variant"]
                row[f"{v}_cold_cpu_s"], row[f"{v}_warm_cpu_s"] = c["cpu_s"], w["cpu_s"]
                row[f"{v}_cold_reused"], row[f"{v}_reused"] = c["reused"], w["reused"]
                row[f"{v}_recomputed_nodes"] = c["recomputed_nodes"]
                if c["sum_trials"] is not None:
                    row["cold_sum_trials"], row["warm_sum_trials"] = c["sum_trials"], w["sum_trials"]
                row[f"{v}_same_prediction"] = (c["predicted_s"], c["peak_bytes"]) == (w["predicted_s"], w["peak_bytes"])
            rows.append(row)
            print(f"{row['mode']}: cold {row['cold_cpu_s']:.2f} s, warm {row['warm_cpu_s']:.2f} s CPU", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--k", type=int, default=4, help="micro-batches per update in the window rows")
    p.add_argument("--compile-ks", default="1,2,4,8", help="k of the compile-cost rows")
    p.add_argument("--clip", type=float, default=1.0, metavar="MAX_NORM")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reuse-layers", type=int, default=4, help="GPT layers of the plan-reuse rows (d=2048)")
    p.add_argument("--reuse-batch", type=int, default=12, help="sequences per micro-batch of the plan-reuse rows")
    p.add_argument("--reuse-budget", type=float, default=13.0, help="GiB: the plan-reuse rows' gpu_memory_budget")
    p.add_argument("--reuse-auto-budget", type=float, default=16.0,
                   help="GiB: the plan-reuse rows' gpu_memory_budget with accumulate_on='auto'")
    p.add_argument("--reuse-runs", type=int, default=2, help="cold/warm pairs per configuration (plan-reuse)")
    p.add_argument("--reuse-modes", default="device,auto",
                   help="the accumulate_on values of the plan-reuse rows, comma-separated (device, auto)")
    p.add_argument("--reuse-child", choices=("device", "auto"), help=argparse.SUPPRESS)   # one process's compiles
    p.add_argument("--forms", choices=("all", "host", "auto-cost", "plan-reuse"), default="all",
                   help="window rows: all, or only the host-sum pair (waiting vs overlapping); or no window rows "
                        "but the compile cost of accumulate_on='auto' (meta device)")
    p.add_argument("--auto-layers", default="6,12", help="layer counts of the auto-cost rows (d=2048)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "grad_accumulation.json"))
    args = p.parse_args()
    if args.smoke:
        args.device, args.layers, args.d_model, args.heads, args.vocab, args.seq = "cpu", 2, 64, 2, 256, 32
        args.steps, args.warmup, args.k, args.compile_ks = 2, 1, 2, "1,2"
    if args.reuse_child:
        print(json.dumps(reuse_child(args)))
        return
    if args.forms == "plan-reuse":
        rows = plan_reuse_rows(args)
        print(f"restarted accumulating step (k={args.k}, activations='auto', "
              f"{args.reuse_layers} layers, bf16, batch {args.reuse_batch}x2048, meta device): CPU seconds of both "
              "variants' compiles, a fresh process on a cold plan cache vs one on the warm cache")
        print_table(rows, ["mode", "cold_cpu_s", "warm_cpu_s", "saved_x", "accumulating_cold_cpu_s",
                           "accumulating_warm_cpu_s", "updating_cold_cpu_s", "updating_warm_cpu_s",
                           "accumulating_reused", "updating_reused", "accumulating_same_prediction",
                           "updating_same_prediction", "accumulating_recomputed_nodes", "updating_recomputed_nodes"])
        write_json(args.out, {"benchmark": "grad_accumulation plan-reuse", "device": "meta", "config": vars(args),
                              "rows": rows})
        return
    if args.forms == "auto-cost":
        rows = auto_cost_rows(args)
        print(f"compile cost of accumulate_on='auto' (k={args.k}), benchmark GPT d=2048 on the meta device; seconds")
        print_table(rows, ["mode", "params", "candidates", "device_accumulate_s", "device_update_s", "device_s",
                           "auto_accumulate_s", "auto_update_s", "auto_s", "auto_extra_s", "auto_vs_device",
                           "device_cpu_s", "auto_cpu_s", "auto_vs_device_cpu", "method"])
        write_json(args.out, {"benchmark": "grad_accumulation auto-cost", "device": "meta", "config": vars(args),
                              "rows": rows})
        return
    device = torch.device(args.device)
    base, cfg = build_gpt(args, device)
    ks = [int(x) for x in args.compile_ks.split(",")]
    g = torch.Generator().manual_seed(0)
    micro_batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
                     for _ in range(max(ks + [args.k]))]
    n_params = sum(p.numel() for p in base.parameters())
    grad_mib = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20

    compile_rows = [compile_row(base, micro_batches, k, device, args.clip) for k in ks] if args.forms == "all" else []
    for r in compile_rows:
        r["nodes_vs_k1"] = r["nodes_captured"] / compile_rows[0]["nodes_captured"]
        r["compile_vs_k1"] = r["compile_s"] / compile_rows[0]["compile_s"]

    window = micro_batches[:args.k]
    step_b = functools.partial(autocast_train_step, max_norm=args.clip)
    host_sums = graphoffload.Offload(accumulate_on="host")
    forms = [("eager", None), ("form A", graphoffload.offload_compile(
        functools.partial(window_step, max_norm=args.clip))),
        ("form B", graphoffload.offload_compile(step_b, accumulation_steps=args.k))] if args.forms == "all" else []
    forms += [(f"form B host sums, {how}", graphoffload.offload_compile(
        autocast_train_step, accumulation_steps=args.k, offload=host_sums)) for how in ("waiting", "overlapping")]
    runs, steps = {}, {}
    for name, step in forms:
        model = copy.deepcopy(base)
        opt = make_opt(model)
        steps[name] = step
        if name == "eager":
            runs[name] = lambda m=model, o=opt: window_step(m, o, window, args.clip)
        elif name == "form A":
            runs[name] = lambda s=step, m=model, o=opt: s(m, o, window)
        elif name.endswith("waiting"):   # each call's CPU adds end before the next call starts
            runs[name] = lambda s=step, m=model, o=opt: [(s(m, o, mb), s.synchronize()) for mb in window]
        else:
            runs[name] = lambda s=step, m=model, o=opt: [s(m, o, mb) for mb in window]
    times = time_interleaved(runs, device, args.warmup, args.steps)
    traces = {name: s.trace_count for name, s in steps.items() if s is not None}
    window_rows = []
    for name, step in steps.items():
        row = {"mode": f"{name} window, k={args.k}", "window_ms": median(times[name]) * 1e3}
        if step is not None:
            row["peak_predicted_MiB"] = step.memory("final").peak / 2**20
            row["traces"] = traces[name]
        window_rows.append(row)
    if "eager" in steps:
        window_rows[0]["peak_predicted_MiB"] = steps["form A"].memory("captured").peak / 2**20
        for r in window_rows:
            r["vs_eager_time"] = r["window_ms"] / window_rows[0]["window_ms"]
    waiting = median(times["form B host sums, waiting"])
    for r, name in zip(window_rows, steps):
        if name.startswith("form B host sums"):
            r["vs_waiting_time"] = median(times[name]) / waiting
            # the last call (the update)'s drain adds as many bytes as an accumulating call's adds:
            # the CPU time per call that overlapping can take off the critical path, at most
            spans = steps[name].last.executor.offload_runtime.measured_spans()
            r["host_adds_ms_per_call"] = sum(end - start for _, what, start, end in spans if what == "accumulate") * 1e3

    print(f"GPT {n_params / 1e6:.1f}M params ({cfg.n_layer} layers, d={cfg.d_model}), micro-batch "
          f"{args.batch}x{args.seq}, gradients {grad_mib:.1f} MiB, clip {args.clip}, on {device_name(device)}")
    if compile_rows:
        print_table(compile_rows, ["mode", "nodes_captured", "nodes_final", "nodes_vs_k1", "trace_s", "passes_s",
                                   "compile_s", "compile_vs_k1"])
    print_table(window_rows, ["mode", "window_ms", "vs_eager_time", "vs_waiting_time", "host_adds_ms_per_call",
                              "peak_predicted_MiB", "traces"])
    write_json(args.out, {"benchmark": "grad_accumulation", "device": device_name(device), "params": n_params,
                          "gradient_MiB": grad_mib, "config": vars(args), "rows": compile_rows + window_rows})


if __name__ == "__main__":
    main()
