"""Benchmark compile time: how long graphoffload takes to compile the benchmark GPT's train
step, stage by stage, against a plain `make_fx` trace of the same forward and backward.

    python benchmarks/compile_time.py                          # 6, 12, 24, 48 layers
    python benchmarks/compile_time.py --layers 6,12 --smoke    # tiny sizes, for the tests
    python benchmarks/compile_time.py --markdown results/compile_time.json   # RESULTS.md's table
    python benchmarks/compile_time.py --layers "" --planner-buckets 100,200,400,800   # the planner alone
    python benchmarks/compile_time.py --layers 6,12,24 --activations-fraction 0.6 --planner-buckets ""

Everything runs on the meta device (no memory is allocated, nothing executes), so it measures
the compiler alone, on any machine: the step is captured, every pass runs, and the offload pass
plans CPU or device updates per bucket (`device_updates="auto"`) under a calibration file. Rows:
`make_fx` (a fake-tensor trace of forward + backward through `torch.autograd.grad`, the floor a
compiler that captures a whole step cannot go under), `capture` (graphoffload's trace of the
whole step, optimizer included), one row per pass from the step's own timings (each includes the graph's
verification after it), `planning` (the planner inside `offload_optimizer`, as it logs it),
`other` (verifying the captured graph, generating the module's code, stage snapshots, executor set-up) and `total` (wall time of the compile);
`verification` is the CPU time of every verification of the graph (after capture and each pass, as the
PassManager logs it; already inside the rows above) and its share of the compile's CPU time (issue 14:
at most 10%).
With `--activations-fraction F`, each size is also compiled with `activations="auto"` under F times
the plain compile's predicted peak (the activation planner recomputes or offloads saved
activations until it fits; on an empty plan cache of its own): its CPU seconds, against the plain
compile and `make_fx`, and how many activations it recomputed and offloaded; then the same step
from moved lines of another file (a restarted job whose script was edited above the step: every
node's stack trace differs), which finds the plan on disk.
Both traces run in the same process, back to back, for each size.

Then the planner alone on synthetic steps of growing bucket counts (`--planner-buckets`; the
800 M-parameter step of tests/planner_cases.py, the balanced H100 calibration, no budget): its
seconds (process CPU time, so other jobs on the machine count less), the assignments it
evaluated and the bucket simulations they took, and the growth from each size to the next,
which shows the search's order in buckets.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import tempfile
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call

sys.path.insert(0, os.path.dirname(__file__))
# the synthetic planner steps the planner's tests are held to, built in one place
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from common import autocast_train_step, build_gpt, print_table, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


class _Records(logging.Handler):
    """Keeps the graphoffload logger's records: the capture and planning times it reports."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def seconds(self, prefix: str, arg: int = 1) -> float | None:
        hits = [r.args[arg] for r in self.records if r.msg.startswith(prefix)]
        return sum(hits) if hits else None


def plain_make_fx(model, batch) -> tuple[float, float, int]:
    """Seconds (wall, CPU) and nodes of a fake-tensor `make_fx` trace of forward and backward."""
    params = dict(model.named_parameters())

    def forward_backward(params, batch):
        loss = functional_call(model, params, (batch,), {"labels": batch})
        return torch.autograd.grad(loss, list(params.values()))

    start, cpu = time.perf_counter(), time.process_time()
    with torch.autograd.set_multithreading_enabled(False):
        gm = make_fx(forward_backward, tracing_mode="fake")(params, batch)
    return time.perf_counter() - start, time.process_time() - cpu, len(gm.graph.nodes)


