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
A flip of one bucket re-simulates only from where it can change anything: both passes resume
from the traces the last kept assignment left (the first pass at the flipped bucket, the second
where its contention look-ups first reach a copy the flip moved), and without a budget each
prefetch point is known up front instead of placed in the memory tree.
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
        a sum of the same terms in the same order as over all of them; a term of zero is left
        out, which leaves the sum as it is)."""
        total = 0
        spans = self.spans
        for i in range(bisect_right(self.ends, a0), len(spans)):
            b0, b1 = spans[i]
            if b0 >= a1:
                break
            shared = (a1 if a1 < b1 else b1) - (a0 if a0 > b0 else b0)
            if shared > 0.0:
                total += shared
        return total

    def first_gap(self, start: float, seconds: float) -> float:
        """Earliest time >= start at which `seconds` fit between the transfers; transfers that
        end by `start` cannot move it, so the search begins after them."""
        spans, ends = self.spans, self.ends
        if not ends or start >= ends[-1]:   # the link is idle from `start` on (usually)
            return start
        for i in range(bisect_right(ends, start), len(spans)):
            b0, b1 = spans[i]
            if start + seconds <= b0:
                break
            if b1 > start:
                start = b1
        return start

    def insert(self, start: float, end: float, owner: int) -> None:
        span = (start, end)
        if not self.spans or self.spans[-1] <= span:   # after every other copy (usually)
            self.spans.append(span)
            self.ends.append(end)
            self.owners.append(owner)
            return
        i = bisect_right(self.spans, span)
        self.spans.insert(i, span)
        self.ends.insert(i, end)
        self.owners.insert(i, owner)


_State = tuple[float, float, float, float, float]   # delay, h2d free, d2h free, CPU free, latest late upload


@dataclass
class _Trace:
    """What one pass over the buckets leaves for a later pass to resume from: the state before
    every position of the ready order, its copies, and (second pass) how far into the step the
    contention look-ups of the positions up to each one reached. Filled in as the pass runs."""

    states: list[_State] = field(default_factory=list)
    links: dict[str, _Link] = field(default_factory=dict)
    reach: list[float] = field(default_factory=list)
    earliest: float = math.inf      # the earliest start of a copy this pass placed itself


@dataclass(frozen=True)
class _Resume:
    """Where a pass may start: its position in ready order and the trace it continues."""

    position: int
    trace: _Trace


@dataclass
class _Base:
    """An evaluated assignment that later evaluations resume from: both passes' traces and, per
    position, the earliest start of a first-pass copy of that position or a later one (filled in
    by `rebase`, only for the evaluations kept)."""

    assignment: tuple[str, ...]
    prefetch: dict[int, int]
    first: _Trace
    second: _Trace | None           # None when the second pass stopped early
    starts_from: list[float] = field(default_factory=list)


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
        self.position = [0] * len(costs.buckets)
        for p, b in enumerate(self.order):
            self.position[b] = p
        self.tree = _SuffixMaxTree(costs.live_bytes)
        self.device_seconds = [b.numel / cal.device_update_params_per_s for b in costs.buckets]
        fastest_cpu = max(cal.cpu_update_params_per_s, cal.cpu_update_params_per_s_under_copy)
        self.cpu_min_seconds = [b.numel / fastest_cpu for b in costs.buckets]
        # without a budget a prefetch starts where it lands just in time, whatever else is placed
        self.unbudgeted_prefetch = [self._just_in_time(bucket) for bucket in costs.buckets]
        self.simulated = self.evaluated = 0
        self.base: _Base | None = None
        self.last: _Base | None = None

    def _just_in_time(self, bucket: BucketCost) -> int:
        target = self.times[bucket.ready_node] - bucket.state_bytes / self.cal.h2d_bytes_per_s
        start = bisect_left(self.times, target, 0, bucket.ready_node + 1)
        return bucket.ready_node if start > bucket.ready_node else start

    def prefetch_nodes(self, assignment: Sequence[str], budget: int | None) -> tuple[dict[int, int], int] | None:
        """Where each device-path bucket's prefetch starts, as early as needed to land by its
        ready point and no earlier than memory allows (buffers live from the prefetch to the end
        of the step, written back after the update); None if a bucket cannot fit at all. Leaves
        the tree with the placed buffers added: the caller reads it, then calls `_unplace`."""
        costs, tree = self.costs, self.tree
        prefetch: dict[int, int] = {}
        for b, bucket in enumerate(costs.buckets):
            if assignment[b] != "device":
                continue
            start = self.unbudgeted_prefetch[b]
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
                  trace: _Trace | None = None) -> tuple[float, dict[str, _Link]] | None:
        """One pass over the buckets in ready order: copies on two links (slowed where they
        overlap the other link's copies of the previous pass, `contended`), the CPU worker
        (slowed while copies run), device updates delaying later compute. None as soon as the
        step is known to take at least `above` seconds (every term of it only grows).

        A bucket's simulation depends only on the state the buckets before it left and on the
        contention look-ups it makes: `resume` starts at a position from an earlier pass's trace
        there, and `trace` receives this pass's, for a later pass to resume from."""
        costs, cal, times, order, buckets = self.costs, self.cal, self.times, self.order, self.costs.buckets
        h2d_bw, d2h_bw = cal.h2d_bytes_per_s, cal.d2h_bytes_per_s
        duplex = cal.duplex_bytes_per_s / 2
        h2d_shared, d2h_shared = min(h2d_bw, duplex), min(d2h_bw, duplex)
        device_rate = cal.device_update_params_per_s
        cpu_rate, cpu_copy_rate = cal.cpu_update_params_per_s, cal.cpu_update_params_per_s_under_copy
        other_h2d, other_d2h = (None, None) if contended is None else (contended["h2d"], contended["d2h"])
        states = reaches = None
        if trace is not None:
            states, reaches = trace.states, (trace.reach if contended is not None else None)
        first, reach = 0, -math.inf
        if resume is None:
            h2d, d2h = _Link(), _Link()
            delay = free_h2d = free_d2h = free_cpu = 0.0     # delay: device updates push later compute back
            late = -math.inf
        else:
            first, old = resume.position, resume.trace
            delay, free_h2d, free_d2h, free_cpu, late = old.states[first]
            h2d, d2h = old.links["h2d"].before(first), old.links["d2h"].before(first)
            if states is not None:
                states[:] = old.states[:first]
            if reaches is not None:
                reaches[:] = old.reach[:first]
                reach = reaches[-1] if reaches else -math.inf
        earliest = math.inf
        overlap_next = costs.overlap_next_step

        def transfer(to_device: bool, what: str, start: float, nbytes: int, b: int) -> float:
            # a copy stream runs copies in the order they are issued; issued earlier in time
            # means placed earlier, even when this loop reaches it later
            nonlocal earliest, reach
            rate = h2d_bw if to_device else d2h_bw
            one_way = nbytes / rate
            if contended is None:
                seconds = one_way     # what the formula below gives when nothing is shared
            else:
                if start + one_way > reach:
                    reach = start + one_way
                other = other_d2h if to_device else other_h2d
                shared = other.overlap(start, start + one_way) / one_way if one_way else 0.0
                seconds = nbytes / rate * (1 - shared) + nbytes / (h2d_shared if to_device else d2h_shared) * shared
            link = h2d if to_device else d2h
            start = link.first_gap(start, seconds)
            if start < earliest:
                earliest = start
            if events is not None:
                events.append(Event("h2d" if to_device else "d2h", f"{what} {buckets[b].name}", start, start + seconds, b))
            link.insert(start, start + seconds, position)
            return start + seconds

        if above < math.inf:
            device_left, cpu_left = self._work_left(assignment)
        for position in range(first, len(order)):
            b = order[position]
            if states is not None:
                states.append((delay, free_h2d, free_d2h, free_cpu, late))
            self.simulated += 1
            bucket = buckets[b]
            ready = times[bucket.ready_node + 1] + delay
            if assignment[b] == "device":
                landed = transfer(True, "prefetch", times[prefetch[b]] + delay, bucket.state_bytes, b)
                if landed > free_h2d:
                    free_h2d = landed
                start = landed if landed > ready else ready
                seconds = bucket.numel / device_rate
                if events is not None:
                    events.append(Event("compute", f"update {bucket.name}", start, start + seconds, b))
                delay += start + seconds - ready
                written = transfer(False, "write back", start + seconds, bucket.state_bytes, b)
                if written > free_d2h:
                    free_d2h = written
            else:
                final = ready if bucket.grads_final_node is None else times[bucket.grads_final_node + 1] + delay
                arrived = transfer(False, "grads", final if final < ready else ready, bucket.grad_bytes, b)
                if arrived > free_d2h:
                    free_d2h = arrived
                start = max(arrived, ready, free_cpu)
                alone = bucket.numel / cpu_rate
                if contended is None or not alone:
                    seconds = alone   # what the formula below gives when nothing is copied meanwhile
                else:
                    if start + alone > reach:
                        reach = start + alone
                    copying = (other_h2d.overlap(start, start + alone) + other_d2h.overlap(start, start + alone)) / alone
                    copying = copying if copying < 1.0 else 1.0
                    seconds = alone * (1 - copying) + bucket.numel / cpu_copy_rate * copying
                if events is not None:
                    events.append(Event("cpu", f"update {bucket.name}", start, start + seconds, b))
                free_cpu = start + seconds
                uploaded = transfer(True, "upload", start + seconds, bucket.upload_bytes, b)
                if uploaded > free_h2d:
                    free_h2d = uploaded
                if overlap_next and uploaded - times[bucket.first_use_node] > late:
                    late = uploaded - times[bucket.first_use_node]
            if reaches is not None:
                reaches.append(reach)
            if above < math.inf:
                # every later device update delays compute by at least its own time, and every
                # later CPU update starts after this one ends and takes at least its time alone
                # or under copy, whichever is shorter
                i = position + 1
                compute_end = times[-1] + delay + device_left[i]
                bound = max(compute_end, free_d2h, late) if overlap_next else \
                    max(compute_end, free_h2d, free_d2h, free_cpu + cpu_left[i])
                if bound >= above:
                    return None
        links = {"h2d": h2d, "d2h": d2h}
        if trace is not None:
            states.append((delay, free_h2d, free_d2h, free_cpu, late))
            trace.links, trace.earliest = links, earliest
        compute_end = times[-1] + delay
        if overlap_next:
            # steady state: the next step starts when this one's compute ends, and an upload
            # delays it only by how far it lands after the bucket's first reader there
            step = max(compute_end, free_d2h, late)
        else:
            step = max(compute_end, free_h2d, free_d2h, free_cpu)
        if events is not None:
            events.insert(0, Event("compute", "forward + backward", 0.0, compute_end))
        return step, links

    def step_seconds(self, assignment: Sequence[str], budget: int | None = None, above: float = math.inf) -> float | None:
        """The predicted step time of an assignment, or None when it does not fit the budget or
        takes at least `above` seconds (then it is not simulated to the end).

        After `rebase`, both passes resume from the base assignment's traces: the first pass at
        the first position whose bucket changed path or prefetch (a bucket's uncontended copies
        depend only on the buckets before it), the second one no later than that and no later
        than the first position whose contention look-ups reach the earliest copy the first
        pass placed differently (look-ups that end before it see the same copies as the base's)."""
        self.evaluated += 1
        if budget is None:
            prefetch = {b: self.unbudgeted_prefetch[b] for b, path in enumerate(assignment) if path == "device"}
        else:
            placed = self.prefetch_nodes(assignment, budget)
            if placed is None:
                return None
            prefetch, _ = placed
            self._unplace(prefetch)
        base, order = self.base, self.order
        first = second = None
        if base is not None:
            old, position = base.assignment, self.position
            changed = min((position[b] for b in range(len(order)) if assignment[b] != old[b]
                           or prefetch.get(b) != base.prefetch.get(b)), default=len(order))
            first = _Resume(changed, base.first)
        passed = _Trace()
        self._simulate(assignment, prefetch, None, None, math.inf, first, passed)
        if base is not None and base.second is not None:
            differs = min(passed.earliest, base.starts_from[first.position])
            second = _Resume(min(first.position, bisect_right(base.second.reach, differs)), base.second)
        contended = _Trace()
        result = self._simulate(assignment, prefetch, passed.links, None, above, second, contended)   # rates slowed by contention
        self.last = _Base(tuple(assignment), prefetch, passed, None if result is None else contended)
        return None if result is None else result[0]

    def rebase(self) -> None:
        """Later evaluations resume from the last assignment evaluated."""
        base = self.last
        if base is not None and not base.starts_from:
            starts = [math.inf] * (len(self.order) + 1)
            for link in base.first.links.values():
                for (start, _), owner in zip(link.spans, link.owners):
                    if start < starts[owner]:
                        starts[owner] = start
            for p in range(len(self.order) - 1, -1, -1):
                if starts[p + 1] < starts[p]:
                    starts[p] = starts[p + 1]
            base.starts_from = starts
        self.base = base

    def predict(self, assignment: Sequence[str], budget: int | None = None,
                prefetch: dict[int, int] | None = None) -> Prediction | None:
        """`prefetch` (device-path bucket -> node its prefetch starts at): where the graph already
        issues them (a step re-timed after another pass inserted nodes), instead of placing them."""
        self.evaluated += 1
        if prefetch is None:
            placed = self.prefetch_nodes(assignment, budget)
            if placed is None:
                return None
            prefetch, peak = placed
        else:
            for b, start in prefetch.items():
                self.tree.add_suffix(start, self.costs.buckets[b].state_bytes)
            peak = self.tree.peak()
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
    step it predicts can no longer beat the best so far, which is where most flips end, and a
    flip already rejected against the same plan (no flip kept since) is not tried again."""
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
    kept = 0                 # flips kept so far: the plan a flip is tried against
    rejected_at = [-1] * n   # the plan (by `kept`) each bucket's flip was last rejected against
    for _ in range(max_sweeps):
        improved = False
        for b in range(n):
            if rejected_at[b] == kept:
                continue     # nothing was kept since this very flip was tried: it loses again
            best[b] = "cpu" if best[b] == "device" else "device"
            seconds = model.step_seconds(best, budget, above=best_seconds - 1e-12)
            if seconds is not None and seconds < best_seconds - 1e-12:
                best_seconds, improved = seconds, True
                kept += 1
                model.rebase()
            else:
                best[b] = "cpu" if best[b] == "device" else "device"
                rejected_at[b] = kept
        if not improved:
            break
    chosen = model.predict(best, budget)
    log.info("planned %d buckets: %.2f s, %d assignments evaluated, %d bucket simulations", n,
             time.perf_counter() - began, model.evaluated, model.simulated)
    return chosen, {name: (t if t is not None else math.inf) for name, t in scored.items()}
