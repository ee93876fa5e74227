"""Synthetic planner cases whose plans and predictions were recorded before the planner's
search was made incremental (tests/data/planner_recorded.json), so a faster planner is held to
plans no slower than the old one's and to the same prediction for any given assignment.

    python tests/planner_cases.py           # re-record (only when a model change is intended)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from graphoffload.calibration import Calibration
from graphoffload.passes.offload_planner import BucketCost, StepCosts, plan, predict

RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "planner_recorded.json")

# an H100 box as the research notes measured it (the same figures as test_offload_planner.py)
BALANCED = Calibration(h2d_bytes_per_s=55e9, d2h_bytes_per_s=55e9, duplex_bytes_per_s=72e9,
                       cpu_update_params_per_s=4.6e9, cpu_update_params_per_s_under_copy=2.7e9,
                       device_update_params_per_s=93e9, device_flops=700e12, device_bytes_per_s=3e12)
CALIBRATIONS = {
    "balanced": BALANCED,
    "slow-pcie": dataclasses.replace(BALANCED, h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9, duplex_bytes_per_s=2.5e9),
    "slow-cpu": dataclasses.replace(BALANCED, cpu_update_params_per_s=0.2e9, cpu_update_params_per_s_under_copy=0.1e9),
}
LIVE = 8 << 30
SCALING = (200, 400, 800)   # bucket counts of the planner-scaling steps
TOTAL_NUMEL = 800_000_000


def step_costs(n: int, variant: str) -> StepCosts:
    """A 24-layer-like step of `n` buckets (800 M parameters in all): forward, then backward
    finalising one bucket every two nodes. `clip`: every update waits for the end of backward
    but gradients are final in it; `overlap`: uploads may land in the next forward."""
    numel = TOTAL_NUMEL // n
    nodes = 4 * n
    buckets = [BucketCost(f"b{i}", numel, ready_node=2 * n + 2 * i + 1, grad_bytes=2 * numel,
                          upload_bytes=2 * numel, state_bytes=12 * numel, first_use_node=2 * (n - 1 - i))
               for i in range(n)]
    if variant == "clip":
        buckets = [dataclasses.replace(b, ready_node=nodes - 1, grads_final_node=b.ready_node) for b in buckets]
    return StepCosts([0.1 / nodes] * nodes, [LIVE] * nodes, buckets, overlap_next_step=variant == "overlap")


def budget_of(n: int, budget: str) -> int | None:
    """`tight`: room for about two and a half buckets' state; `loose`: for half of them."""
    state = 12 * (TOTAL_NUMEL // n)
    return {"none": None, "tight": LIVE + int(2.5 * state), "loose": LIVE + state * n // 2}[budget]


def cases() -> list[tuple[int, str, str, str]]:
    """(buckets, variant, calibration, budget) of every recorded case."""
    out = [(n, v, c, "none") for n in (8, 16, 50) for v in ("plain", "clip", "overlap") for c in CALIBRATIONS]
    out += [(n, "plain", c, b) for n in (8, 16, 50) for c in ("balanced", "slow-cpu") for b in ("tight", "loose")]
    out += [(300, "plain", "balanced", "none"), (300, "clip", "balanced", "none")]
    # the steps of benchmarks/compile_time.py's planner-scaling table, so a faster search is held
    # to the plans the exhaustive one finds where its time is measured
    out += [(n, "plain", "balanced", "none") for n in SCALING]
    return out


def assignments(n: int) -> dict[str, tuple[str, ...]]:
    """Fixed assignments whose predictions are recorded as they are."""
    return {"all-cpu": ("cpu",) * n, "all-device": ("device",) * n,
            "k=3": tuple("device" if i % 3 == 2 else "cpu" for i in range(n)),
            "scattered": tuple("device" if (i * 7) % 5 < 2 else "cpu" for i in range(n))}


def key(case: tuple[int, str, str, str]) -> str:
    return "/".join(map(str, case))


def record(case: tuple[int, str, str, str]) -> dict:
    n, variant, cal, budget = case
    costs, calibration, limit = step_costs(n, variant), CALIBRATIONS[cal], budget_of(n, budget)
    best, scored = plan(costs, calibration, limit)
    predicted = {name: (p.step_seconds if (p := predict(costs, a, calibration, limit)) else None)
                 for name, a in assignments(n).items()}
    return {"plan": "".join("d" if a == "device" else "c" for a in best.assignment),
            "step_seconds": best.step_seconds, "peak_bytes": best.peak_bytes,
            "scored": {k: (v if v != float("inf") else None) for k, v in scored.items()}, "predict": predicted}


if __name__ == "__main__":
    wanted = sys.argv[1:]
    done = json.load(open(RECORDED)) if os.path.exists(RECORDED) else {}
    for case in cases():
        if (wanted and str(case[0]) not in wanted) or key(case) in done:
            continue
        done[key(case)] = record(case)
        print(key(case), done[key(case)]["plan"], done[key(case)]["step_seconds"], flush=True)
        with open(RECORDED, "w") as f:
            json.dump(done, f, indent=1, sort_keys=True)
