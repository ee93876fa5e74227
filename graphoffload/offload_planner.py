"""Performance model and planner for offloaded updates: CPU or device, per bucket.

With optimizer state on the host, a bucket can be updated two ways. CPU path: its gradients
go device-to-host, the CPU updates it, its parameters go back. Device path: its state is
prefetched host-to-device (while backward still runs, as memory allows), the device updates it
right when its gradients are final, and the state goes back. The two are about equally fast
on current machines, so running both at once shortens the update phase (Deep Optimizer States,
Maurya et al. 2024, which fixes "every k-th subgroup on the device" by hand).

`predict` simulates a step for an assignment: the compute stream (node times from the
calibration's roofline, or measured times), both copy links (sharing bandwidth when both run:
`duplex_bytes_per_s`), and the CPU worker (slower while copies run: the host memory system is
shared). `plan` searches assignments: all-CPU, all-device, every fixed stride k, and a greedy
local search from the best of them, keeping every device buffer within the memory budget at
every node, so the chosen plan is never predicted slower than any fixed-k schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from graphoffload.calibration import Calibration


@dataclass(frozen=True)
class BucketCost:
    """What the model needs to know of one update bucket."""

    name: str
    numel: int
    ready_node: int            # index of the node after which its gradients are final
    grad_bytes: int            # device-to-host on the CPU path
    upload_bytes: int          # updated parameters host-to-device on the CPU path
    state_bytes: int           # state prefetched to / written back from the device on the device path
    # index of the node after which the last gradient is final, when that is before ready_node
    # (the step scales the gradients after backward, e.g. clipping, and the CPU path copies them
    # out unscaled while backward runs)
    grads_final_node: int | None = None
    first_use_node: int = 0    # index of the first node that reads its parameters (in forward)


@dataclass(frozen=True)
class StepCosts:
    node_seconds: Sequence[float]        # compute-stream time of each node, in graph order
    live_bytes: Sequence[int]            # device bytes live at each node with every bucket on the CPU path
    buckets: Sequence[BucketCost]
    # CPU-path uploads may finish in the next step's forward, before each bucket's first reader
    overlap_next_step: bool = False


@dataclass
class Event:
    track: str        # "compute", "h2d", "d2h", "cpu"
    name: str
    start: float
    end: float
    bucket: int | None = None


@dataclass
class Prediction:
    assignment: tuple[str, ...]           # "cpu" | "device" per bucket
    step_seconds: float
    prefetch_node: dict[int, int]          # device-path bucket -> node its prefetch starts after
    events: list[Event] = field(default_factory=list)
    peak_bytes: int = 0
    node_start: list[float] = field(default_factory=list)   # predicted start of each node (no device updates)
    device_bytes: list[int] = field(default_factory=list)   # predicted device bytes live at each node


def _overlap(a0: float, a1: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in intervals)


def _first_gap(busy: list[tuple[float, float]], start: float, seconds: float) -> float:
    """Earliest time >= start at which `seconds` fit between the sorted busy intervals."""
    for b0, b1 in busy:
        if start + seconds <= b0:
            break
        start = max(start, b1)
    return start


def _prefetch_nodes(costs: StepCosts, assignment: Sequence[str], budget: int | None,
                    times: list[float], cal: Calibration) -> tuple[dict[int, int], int, list[int]] | None:
    """Where each device-path bucket's prefetch starts, as early as needed to land by its
    ready point and no earlier than memory allows; None if a bucket cannot fit at all."""
    extra = [0] * len(costs.live_bytes)
    prefetch: dict[int, int] = {}
    for b, bucket in enumerate(costs.buckets):
        if assignment[b] != "device":
            continue
        lead = bucket.state_bytes / cal.h2d_bytes_per_s
        target = times[bucket.ready_node] - lead
        start = next((i for i in range(bucket.ready_node + 1) if times[i] >= target), bucket.ready_node)
        # buffers live from the prefetch to the end of the step (written back after the update)
        while budget is not None and start <= bucket.ready_node and any(
                costs.live_bytes[i] + extra[i] + bucket.state_bytes > budget for i in range(start, len(extra))):
            start += 1
        if start > bucket.ready_node:
            return None
        for i in range(start, len(extra)):
            extra[i] += bucket.state_bytes
        prefetch[b] = start
    device_bytes = [lv + e for lv, e in zip(costs.live_bytes, extra)]
    return prefetch, max(device_bytes, default=0), device_bytes


def predict(costs: StepCosts, assignment: Sequence[str], cal: Calibration, budget: int | None = None) -> Prediction | None:
    """Predicted timeline of one step; None when the assignment cannot meet the budget."""
    times = [0.0]
    for t in costs.node_seconds:
        times.append(times[-1] + t)
    placed = _prefetch_nodes(costs, assignment, budget, times, cal)
    if placed is None:
        return None
    prefetch, peak, device_bytes = placed
    h2d_bw, d2h_bw = cal.h2d_bytes_per_s, cal.d2h_bytes_per_s
    best: Prediction | None = None
    link_busy: dict[str, list[tuple[float, float]]] = {"h2d": [], "d2h": []}
    for _ in range(2):   # second pass: rates slowed where the first pass saw contention
        events: list[Event] = []
        free = {"h2d": 0.0, "d2h": 0.0, "cpu": 0.0}
        delay = 0.0     # device updates on the compute stream push later compute back
        busy = {"h2d": [], "d2h": []}

        def transfer(link: str, name: str, start: float, nbytes: int, b: int) -> float:
            # a copy stream runs copies in the order they are issued; issued earlier in time
            # means placed earlier, even when this loop reaches it later
            rate = h2d_bw if link == "h2d" else d2h_bw
            one_way = nbytes / rate
            other = link_busy["d2h" if link == "h2d" else "h2d"]
            shared = _overlap(start, start + one_way, other) / one_way if one_way else 0.0
            seconds = nbytes / rate * (1 - shared) + nbytes / min(rate, cal.duplex_bytes_per_s / 2) * shared
            start = _first_gap(busy[link], start, seconds)
            events.append(Event(link, name, start, start + seconds, b))
            busy[link].append((start, start + seconds))
            busy[link].sort()
            free[link] = max(free[link], start + seconds)
            return start + seconds

        order = sorted(range(len(costs.buckets)), key=lambda b: costs.buckets[b].ready_node)
        for b in order:
            bucket = costs.buckets[b]
            ready = times[bucket.ready_node + 1] + delay
            if assignment[b] == "device":
                landed = transfer("h2d", f"prefetch {bucket.name}", times[prefetch[b]] + delay, bucket.state_bytes, b)
                start = max(ready, landed)
                seconds = bucket.numel / cal.device_update_params_per_s
                events.append(Event("compute", f"update {bucket.name}", start, start + seconds, b))
                delay += start + seconds - ready
                transfer("d2h", f"write back {bucket.name}", start + seconds, bucket.state_bytes, b)
            else:
                final = ready if bucket.grads_final_node is None else times[bucket.grads_final_node + 1] + delay
                arrived = transfer("d2h", f"grads {bucket.name}", min(final, ready), bucket.grad_bytes, b)
                start = max(arrived, ready, free["cpu"])
                alone = bucket.numel / cal.cpu_update_params_per_s
                copying = _overlap(start, start + alone, link_busy["h2d"] + link_busy["d2h"]) / alone if alone else 0
                seconds = alone * (1 - min(copying, 1.0)) + bucket.numel / cal.cpu_update_params_per_s_under_copy * min(copying, 1.0)
                events.append(Event("cpu", f"update {bucket.name}", start, start + seconds, b))
                free["cpu"] = start + seconds
                transfer("h2d", f"upload {bucket.name}", start + seconds, bucket.upload_bytes, b)
        compute_end = times[-1] + delay
        events.insert(0, Event("compute", "forward + backward", 0.0, compute_end))
        step = max([compute_end, *free.values()])
        if costs.overlap_next_step:
            # steady state: the next step starts when this one's compute ends, and an upload
            # delays it only by how far it lands after the bucket's first reader there
            late = [e.end - times[costs.buckets[e.bucket].first_use_node] for e in events
                    if e.track == "h2d" and e.name.startswith("upload")]
            step = max([compute_end, free["d2h"], *late])
        best = Prediction(tuple(assignment), step, prefetch, events, peak, times[:-1], device_bytes)
        link_busy = busy
    return best


def _fixed_stride(n: int, k: int) -> tuple[str, ...]:
    """Deep Optimizer States' schedule: one bucket in every k on the device."""
    return tuple("device" if i % k == k - 1 else "cpu" for i in range(n))


def plan(costs: StepCosts, cal: Calibration, budget: int | None = None, max_sweeps: int = 3) -> tuple[Prediction, dict[str, float]]:
    """The fastest predicted assignment, and the predicted time of each named candidate."""
    n = len(costs.buckets)
    candidates = {"all-cpu": ("cpu",) * n, "all-device": ("device",) * n}
    for k in range(2, min(n, 8) + 1):
        candidates[f"fixed k={k}"] = _fixed_stride(n, k)
    scored = {name: predict(costs, a, cal, budget) for name, a in candidates.items()}
    feasible = {name: p for name, p in scored.items() if p is not None}
    if not feasible:
        raise ValueError("no assignment fits the memory budget")   # all-cpu fits when offload fits
    best = min(feasible.values(), key=lambda p: p.step_seconds)
    for _ in range(max_sweeps):
        improved = False
        for b in range(n):
            trial = list(best.assignment)
            trial[b] = "cpu" if trial[b] == "device" else "device"
            p = predict(costs, trial, cal, budget)
            if p is not None and p.step_seconds < best.step_seconds - 1e-12:
                best, improved = p, True
        if not improved:
            break
    return best, {name: (p.step_seconds if p else math.inf) for name, p in scored.items()}