def compile_row(args, layers: int, cal) -> dict:
    import graphoffload

    sizes = argparse.Namespace(**{**vars(args), "layers": layers})
    model, _ = build_gpt(sizes, torch.device("meta"))
    batch = torch.empty((args.batch, args.seq), dtype=torch.long, device="meta")
    baseline_s, baseline_cpu_s, baseline_nodes = plain_make_fx(model, batch)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    step = graphoffload.offload_compile(autocast_train_step, offload=graphoffload.Offload(
        device_updates="auto", calibration=cal, replan_after=0))
    records = _Records()
    log = logging.getLogger("graphoffload")
    old_level = log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        graph = step.compile(model, opt, batch)
        total, total_cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        log.removeHandler(records)
        log.setLevel(old_level)
    schedule = graph.schedule
    row = {"layers": layers, "params": sum(p.numel() for p in model.parameters()),
           "nodes": len(graph.graph.nodes), "make_fx_nodes": baseline_nodes, "make_fx_s": baseline_s,
           "capture_s": records.seconds("captured "), "passes_s": dict(step.last.timings),
           "planning_s": records.seconds("planned "), "total_s": total,
           # every verification of the compile (after capture and each pass): wall, then CPU
           "verify_s": records.seconds("verified "), "verify_cpu_s": records.seconds("verified ", 2),
           "buckets": len(schedule.assignment) if schedule is not None else 0,
           "device_buckets": schedule.assignment.count("device") if schedule is not None else 0}
    row["other_s"] = total - (row["capture_s"] or 0.0) - sum(row["passes_s"].values())
    row["vs_make_fx"] = total / baseline_s
    # CPU time of the process: on a machine shared with other jobs, the comparison they disturb less
    row.update(make_fx_cpu_s=baseline_cpu_s, total_cpu_s=total_cpu, vs_make_fx_cpu=total_cpu / baseline_cpu_s)
    if row["verify_cpu_s"] is not None:   # issue 14: verification at most 10% of the compile
        row["verify_share_cpu"] = row["verify_cpu_s"] / total_cpu
    # a restarted job: a fresh step compiles the same model again and finds the plan on disk
    again = graphoffload.offload_compile(autocast_train_step, offload=graphoffload.Offload(
        device_updates="auto", calibration=cal, replan_after=0))
    start = time.perf_counter()
    reused = again.compile(model, opt, batch)
    row["total_plan_reused_s"] = time.perf_counter() - start
    row["plan_reused"] = any("plan reused" in note for note in reused.notes.get("offload_optimizer", []))
    if args.activations_fraction:
        row.update(activations_row(model, opt, batch, cal, args.activations_fraction, step.memory().peak))
        row["activations_vs_plain_cpu"] = row["activations_cpu_s"] / total_cpu
        row["activations_vs_make_fx_cpu"] = row["activations_cpu_s"] / baseline_cpu_s
    return row


def activations_row(model, opt, batch, cal, fraction: float, peak: int) -> dict:
    """The same step compiled with `activations="auto"` under `fraction` of its predicted peak, on
    an empty plan cache of its own (so it plans): the compile's CPU seconds and what it chose; then
    the same step from moved lines of another file (a user's script edited above it, which changes
    every node's stack trace), which should find that plan on disk."""
    import graphoffload

    budget = int(fraction * peak)

    def compile_with(step_fn) -> tuple[float, object]:
        step = graphoffload.offload_compile(step_fn, offload=graphoffload.Offload(
            device_updates="auto", calibration=cal, replan_after=0, gpu_memory_budget=budget, activations="auto"))
        cpu = time.process_time()
        graph = step.compile(model, opt, batch)
        return time.process_time() - cpu, graph

    was = os.environ.get("XDG_CACHE_HOME")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["XDG_CACHE_HOME"] = cache
        try:
            cold_s, graph = compile_with(autocast_train_step)
            moved_s, moved = compile_with(moved_down(autocast_train_step, 40))
        finally:
            if was is None:
                os.environ.pop("XDG_CACHE_HOME")
            else:
                os.environ["XDG_CACHE_HOME"] = was
    chosen = graph.notes_of("offload_optimizer", "activations")[0].fields
    return {"activations_budget": budget, "activations_cpu_s": cold_s,
            "activations_peak": graphoffload.analyze_memory(graph).peak, "activations_recomputed": chosen["recompute"],
            "activations_offloaded": chosen["offload"], "activations_moved_cpu_s": moved_s,
            "activations_moved_reused": bool(moved.notes_of("offload_optimizer", "activations_reused"))}


