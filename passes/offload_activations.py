"""Activations under the offload budget: keep, recompute or offload each saved activation.

With `Offload(gpu_memory_budget=..., activations="auto")` the optimizer state is planned first
(offload_optimizer's buckets), then, while the predicted device peak (graphoffload.memory's
liveness analysis of the offloaded graph, prefetched state buffers included) is over the
budget, this module frees saved activations at the peak: forward values that backward reads.
Each one can

- stay on the device (keep, today's behaviour);
- be recomputed in backward, right before its first backward reader, when it is a short chain
  of ATen ops (at most `MAX_RECOMPUTE_NODES`; views, and one output of a multi-output op such
  as a layer norm, included) over values that are on the device at that point anyway and
  unchanged since forward. The duplicated nodes carry `meta["recompute"]`, and a
  chain that draws random numbers (dropout's `bernoulli_`) replays the forward's draws with
  the generator state saved before them (`graphoffload.rng_state` / `swap_rng_state`, as
  activation checkpointing does), so results stay bit-identical;
- be copied to pinned host memory right after its last forward read (`copy_to_host`) and
  brought back (`prefetch_to_device`, waiting for the copy out in stream order) early enough
  before its first backward reader for the copy to land, as the calibration's host-to-device
  rate predicts (`wait_device` right before the reader).

The choice is greedy: among the activations live at the current peak, the one that frees the
most bytes per second of added cost (recompute: the recomputed nodes' compute time from the
calibration's roofline; offload: its bytes over the link, each way) goes first, and every
choice is checked on the memory analysis of the rewritten graph. When no activation is live at
the peak any more, the peak reached is the least this plan can do and the pass fails with it.

The memory is shared exactly: both plans are checked against the same liveness analysis, the
prefetched optimizer state included. The link is shared on one timeline, but not jointly
planned: with a planned schedule (`graph.schedule`), `place_on_schedule` puts each activation
copy in the gaps the state's transfers leave on its link and lengthens the predicted step by
the recompute time and by any copy back that lands after its reader should start; the bucket
plan is made first and keeps its slots, and the greedy choice ranks an offload by its own link
time rather than by what it delays.
"""

from __future__ import annotations

import operator
from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import fx

from graphoffload.aliasing import StorageMap, written_args
from graphoffload.calibration import Calibration
from graphoffload.graph import InputSpec, TrainGraph, fill_missing_meta, placeholder_name, tensor_vals
from graphoffload.memory import analyze_memory, format_bytes
from graphoffload.ops.host_transfer import assign_streams
from graphoffload.passes.offload_cost_model import estimate_seconds
from graphoffload.passes.offload_planner import Event, Prediction

aten = torch.ops.aten
ops = torch.ops.graphoffload

# longest chain of nodes a recompute replays (past that, offloading or keeping is the choice)
MAX_RECOMPUTE_NODES = 6
_PASS = "offload_optimizer"


@dataclass(frozen=True)
class SavedActivation:
    """A forward value backward reads, and what keeping it off the device would take."""

    name: str                  # the node backward reads it from
    nbytes: int                # its storage, in the allocator's blocks
    last_forward: int          # position of its last access before backward
    first_backward: int        # position of its first reader in backward
    recompute: tuple[str, ...] | None    # the forward nodes to replay, in order; None: not recomputable
    recompute_seconds: float
    prefetch_at: int           # position before which its prefetch lands in time (within backward)
    offload_seconds: float     # its bytes over the link, out and back


@dataclass(frozen=True)
class ActivationPlan:
    """What the planner chose: the rewritten graph, the peaks, each activation's choice."""

    graph: TrainGraph
    keep_peak: int
    peak: int
    peak_node: str
    choices: dict[str, str]    # every saved activation considered -> "keep" | "recompute" | "offload"


