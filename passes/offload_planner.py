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

A plan evaluates hundreds of assignments of the same step, so what does not depend on the
assignment (node times, ready order, device bytes per node) is built once in `StepModel`, and
each evaluation bisects instead of scanning: the search used to re-derive everything per
candidate, which made planning cubic in buckets and the largest cost of compiling deep models.
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from graphoffload.calibration import Calibration

log = logging.getLogger("graphoffload")


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


class _SuffixMaxTree:
    """Device bytes at each node under suffix additions (a prefetched buffer lives from its
    prefetch to the end of the step): add to [i, n), the largest value, and the last node above
    a threshold, each in O(log n). A node's value is its base plus the tags on its root path."""

    def __init__(self, base: Sequence[int]):
        self.n = len(base)
        size = 1
        while size < max(self.n, 1):
            size *= 2
        self.size = size
        self.add = [0] * (2 * size)
        self.top = [-math.inf] * (2 * size)   # max of the subtree, own tag included
        for i, b in enumerate(base):
            self.top[size + i] = b
        for v in range(size - 1, 0, -1):
            self.top[v] = max(self.top[2 * v], self.top[2 * v + 1])
        self.visits = 0    # tree nodes touched, for tests of the work done

    def add_suffix(self, start: int, value: int) -> None:
        """value added to every node from `start` on: the path to `start`'s leaf, tagging right siblings."""
        if start >= self.n:
            return
        v = self.size + start
        self.add[v] += value
        self.top[v] += value
        while v > 1:
            if v % 2 == 0:   # a left child: its right sibling lies wholly after start
                self.add[v + 1] += value
                self.top[v + 1] += value
            v //= 2
            self.top[v] = self.add[v] + max(self.top[2 * v], self.top[2 * v + 1])
            self.visits += 1

    def peak(self) -> float:
        return self.top[1] if self.n else 0

    def last_above(self, threshold: float) -> int:
        """The last node whose value exceeds threshold, -1 if none."""
        v, acc = 1, 0
        if self.top[1] <= threshold:
            return -1
        while v < self.size:
            acc += self.add[v]
            v = 2 * v + 1 if acc + self.top[2 * v + 1] > threshold else 2 * v
            self.visits += 1
        return v - self.size

    def values(self) -> list:
        out = list(self.top[self.size:self.size + self.n])
        for i in range(self.n):
            v = (self.size + i) // 2
            while v:
                out[i] += self.add[v]
                v //= 2
        return out


class _Link:
    """One copy stream's transfers: disjoint intervals sorted by start (their ends sorted too),
    so the gap search and the overlap with another link's transfers bisect instead of scanning."""

    __slots__ = ("spans", "ends", "owners")

    def __init__(self):
        self.spans: list[tuple[float, float]] = []
        self.ends: list[float] = []
        self.owners: list[int] = []    # the ready-order position of the bucket each copy is of

    def before(self, position: int) -> _Link:
        """The copies of the buckets before `position`: this link as it was when that bucket came."""
        kept = _Link()
        keep = [i for i, owner in enumerate(self.owners) if owner < position]
        kept.spans = [self.spans[i] for i in keep]
        kept.ends = [self.ends[i] for i in keep]
        kept.owners = [self.owners[i] for i in keep]
        return kept

    def overlap(self, a0: float, a1: float) -> float:
        """Total time [a0, a1) shares with the transfers (only intervals that overlap are summed:
        a sum of the same terms in the same order as over all of them)."""
        total = 0
        spans = self.spans
        for i in range(bisect_right(self.ends, a0), len(spans)):
            b0, b1 = spans[i]
            if b0 >= a1:
                break
            total += max(0.0, min(a1, b1) - max(a0, b0))
        return total

    def first_gap(self, start: float, seconds: float) -> float:
        """Earliest time >= start at which `seconds` fit between the transfers; transfers that
        end by `start` cannot move it, so the search begins after them."""
        spans = self.spans
        for i in range(bisect_right(self.ends, start), len(spans)):
            b0, b1 = spans[i]
            if start + seconds <= b0:
                break
            start = max(start, b1)
        return start

    def insert(self, start: float, end: float, owner: int) -> None:
        i = bisect_right(self.spans, (start, end))
        self.spans.insert(i, (start, end))
        self.ends.insert(i, end)
        self.owners.insert(i, owner)