def moved_down(fn, lines: int):
    """`fn` defined again from its code, `lines` lines further down a file of another name."""
    scope = dict(fn.__globals__)
    exec(compile("\n" * lines + inspect.getsource(fn), "edited_train_script.py", "exec"), scope)
    return scope[fn.__name__]


def planner_rows(buckets: list[int]) -> list[dict]:
    """Planner seconds, assignments evaluated and bucket simulations on synthetic steps."""
    from planner_cases import BALANCED, step_costs

    from graphoffload.passes.offload_planner import plan

    rows = []
    records = _Records()
    log = logging.getLogger("graphoffload")
    old_level = log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        for n in buckets:
            costs = step_costs(n, "plain")
            records.records.clear()
            start = time.process_time()
            best, _ = plan(costs, BALANCED)
            seconds = time.process_time() - start
            (logged,) = [r for r in records.records if r.msg.startswith("planned ")]
            row = {"buckets": n, "planner_s": seconds, "evaluated": logged.args[2], "simulated": logged.args[3],
                   "device_buckets": best.assignment.count("device")}
            if rows:
                row["growth"] = seconds / rows[-1]["planner_s"]
                row["buckets_growth"] = n / rows[-1]["buckets"]
            rows.append(row)
            print(f"planner, {n} buckets: {seconds:.2f} s", flush=True)
    finally:
        log.removeHandler(records)
        log.setLevel(old_level)
    return rows


def table(rows: list[dict]) -> list[dict]:
    """One line per stage, one column per size."""
    passes = list(dict.fromkeys(name for r in rows for name in r["passes_s"]))
    stages = [("make_fx (fwd+bwd)", lambda r: r["make_fx_s"]), ("capture", lambda r: r["capture_s"])]
    stages += [(f"pass {name}", lambda r, name=name: r["passes_s"].get(name)) for name in passes]
    stages += [("planning (inside offload_optimizer)", lambda r: r["planning_s"]),
               ("other (code generation, checks, snapshots, executor)", lambda r: r["other_s"]),
               ("verification, CPU (after capture and each pass; in the rows above)", lambda r: r.get("verify_cpu_s")),
               ("verification / total compile, CPU", lambda r: r.get("verify_share_cpu")),
               ("total compile", lambda r: r["total_s"]),
               ("total compile, plan reused from disk", lambda r: r.get("total_plan_reused_s")),
               ("total / make_fx", lambda r: r["vs_make_fx"]),
               ("CPU time: make_fx / total compile", lambda r: _pair(r.get("make_fx_cpu_s"), r.get("total_cpu_s"))),
               ("CPU time: total / make_fx", lambda r: r.get("vs_make_fx_cpu"))]
    if any("activations_cpu_s" in r for r in rows):   # --activations-fraction
        stages += [("activations='auto' compile, CPU", lambda r: r.get("activations_cpu_s")),
                   ("activations='auto' / total compile, CPU", lambda r: r.get("activations_vs_plain_cpu")),
                   ("activations='auto' / make_fx, CPU", lambda r: r.get("activations_vs_make_fx_cpu")),
                   ("activations recomputed / offloaded", lambda r: _counts(r.get("activations_recomputed"),
                                                                            r.get("activations_offloaded"))),
                   ("activations='auto', the step's lines moved: compile, CPU (plan reused from disk?)",
                    lambda r: _reuse(r.get("activations_moved_cpu_s"), r.get("activations_moved_reused")))]
    out = []
    for label, get in stages:
        line = {"stage": label}
        for r in rows:
            line[f"{r['layers']} layers"] = get(r)
        out.append(line)
    out.append({"stage": "nodes (compiled / make_fx)",
                **{f"{r['layers']} layers": f"{r['nodes']} / {r['make_fx_nodes']}" for r in rows}})
    out.append({"stage": "buckets (on the device)",
                **{f"{r['layers']} layers": f"{r['buckets']} ({r['device_buckets']})" for r in rows}})
    return out