def _is_random(node: fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _replayable(node: fx.Node) -> bool:
    """An ATen op whose result depends on its arguments only (random ops: on the generator's
    state too, which the recompute replays); graphoffload's ops (the generator's state, the
    transfers) and collectives are never replayed."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten"


# the generator's states a replayed random op reads: host values, not the device's activations
_NOT_ACTIVATIONS = (ops.rng_state.default, ops.swap_rng_state.default)


def _storage_bytes(val: torch.Tensor) -> int:
    n = val.untyped_storage().nbytes()
    return -(-n // 512) * 512


def _whole_storage(val: object) -> bool:
    return (isinstance(val, torch.Tensor) and val.is_contiguous() and val.storage_offset() == 0
            and val.untyped_storage().nbytes() == val.numel() * val.element_size()
            and all(isinstance(s, int) for s in val.shape))


class _Step:
    """The graph's storages, where backward begins, and what is available where."""

    def __init__(self, graph: TrainGraph, storages: StorageMap | None = None):
        self.storages = storages or StorageMap(graph.graph)
        self.position = self.storages.position
        backward = [self.position[n] for n in self.storages.nodes if n.meta.get("phase") == "backward"]
        self.backward_start = min(backward) if backward else None

    def available(self, node: fx.Node, at: int) -> bool:
        """Whether `node`'s value is on the device, unchanged, at position `at` anyway."""
        if node.op == "get_attr":
            return True
        sids = self.storages.of(node)
        if not sids or node.meta.get("val") is None:
            return False
        here = self.position[node]
        for sid in sids:
            accesses = self.storages.accesses[sid]
            if any(a.writes and here < a.position < at for a in accesses):
                return False
            if node.op != "placeholder" and sid not in self.storages.output_reads and \
                    max(a.position for a in accesses) < at:
                return False
        return True

    def recompute_chain(self, sid: int, value: fx.Node, at: int) -> list[fx.Node] | None:
        """The forward nodes that make `value` again at `at` from available values, in graph order."""
        chain: list[fx.Node] = []

        def storage_chain(s: int) -> list[fx.Node] | None:
            accesses = self.storages.accesses[s]
            creator = self.storages.creator[s]
            if creator.op != "call_function" or len(tensor_vals(creator)) != 1:
                return None
            writers = [a.node for a in accesses if a.writes]
            if writers[0] is not creator or any(self.position[w] >= self.backward_start for w in writers):
                return None
            for w in writers:   # ATen ops only, writing nothing but this storage: replaying them is pure
                if not _replayable(w) or any(o not in (s,) for a in written_args(w) for o in self.storages.of(a)):
                    return None
            return writers

        def expand(node: fx.Node) -> bool:
            """Add the nodes that make `node`'s storage, and what they need, to the chain."""
            sids = self.storages.of(node)
            if node.op != "call_function" or len(sids) != 1:
                return False
            if node.target is operator.getitem:   # one output of a multi-output op (a layer norm's)
                source = node.args[0]
                writers = [a.node for a in self.storages.accesses[sids[0]] if a.writes]
                if not _replayable(source) or writers != [source] or written_args(source):
                    return False
                nodes = [source, node]
            elif not _replayable(node):
                return False
            elif self.storages.creator[sids[0]] is not node and not written_args(node):
                nodes = [node]   # a view: replayed on its input, made again first if need be
            else:
                nodes = storage_chain(sids[0])
            if nodes is None or nodes[-1] is not node:
                return False
            chain.extend(n for n in nodes if n not in chain)
            if len(chain) > MAX_RECOMPUTE_NODES:
                return False
            for n in nodes:
                for i in n.all_input_nodes:
                    if i in chain or (n.target is aten.empty_like.default and i is n.args[0]):
                        continue   # empty_like only needs the shape: replayed as empty_strided
                    # what is on the device at `at` only because of the value being moved is not
                    if (sid in self.storages.of(i) or not self.available(i, at)) and not expand(i):
                        return False
            return True

        if not expand(value):
            return None
        chain.sort(key=self.position.__getitem__)
        # one saved generator state replays the chain's draws only when no other random op drew
        # between its first and its last random op in forward
        random = [self.position[n] for n in chain if _is_random(n)]
        if random and any(_is_random(n) and n not in chain
                          for n in self.storages.nodes[random[0]:random[-1] + 1]):
            return None
        return chain

    def saved(self, cal: Calibration, seconds: dict[fx.Node, float]) -> list[SavedActivation]:
        """Every activation that could leave the device between forward and backward."""
        if self.backward_start is None:
            return []
        st, found = self.storages, []
        for sid, creator in enumerate(st.creator):
            if creator.op != "call_function" or creator.meta.get("phase") != "forward" or sid in st.output_reads \
                    or creator.target in _NOT_ACTIVATIONS:
                continue
            accesses = st.accesses[sid]
            forward = [a for a in accesses if a.position < self.backward_start]
            later = [a for a in accesses if a.position >= self.backward_start]
            if not later or any(a.writes or a.node.meta.get("phase") != "backward" for a in later):
                continue
            read_as = {i for a in later for i in a.node.all_input_nodes if sid in st.of(i)}
            if len(read_as) != 1:
                continue
            value = next(iter(read_as))
            if self.position[value] >= self.backward_start or not _whole_storage(value.meta.get("val")) \
                    or len(st.of(value)) != 1:
                continue
            nbytes = _storage_bytes(value.meta["val"])
            first = later[0].position
            chain = self.recompute_chain(sid, value, first) if _replayable(creator) else None
            # the prefetch is issued as far ahead of the reader as the copy takes, within backward
            h2d = nbytes / cal.h2d_bytes_per_s
            prefetch_at, ahead = first, 0.0
            while prefetch_at > self.backward_start and ahead < h2d:
                prefetch_at -= 1
                ahead += seconds.get(st.nodes[prefetch_at], 0.0)
            found.append(SavedActivation(
                value.name, nbytes, max(a.position for a in forward), first,
                None if chain is None else tuple(n.name for n in chain),
                sum(seconds.get(n, 0.0) for n in chain or ()), prefetch_at,
                nbytes / cal.d2h_bytes_per_s + h2d))
        return found


def largest_saved_bytes(graph: TrainGraph) -> int:
    """The largest activation the planner might copy to the host (the copy that record_stream
    may hold past its last reader on a GPU)."""
    step = _Step(graph)
    unit = Calibration(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    return max((s.nbytes for s in step.saved(unit, {})), default=0)


@dataclass
class _Edit:
    """What one choice added to the graph, so a choice that does not lower the peak is undone
    in place (copying the graph per trial made planning a deep model's step take minutes)."""

    created: list[fx.Node]
    rewired: list[tuple[fx.Node, fx.Node, fx.Node]]    # (reader, value it read, value it reads now)
    host_input: bool = False

    def undo(self, graph: TrainGraph, specs: list[InputSpec]) -> None:
        for reader, old, new in self.rewired:
            reader.replace_input_with(new, old)
        for node in reversed(self.created):
            graph.graph.erase_node(node)
        if self.host_input:
            specs.pop()


def _offload(graph: TrainGraph, specs: list[InputSpec], act: SavedActivation, prefetch_at: int,
             device: torch.device) -> _Edit:
    g = graph.graph
    nodes = [n for n in g.nodes if n.op != "output"]
    value = next(n for n in nodes if n.name == act.name)
    val = value.meta["val"]
    host = graph.add_host_input(specs, InputSpec(
        "host_scratch", placeholder_name("h_activation", act.name),
        (act.name, f"activation {tuple(val.shape)} {val.dtype}"), True, True), val.shape, val.dtype, act.name)
    host.meta["param"] = ()
    readers = [u for u in value.users if u.meta.get("phase") == "backward"]
    meta = {"phase": "transfer", "activation": act.name}
    with g.inserting_after(nodes[act.last_forward]):
        ticket = g.call_function(ops.copy_to_host.default, ([value], [host]))
    with g.inserting_before(nodes[prefetch_at]):
        fetched = g.call_function(ops.prefetch_to_device.default, ([host], device, [ticket]))
        restored = g.call_function(operator.getitem, (fetched, 0))
        landed = g.call_function(operator.getitem, (fetched, 1))
    with g.inserting_before(nodes[act.first_backward]):
        waited = g.call_function(ops.wait_device.default, (landed, [restored]))
    for node in (ticket, fetched, restored, landed, waited):
        node.meta.update(meta)
    for reader in readers:
        reader.replace_input_with(value, restored)
    assign_streams(g)
    return _Edit([host, ticket, fetched, restored, landed, waited], [(r, value, restored) for r in readers], True)


def _recompute(graph: TrainGraph, act: SavedActivation) -> _Edit:
    g = graph.graph
    nodes = [n for n in g.nodes if n.op != "output"]
    by_name = {n.name: n for n in nodes}
    chain = [by_name[name] for name in act.recompute]
    value = by_name[act.name]
    before = nodes[act.first_backward]
    region = f"activations ({act.name})"
    copies: dict[fx.Node, fx.Node] = {}
    created: list[fx.Node] = []
    random = [n for n in chain if _is_random(n)]
    if random:
        device = tensor_vals(random[0])[0].device
        with g.inserting_before(random[0]):
            state = g.call_function(ops.rng_state.default, (device,))
        state.meta.update({"phase": "forward", "stack_trace": random[0].meta.get("stack_trace")})
        with g.inserting_before(before):
            swapped = g.call_function(ops.swap_rng_state.default, (state, device))
        created += [state, swapped]
    with g.inserting_before(before):
        for node in chain:
            if node.target is aten.empty_like.default:
                val = node.meta["val"]
                copy = g.call_function(aten.empty_strided.default, (list(val.shape), list(val.stride())),
                                       {"dtype": val.dtype, "layout": val.layout, "device": val.device})
            else:
                copy = g.node_copy(node, lambda n: copies.get(n, n))
            copy.meta = {key: node.meta[key] for key in ("val", "stack_trace") if key in node.meta}
            copies[node] = copy
            created.append(copy)
        if random:
            created.append(g.call_function(ops.swap_rng_state.default, (swapped, device)))
    for node in created:
        if node.meta.get("phase") != "forward":
            node.meta.update({"phase": "backward", "recompute": region})
    for node, copy in copies.items():
        copy.meta["recompute_of"] = node.name
    readers = [u for u in value.users if u.meta.get("phase") == "backward" and u not in created]
    for reader in readers:
        reader.replace_input_with(value, copies[value])
    return _Edit(created, [(r, value, copies[value]) for r in readers])


def plan_activations(graph: TrainGraph, budget: int, cal: Calibration, device: torch.device) -> ActivationPlan:
    """Keep, recompute or offload saved activations until the predicted peak fits `budget`
    (or nothing live at the peak is left to move); the caller checks the result against it."""
    profile = analyze_memory(graph)
    keep_peak = profile.peak
    choices: dict[str, str] = {}
    specs = list(graph.signature.inputs)
    tried: set[tuple[str, str]] = set()
    storages = None
    seconds: dict[fx.Node, float] = {}
    while profile.peak > budget:
        step = _Step(graph, storages)
        for n in step.storages.nodes:   # the graph is edited in place: its nodes' times stay valid
            if n not in seconds:
                seconds[n] = estimate_seconds(n, cal)
        saved = step.saved(cal, seconds)
        for act in saved:
            choices.setdefault(act.name, "keep")
        at = profile.nodes.index(profile.peak_node)
        options = []   # (bytes per second of added cost, how, activation, prefetch position, seconds, stall)
        for act in saved:
            if not act.last_forward < at < act.first_backward:
                continue   # not live at the peak: moving it would not lower it
            if act.recompute is not None:
                options.append((act.nbytes / max(act.recompute_seconds, 1e-12), "recompute", act, None,
                                act.recompute_seconds, 0.0))
            # prefetched as early as the copy takes, but after the peak: when backward's compute
            # from there to the reader is shorter than the copy, the difference is a stall
            prefetch_at = max(act.prefetch_at, at + 1)
            hidden = sum(seconds[n] for n in step.storages.nodes[prefetch_at:act.first_backward])
            stall = max(0.0, act.nbytes / cal.h2d_bytes_per_s - hidden)
            cost = act.offload_seconds + stall
            options.append((act.nbytes / max(cost, 1e-12), "offload", act, prefetch_at, cost, stall))
        options = [o for o in options if (o[2].name, o[1], o[3]) not in tried]
        options.sort(key=lambda o: -o[0])
        for _, how, act, prefetch_at, cost, stall in options:
            tried.add((act.name, how, prefetch_at))
            edit = _recompute(graph, act) if how == "recompute" else _offload(graph, specs, act, prefetch_at, device)
            graph = graph.with_signature(inputs=tuple(specs))   # new host inputs are not device memory
            fill_missing_meta(graph, _PASS)
            storages = StorageMap(graph.graph)
            after = analyze_memory(graph, storages)
            if not (after.peak <= profile.peak and after.live_at(profile.peak_node) < profile.peak):
                edit.undo(graph, specs)
                graph = graph.with_signature(inputs=tuple(specs))
                storages = None
            else:
                profile = after
                choices[act.name] = how
                graph.note(_PASS, f"activation {act.name} ({format_bytes(act.nbytes)}): {how}"
                           + (f" ({len(act.recompute)} nodes, {cost * 1e6:.3g} us)" if how == "recompute"
                              else f" ({act.offload_seconds * 1e6:.3g} us over the link"
                              + (f", {stall * 1e6:.3g} us stall before its reader" if stall else "") + ")")
                           + f"; predicted peak {format_bytes(after.peak)}", "activation",
                           activation=act.name, choice=how, bytes=act.nbytes, seconds=cost, stall_seconds=stall,
                           recomputed=act.recompute if how == "recompute" else (), peak_after=after.peak)
                break
        else:
            break
    counts = {c: sum(1 for v in choices.values() if v == c) for c in ("keep", "recompute", "offload")}
    graph.note(_PASS, f"activations: {counts['keep']} kept, {counts['recompute']} recomputed, "
               f"{counts['offload']} offloaded; predicted peak {format_bytes(keep_peak)} -> "
               f"{format_bytes(profile.peak)} (budget {format_bytes(budget)})", "activations",
               keep_peak_bytes=keep_peak, peak_bytes=profile.peak, budget_bytes=budget, choices=dict(choices),
               **counts)
    return ActivationPlan(graph, keep_peak, profile.peak, profile.peak_node, choices)


def _first_gap(busy: list[tuple[float, float]], start: float, seconds: float) -> float:
    """The earliest time from `start` at which `seconds` fit between the busy spans of a link."""
    for b0, b1 in busy:
        if b1 <= start:
            continue
        if start + seconds <= b0:
            break
        start = b1
    return start


def place_on_schedule(graph: TrainGraph, schedule: Prediction, planned: Sequence[str],
                      cal: Calibration) -> tuple[Prediction, dict[str, float]]:
    """The optimizer-state plan's predicted timeline with the activation plan added: each
    activation copy takes the first gap its link (d2h out, h2d back) leaves between the state's
    transfers from the node that issues it on; a copy back that lands after its reader starts
    stalls the compute stream, and recomputed nodes run on it, both pushing what follows back.
    The state's transfers keep their slots (the bucket plan is made first, not jointly).
    `planned`: the names of the nodes the schedule's `node_start` is indexed by."""
    start_of = dict(zip(planned, schedule.node_start))
    links: dict[str, list[tuple[float, float]]] = {"d2h": [], "h2d": []}   # busy spans, sorted
    for e in schedule.events:
        if e.track in links:
            insort(links[e.track], (e.start, e.end))
    events, delay, now = [], 0.0, 0.0
    totals = {"recompute_seconds": 0.0, "stall_seconds": 0.0, "link_seconds": 0.0}
    issued: dict[str, float] = {}
    for node in graph.graph.nodes:
        if node.name in start_of:
            now = start_of[node.name] + delay
        name = node.meta.get("activation")
        if "recompute" in node.meta and str(node.meta["recompute"]).startswith("activations"):
            seconds = estimate_seconds(node, cal)
            delay, now = delay + seconds, now + seconds
            totals["recompute_seconds"] += seconds
        elif name and node.target in (ops.copy_to_host.default, ops.prefetch_to_device.default):
            track = "d2h" if node.target is ops.copy_to_host.default else "h2d"
            nbytes = sum(t.meta["val"].numel() * t.meta["val"].element_size() for t in node.args[0])
            seconds = nbytes / (cal.d2h_bytes_per_s if track == "d2h" else cal.h2d_bytes_per_s)
            begin = _first_gap(links[track], max(now, issued.get(name, 0.0)), seconds)
            insort(links[track], (begin, begin + seconds))
            events.append(Event(track, f"activation {name} {'out' if track == 'd2h' else 'back'}", begin,
                                begin + seconds))
            issued[name] = begin + seconds
            totals["link_seconds"] += seconds
        elif name and node.target is ops.wait_device.default and issued.get(name, 0.0) > now:
            stall = issued[name] - now
            delay, now = delay + stall, now + stall
            totals["stall_seconds"] += stall
    return replace(schedule, step_seconds=schedule.step_seconds + delay,
                   events=[*schedule.events, *events]), totals