@dataclass
class _Resume:
    """Where a first pass may start: its position in ready order, the states before every
    position and the links of the assignment it was recorded for."""

    position: int
    states: list[tuple[float, float]]
    links: dict[str, _Link]
    assignment: tuple[str, ...] = ()
    prefetch: dict[int, int] = field(default_factory=dict)


class StepModel:
    """What `predict` needs of a step that no assignment changes (node start times, buckets in
    the order their gradients become final, device bytes per node), computed once, so that
    `plan` evaluates each candidate in O(buckets log nodes) time instead of re-deriving it.

    `evaluated` counts assignments, `simulated` bucket simulations and `tree.visits` the
    memory-tree steps: what tests read to check the work a plan does."""

    def __init__(self, costs: StepCosts, cal: Calibration):
        self.costs, self.cal = costs, cal
        times = [0.0]
        for t in costs.node_seconds:
            times.append(times[-1] + t)
        self.times = times
        self.order = sorted(range(len(costs.buckets)), key=lambda b: costs.buckets[b].ready_node)
        self.tree = _SuffixMaxTree(costs.live_bytes)
        self.device_seconds = [b.numel / cal.device_update_params_per_s for b in costs.buckets]
        fastest_cpu = max(cal.cpu_update_params_per_s, cal.cpu_update_params_per_s_under_copy)
        self.cpu_min_seconds = [b.numel / fastest_cpu for b in costs.buckets]
        self.simulated = self.evaluated = 0
        self.base: _Resume | None = None
        self.last: _Resume | None = None

    def prefetch_nodes(self, assignment: Sequence[str], budget: int | None) -> tuple[dict[int, int], int] | None:
        """Where each device-path bucket's prefetch starts, as early as needed to land by its
        ready point and no earlier than memory allows (buffers live from the prefetch to the end
        of the step, written back after the update); None if a bucket cannot fit at all. Leaves
        the tree with the placed buffers added: the caller reads it, then calls `_unplace`."""
        costs, times, tree = self.costs, self.times, self.tree
        prefetch: dict[int, int] = {}
        for b, bucket in enumerate(costs.buckets):
            if assignment[b] != "device":
                continue
            target = times[bucket.ready_node] - bucket.state_bytes / self.cal.h2d_bytes_per_s
            start = bisect_left(times, target, 0, bucket.ready_node + 1)
            if start > bucket.ready_node:
                start = bucket.ready_node
            if budget is not None:
                start = max(start, tree.last_above(budget - bucket.state_bytes) + 1)
                if start > bucket.ready_node:
                    self._unplace(prefetch)
                    return None
            tree.add_suffix(start, bucket.state_bytes)
            prefetch[b] = start
        return prefetch, tree.peak()

    def _unplace(self, prefetch: dict[int, int]) -> None:
        for b, start in prefetch.items():
            self.tree.add_suffix(start, -self.costs.buckets[b].state_bytes)

    def _work_left(self, assignment: Sequence[str]) -> tuple[list[float], list[float]]:
        """Seconds of device updates and (at least) of CPU updates from each position of the
        ready order on: what a partial simulation adds to its lower bound."""
        device, cpu = [0.0], [0.0]
        for b in reversed(self.order):
            on_device = assignment[b] == "device"
            device.append(device[-1] + (self.device_seconds[b] if on_device else 0.0))
            cpu.append(cpu[-1] + (0.0 if on_device else self.cpu_min_seconds[b]))
        return device[::-1], cpu[::-1]

    def _simulate(self, assignment: Sequence[str], prefetch: dict[int, int], contended: dict[str, _Link] | None,
                  events: list[Event] | None, above: float, resume: _Resume | None = None,
                  states: list[tuple[float, float]] | None = None) -> tuple[float, dict[str, _Link]] | None:
        """One pass over the buckets in ready order: copies on two links (slowed where they
        overlap the other link's copies of the previous pass, `contended`), the CPU worker
        (slowed while copies run), device updates delaying later compute. None as soon as the
        step is known to take at least `above` seconds (every term of it only grows).

        Without contention a bucket's copies depend only on the buckets before it: `resume`
        starts at a position from a previous pass's state there, and `states` receives the
        (delay, CPU free) state before every position, for a later pass to resume from."""
        costs, cal, times = self.costs, self.cal, self.times
        h2d_bw, d2h_bw = cal.h2d_bytes_per_s, cal.d2h_bytes_per_s
        duplex = cal.duplex_bytes_per_s / 2
        links = {"h2d": _Link(), "d2h": _Link()}
        free = {"h2d": 0.0, "d2h": 0.0, "cpu": 0.0}
        delay = 0.0     # device updates on the compute stream push later compute back
        first = 0
        if resume is not None:
            first = resume.position
            delay, free["cpu"] = resume.states[first]
            links = {name: link.before(first) for name, link in resume.links.items()}
            if states is not None:
                states[:] = resume.states[:first]
        late = -math.inf
        overlap_next = costs.overlap_next_step

        def transfer(link: str, name: str, start: float, nbytes: int, b: int) -> float:
            # a copy stream runs copies in the order they are issued; issued earlier in time
            # means placed earlier, even when this loop reaches it later
            rate = h2d_bw if link == "h2d" else d2h_bw
            one_way = nbytes / rate
            if contended is None:
                shared = 0.0
            else:
                shared = contended["d2h" if link == "h2d" else "h2d"].overlap(start, start + one_way) / one_way \
                    if one_way else 0.0
            seconds = nbytes / rate * (1 - shared) + nbytes / min(rate, duplex) * shared
            start = links[link].first_gap(start, seconds)
            if events is not None:
                events.append(Event(link, name, start, start + seconds, b))
            links[link].insert(start, start + seconds, position)
            free[link] = max(free[link], start + seconds)
            return start + seconds

        if above < math.inf:
            device_left, cpu_left = self._work_left(assignment)
        for position in range(first, len(self.order)):
            b = self.order[position]
            if states is not None:
                states.append((delay, free["cpu"]))
            self.simulated += 1
            bucket = costs.buckets[b]
            ready = times[bucket.ready_node + 1] + delay
            if assignment[b] == "device":
                landed = transfer("h2d", f"prefetch {bucket.name}", times[prefetch[b]] + delay, bucket.state_bytes, b)
                start = max(ready, landed)
                seconds = bucket.numel / cal.device_update_params_per_s
                if events is not None:
                    events.append(Event("compute", f"update {bucket.name}", start, start + seconds, b))
                delay += start + seconds - ready
                transfer("d2h", f"write back {bucket.name}", start + seconds, bucket.state_bytes, b)
            else:
                final = ready if bucket.grads_final_node is None else times[bucket.grads_final_node + 1] + delay
                arrived = transfer("d2h", f"grads {bucket.name}", min(final, ready), bucket.grad_bytes, b)
                start = max(arrived, ready, free["cpu"])
                alone = bucket.numel / cal.cpu_update_params_per_s
                if not alone:
                    copying = 0
                elif contended is None:
                    copying = 0 / alone
                else:
                    copying = (contended["h2d"].overlap(start, start + alone)
                               + contended["d2h"].overlap(start, start + alone)) / alone
                seconds = alone * (1 - min(copying, 1.0)) + bucket.numel / cal.cpu_update_params_per_s_under_copy * min(copying, 1.0)
                if events is not None:
                    events.append(Event("cpu", f"update {bucket.name}", start, start + seconds, b))
                free["cpu"] = start + seconds
                uploaded = transfer("h2d", f"upload {bucket.name}", start + seconds, bucket.upload_bytes, b)
                if overlap_next:
                    late = max(late, uploaded - times[bucket.first_use_node])
            if above < math.inf:
                # every later device update delays compute by at least its own time, and every
                # later CPU update starts after this one ends and takes at least its time alone
                # or under copy, whichever is shorter
                i = position + 1
                compute_end = times[-1] + delay + device_left[i]
                bound = max(compute_end, free["d2h"], late) if overlap_next else \
                    max(compute_end, free["h2d"], free["d2h"], free["cpu"] + cpu_left[i])
                if bound >= above:
                    return None
        if states is not None:
            states.append((delay, free["cpu"]))
        compute_end = times[-1] + delay
        if overlap_next:
            # steady state: the next step starts when this one's compute ends, and an upload
            # delays it only by how far it lands after the bucket's first reader there
            step = max(compute_end, free["d2h"], late)
        else:
            step = max([compute_end, *free.values()])
        if events is not None:
            events.insert(0, Event("compute", "forward + backward", 0.0, compute_end))
        return step, links

    def step_seconds(self, assignment: Sequence[str], budget: int | None = None, above: float = math.inf) -> float | None:
        """The predicted step time of an assignment, or None when it does not fit the budget or
        takes at least `above` seconds (then it is not simulated to the end)."""
        self.evaluated += 1
        placed = self.prefetch_nodes(assignment, budget)
        if placed is None:
            return None
        prefetch, _ = placed
        self._unplace(prefetch)
        resume, base = None, self.base
        if base is not None:
            # the first position whose bucket changed path or prefetch: the first pass is the
            # base's up to there
            changed = [p for p, b in enumerate(self.order) if assignment[b] != base.assignment[b]
                       or prefetch.get(b) != base.prefetch.get(b)]
            resume = _Resume(min(changed, default=len(self.order)), base.states, base.links)
        states: list[tuple[float, float]] = []
        first = self._simulate(assignment, prefetch, None, None, math.inf, resume, states)
        self.last = _Resume(0, states, first[1], tuple(assignment), prefetch)
        second = self._simulate(assignment, prefetch, first[1], None, above)   # rates slowed by contention
        return None if second is None else second[0]

    def rebase(self) -> None:
        """Later evaluations resume their first pass from the last assignment evaluated."""
        self.base = self.last

    def predict(self, assignment: Sequence[str], budget: int | None = None) -> Prediction | None:
        self.evaluated += 1
        placed = self.prefetch_nodes(assignment, budget)
        if placed is None:
            return None
        prefetch, peak = placed
        device_bytes = self.tree.values()
        self._unplace(prefetch)
        first = self._simulate(assignment, prefetch, None, None, math.inf)
        events: list[Event] = []
        step, _ = self._simulate(assignment, prefetch, first[1], events, math.inf)
        return Prediction(tuple(assignment), step, prefetch, events, peak, self.times[:-1], device_bytes)