def _counts(a: int | None, b: int | None) -> str | None:
    return None if a is None or b is None else f"{a} / {b}"


def _reuse(seconds: float | None, reused: bool | None) -> str | None:
    return None if seconds is None else f"{seconds:.2f} ({'reused' if reused else 'planned again'})"


def _pair(a: float | None, b: float | None) -> str | None:
    return None if a is None or b is None else f"{a:.2f} / {b:.2f}"


def markdown(lines: list[dict]) -> str:
    columns = list(dict.fromkeys(c for line in lines for c in line))   # every row's, in order
    cell = lambda x: "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)  # noqa: E731
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(line.get(c)) for c in columns) + " |" for line in lines]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="6,12,24,48", help="comma-separated layer counts")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--calibration", default=os.path.join(HERE, "calibrations", "h100-research-notes.json"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes (2 and 4 layers, d=128)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "compile_time.json"))
    p.add_argument("--planner-buckets", default="100,200,400,800",
                   help="comma-separated bucket counts of the synthetic planner steps ('' for none)")
    p.add_argument("--activations-fraction", type=float, default=0.0,
                   help="also compile each size with activations='auto' under this fraction of its predicted "
                        "peak (e.g. 0.6; 0: not)")
    p.add_argument("--markdown", metavar="JSON", help="no run: print a results file's table as markdown")
    args = p.parse_args()
    if args.markdown:
        with open(args.markdown) as f:
            result = json.load(f)
        if result["rows"]:
            print(markdown(table(result["rows"])))
        if result.get("planner"):
            print()
            print(markdown(result["planner"]))
        return
    if args.smoke:
        args.layers, args.d_model, args.heads, args.vocab, args.seq, args.batch = "2,4", 128, 4, 256, 64, 1
        args.planner_buckets = "20,40"
    from graphoffload.calibration import Calibration

    # a cache of the run's own: the first compile of each size plans, the second finds its plan
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="graphoffload-compile-time-")

    with open(args.calibration) as f:
        cal = Calibration(**json.load(f))
    compile_row(argparse.Namespace(**{**vars(args), "d_model": 64, "heads": 2, "vocab": 64, "seq": 16}), 1, cal)
    # paths relative to the repository: a results file says nothing of the machine it ran on
    root = os.path.dirname(HERE)
    config = {**vars(args), "calibration": os.path.relpath(args.calibration, root), "out": os.path.relpath(args.out, root)}
    rows, planner = [], []   # after a warm-up compile: the first trace in a process pays torch's one-time setup

    def save() -> None:   # after every size: a run cut short keeps the sizes it finished
        write_json(args.out, {"benchmark": "compile-time", "device": "meta", "config": config,
                              "calibration": os.path.basename(args.calibration), "rows": rows, "planner": planner})

    for layers in (int(x) for x in args.layers.split(",") if x):
        rows.append(compile_row(args, layers, cal))
        print(f"{layers} layers: {rows[-1]['total_s']:.1f} s compile, {rows[-1]['make_fx_s']:.1f} s make_fx", flush=True)
        save()
    if rows:
        lines = table(rows)
        print(f"compile time of the benchmark GPT (d={args.d_model}, batch {args.batch}x{args.seq}), meta device, "
              f'offload device_updates="auto" under {os.path.basename(args.calibration)}; seconds')
        print_table(lines, list(lines[0]))
    buckets = [int(x) for x in args.planner_buckets.split(",") if x]
    if buckets:
        planner.extend(planner_rows(buckets))
        save()
        print("the planner alone on synthetic steps (800 M parameters, balanced H100 calibration, no budget); "
              "CPU seconds, growth against the size before")
        print_table(planner, list(planner[-1]))


if __name__ == "__main__":
    main()