def predict(costs: StepCosts, assignment: Sequence[str], cal: Calibration, budget: int | None = None) -> Prediction | None:
    """Predicted timeline of one step; None when the assignment cannot meet the budget.

    The compute stream runs the nodes back to back, pushed back by device-path updates; the
    copies are simulated twice, the second time at the rates the first one's overlaps imply."""
    return StepModel(costs, cal).predict(assignment, budget)


def _fixed_stride(n: int, k: int) -> tuple[str, ...]:
    """Deep Optimizer States' schedule: one bucket in every k on the device."""
    return tuple("device" if i % k == k - 1 else "cpu" for i in range(n))


SWEEPS = 3   # local-search sweeps over the buckets; rarely does a third one still improve


def plan(costs: StepCosts, cal: Calibration, budget: int | None = None,
         max_sweeps: int = SWEEPS) -> tuple[Prediction, dict[str, float]]:
    """The fastest predicted assignment, and the predicted time of each named candidate.

    A first-improvement local search (flip one bucket's path, keep it if faster) from the best
    fixed schedule. The step model is built once; a flip's simulation stops as soon as the
    step it predicts can no longer beat the best so far, which is where most flips end."""
    began = time.perf_counter()
    model = StepModel(costs, cal)
    n = len(costs.buckets)
    candidates = {"all-cpu": ("cpu",) * n, "all-device": ("device",) * n}
    for k in range(2, min(n, 8) + 1):
        candidates[f"fixed k={k}"] = _fixed_stride(n, k)
    scored = {name: model.step_seconds(a, budget) for name, a in candidates.items()}
    feasible = {name: t for name, t in scored.items() if t is not None}
    if not feasible:
        raise ValueError("no assignment fits the memory budget")   # all-cpu fits when offload fits
    best_name = min(feasible, key=feasible.__getitem__)
    best, best_seconds = list(candidates[best_name]), feasible[best_name]
    model.step_seconds(best, budget)
    model.rebase()
    for _ in range(max_sweeps):
        improved = False
        for b in range(n):
            best[b] = "cpu" if best[b] == "device" else "device"
            seconds = model.step_seconds(best, budget, above=best_seconds - 1e-12)
            if seconds is not None and seconds < best_seconds - 1e-12:
                best_seconds, improved = seconds, True
                model.rebase()
            else:
                best[b] = "cpu" if best[b] == "device" else "device"
        if not improved:
            break
    chosen = model.predict(best, budget)
    log.info("planned %d buckets: %.2f s, %d assignments evaluated, %d bucket simulations", n,
             time.perf_counter() - began, model.evaluated, model.simulated)
    return chosen, {name: (t if t is not None else math.inf) for name, t in scored.items()}
