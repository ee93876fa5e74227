"""Activations under the offload budget: keep, recompute or offload each saved activation.

With `Offload(gpu_memory_budget=..., activations="auto")` the optimizer state is planned first
(offload_optimizer's buckets), then, while the predicted device peak (graphoffload.memory's
liveness analysis of the offloaded graph, prefetched state buffers included) is over the
budget, this module frees saved activations at the peak: forward values that backward reads.
Each one can

- stay on the device (keep, today's behaviour);
- be recomputed in backward: a region of forward ATen ops (views, one output of a multi-output
  op such as a layer norm or `split`, and graphoffload's attention forward, which is
  deterministic, included) is replayed once, right before the first backward reader of the
  activation it was grown from, out of values that are on the device then anyway and unchanged
  since forward. A region starts as the shortest such chain and grows one forward value at a
  time through the saved activations it stopped at, up to `MAX_REGION_NODES` (a transformer
  block's, from the block's input: what checkpointing the block does); it frees every saved
  tensor whose backward readers all read it through the region. The duplicated nodes carry
  `meta["recompute"]`, and a region that draws random numbers (dropout's `bernoulli_`) replays
  the forward's draws with the generator state saved before them (`graphoffload.rng_state` /
  `swap_rng_state`, as activation checkpointing does), so results stay bit-identical;
- be copied to pinned host memory right after its last forward read (`copy_to_host`) and
  brought back (`prefetch_to_device`, waiting for the copy out in stream order) before its first
  backward reader (`wait_device` right before the reader), issued where the link, as the copies
  chosen so far and the state's transfers leave it, lands it in time if it can.

The choice is greedy: among the choices that free memory live at the current peak, the one that
frees the most bytes per second of added step time goes first (recompute: the replayed nodes'
compute time from the calibration's roofline; offload: the stall its copy back adds, what
backward's compute does not hide, so a copy that hides goes first), and every choice is checked
on the memory analysis of the rewritten graph. A region that replays nodes some chosen region
already replays extends it: the chosen ones are undone and the union is replayed once, before
the first backward reader of any of them, costed by its new nodes' time alone, so once a
block's short replays are chosen, growing them to the block's input is the cheap choice it is
(what checkpointing the block does). When nothing live at the peak can move any more, the peak
reached is the least this plan can do; since merged replays keep what they remake live longer
in backward, the plan without merging is then made too, the lower peak kept, and the pass
fails with it if it is still over the budget. An offload's stall is estimated alone: a copy
back issued ahead of earlier ones on the link delays them, which its ranking does not see.

Why a second plan, whole blocks replayed first: the greedy's one-at-a-time ranking is blind to
what a batch of choices costs together (offloads that each hide stall together on the one link)
and it reaches a block's replay only by merging short ones, so at tight budgets on a 24-block
GPT it lost to the trivial policy of checkpointing every block. Rather than a joint search, the
planner also makes checkpointing's plan and lets the timeline judge: `forward_blocks` finds the
forward's repeated units from the graph alone (a cut is a value that, once made, is the only
forward value later forward nodes read: the residual stream between sublayers; the longest run
of cut-to-cut intervals repeating with the shortest period gives the blocks), each block's
replay is what backward reads of the storages it makes, remade from its input (its output,
the next block's input, stays), replayed once before the first of those readers, random ops
replayed. Blocks are replayed, most bytes live at the peak per second of their compute first,
until the budget is met; the greedy continues from there if it is not.

How a plan is judged: the step the compile reports, predicted the way a checkpointed model's
is. A checkpointed model's recompute is in the graph the state planner times (offload_planner's
StepModel): it delays the gradients that become final after it, and with them the copies and
CPU updates, and lengthens the step only where it is on the critical path; where the step is
bound by the CPU updates or the link, replays hide. Charging a plan's replays in full on top of
the state plan's step (what this module did first) is not that prediction, so a plan and
checkpointing could not be compared. So each finished plan is re-timed by the same
model (`retime`: the state plan's costs with the replayed nodes on the compute stream at their
forward originals' times, the buckets' ready and prefetch points moved with their nodes), its
copies then placed in the links' gaps and late copies back added as stalls (`_simulate`), and
the plan with the shortest such step is kept (the lower peak on a tie, then the greedy's).
Re-timing a plan is one simulation of the buckets, cheap next to planning, so it is done for
the finished plans rather than for every choice: choices are still ranked by what they add in
full, a local measure that stays monotone while a plan grows. The greedy, made second, stops
once the compute floor (every node's compute and device-path update, back to back) plus what it
adds passes the step of the block plan that fits: a re-timed step is at least that, and what a
plan adds only grows with each choice (a replay adds its compute and can hide a stall by at most
that; a copy only delays the others).

The bucket plan is made first, against the memory and compute of the step with every
activation kept, and keeps its slots while the activations are planned: the link is shared on
one timeline (each activation copy in the gaps the state's transfers leave), not jointly planned.
A checkpointed model's bucket plan, though, is made with its recompute in it, which can favour
CPU-path updates (the replays fill the compute time device-path updates and their prefetches
want) and earlier prefetches (the memory the replays free). offload_optimizer therefore plans
the buckets again on the re-timed costs and memory of the chosen plan, and when that is
predicted faster runs again with those paths and prefetch points, planning the activations
anew against them (`retimed_costs`; offload_optimizer._replan_with_activations). On the
benchmark GPT at 24 GiB that re-plan is what matters: re-timing the plan on the first bucket
plan (made under the budget with every activation kept, so its prefetches start late and its
compute is the critical path) hid 2.5 ms of 67 ms of replays; the bucket plan made again with
them hides most (benchmarks/RESULTS.md). The memory is
shared exactly: every plan is checked against the same liveness analysis, the prefetched
optimizer state included.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from bisect import bisect_left, bisect_right, insort
from heapq import heappop, heappush
from itertools import repeat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import fx

from graphoffload.aliasing import StorageCache, StorageMap
from graphoffload.calibration import Calibration
from graphoffload.graph import InputSpec, TrainGraph, fill_missing_meta, placeholder_name, tensor_vals
from graphoffload.memory import MemoryProfile, analyze_memory, block_bytes, format_bytes
from graphoffload.ops.host_transfer import assign_streams, stream_of
from graphoffload.ops.rng import draws_random_numbers
from graphoffload.passes import offload_activation_gathers
from graphoffload.passes.offload_cost_model import estimate_seconds
from graphoffload.passes.offload_planner import Event, Prediction, StepCosts, StepModel

aten = torch.ops.aten
ops = torch.ops.graphoffload

# most nodes a recompute region replays: room for a transformer block's forward from its input,
# views included (past that, offloading or keeping is the choice)
MAX_REGION_NODES = 96
_PASS = "offload_optimizer"
# a plan still searching after this many seconds logs how far it has got, and again each as long:
# at 24 layers one plan searches for seconds, so a compile shows it is not hung
PROGRESS_S = 5.0

log = logging.getLogger("graphoffload")
_position = operator.itemgetter(0)   # an aliasing.Access's position


@dataclass(frozen=True)
class SavedActivation:
    """A forward value backward reads, and what keeping it off the device would take."""

    name: str                  # the node backward reads it from
    nbytes: int                # its storage, in the allocator's blocks
    last_forward: int          # position of its last access before backward
    first_backward: int        # position of its first reader in backward
    prefetch_at: int           # position before which its prefetch lands in time (within backward)
    offload_seconds: float     # its bytes over the link, out and back


@dataclass(frozen=True)
class Region:
    """Forward nodes replayed in backward right before position `at` (the first backward reader
    of the activation it was grown from), and what that frees on the device: the saved
    activations whose backward readers all come at or after `at` and read the replay instead."""

    seed: str                  # the saved activation the region was grown from
    nodes: tuple[str, ...]     # the forward nodes replayed, in graph order
    at: int
    rewired: tuple[str, ...]   # replayed nodes whose backward readers read the replay instead
    freed: tuple[tuple[int, int, int, int], ...]   # (storage, bytes, last forward access, first backward access)
    seconds: float             # the replay's compute time
    # stage 3: backward gathers the replay needs earlier, each (bytes, from, until): live from
    # the replay on instead of from their wait (offload_activation_gathers)
    held: tuple[tuple[int, int, int], ...] = ()

    def bytes_live_at(self, position: int) -> int:
        freed = sum(n for _, n, last, first in self.freed if last < position < first)
        return max(0, freed - sum(n for n, start, until in self.held if start <= position < until))

    @cached_property
    def nbytes(self) -> int:
        """Every freed storage's bytes (asked for each time its seed is ranked again)."""
        return sum(n for _, n, _, _ in self.freed)


@dataclass(frozen=True)
class ActivationPlan:
    """What the planner chose: the rewritten graph, the peaks, each activation's choice."""

    graph: TrainGraph
    keep_peak: int
    peak: int
    peak_node: str
    choices: dict[str, str]    # every saved activation considered -> "keep" | "recompute" | "offload"
    merged: int = 0            # chosen recomputes that extended earlier replays (merged with them)
    added_seconds: float = 0.0  # what the plan adds to the predicted step (recompute, stalls)
    strategy: str = "greedy"   # which search made it (plan_activations tries several)
    abandoned: bool = False    # cut short: it could not beat another plan that fits
    blocks: int = 0            # whole blocks replayed
    # the other plans that fit the budget (plan_activations): offload_optimizer plans the buckets
    # again on each, so one that frees more than the budget needs can buy a faster bucket plan
    others: tuple[ActivationPlan, ...] = ()


def _replayable(node: fx.Node) -> bool:
    """An ATen op whose result depends on its arguments only (random ops: on the generator's
    state too, which the recompute replays), or graphoffload's attention forward (deterministic:
    the same inputs give the same bits); graphoffload's other ops (the generator's state, the
    transfers) and collectives are never replayed."""
    return node.target is ops.attention.default or \
        (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten")


# the generator's states a replayed random op reads: host values, not the device's activations
_NOT_ACTIVATIONS = (ops.rng_state.default, ops.swap_rng_state.default)


def _forward_value(node: fx.Node) -> bool:
    """A value forward computes on the device (the generator's states are host values)."""
    return node.op == "call_function" and node.meta.get("phase") == "forward" and node.target not in _NOT_ACTIVATIONS


def _whole_storage(val: object) -> bool:
    return (isinstance(val, torch.Tensor) and val.is_contiguous() and val.storage_offset() == 0
            and val.untyped_storage().nbytes() == val.numel() * val.element_size()
            and all(isinstance(s, int) for s in val.shape))


class _Step:
    """The graph's storages, where backward begins, and what is available where."""

    def __init__(self, graph: TrainGraph, storages: StorageMap | None = None, regather: bool = True):
        self.storages = storages or StorageMap(graph.graph)
        self.regather = regather   # stage 3: replays may read a parameter's backward copy
        self.position = self.storages.position
        self.nodes = self.storages.nodes
        # the first backward node's position (nodes are in position order)
        self.backward_start = next((i for i, n in enumerate(self.nodes) if n.meta.get("phase") == "backward"), None)
        self._storage_facts: dict[int, tuple[int, int, frozenset] | None] = {}
        self._of: dict[fx.Node, list[int]] = {}
        self._names: dict[str, fx.Node] | None = None
        self._drawing: dict[fx.Node, bool] = {}   # draws_random_numbers per node: every chain asks
        self._bytes: dict[fx.Node, int | None] = {}
        self._backward_read: dict[fx.Node, bool] = {}
        self._regathered: dict[fx.Node, fx.Node] | None = None
        self._backward_reads: list[tuple[int, list]] | None = None

    def regathered(self, node: fx.Node) -> bool:
        """Whether `node` is a stage 3 parameter's forward copy that a replay reads as its
        backward copy instead (offload_activation_gathers: gathered again for backward, the
        gather moved ahead of the replay if need be)."""
        if self._regathered is None:
            self._regathered = offload_activation_gathers.backward_copies(self.nodes) if self.regather else {}
        return node in self._regathered

    def available(self, node: fx.Node, at: int) -> bool:
        """Whether `node`'s value is on the device, unchanged, at position `at` anyway."""
        if node.op == "get_attr":
            return True
        sids = self.of(node)
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

    def _grow(self, sid: int, seeds: list[fx.Node], at: int) -> Iterator[list[fx.Node]]:
        """Ever longer chains of forward nodes that make `seeds` (the nodes backward reads storage
        `sid` through) again at position `at`, each in graph order: first from values on the
        device then anyway (the shortest), then each time also remaking the latest forward value
        the chain stopped at, so that a chain grows through the saved activations it passes (a
        transformer block's, from the block's input: what checkpointing the block does), up to
        MAX_REGION_NODES nodes."""
        chain: list[fx.Node] = []
        in_chain: set[fx.Node] = set()
        stops: dict[fx.Node, None] = {}   # inputs the chain reads as they are
        horizon = [len(self.nodes)]       # forward values made at or after this are remade

        def storage_chain(s: int) -> list[fx.Node] | None:
            accesses = self.storages.accesses[s]
            creator = self.storages.creator[s]
            if creator.op != "call_function" or len(tensor_vals(creator)) != 1:
                return None
            writers = [a.node for a in accesses if a.writes]
            if writers[0] is not creator or any(self.position[w] >= self.backward_start for w in writers):
                return None
            for w in writers:   # writing nothing but this storage: replaying them is pure
                if not _replayable(w) or any(o not in (s,) for a in self.written(w) for o in self.of(a)):
                    return None
            return writers

        def remade(i: fx.Node) -> bool:
            if sid in self.of(i):
                return True   # what is on the device at `at` only because of the value being moved is not
            if not self.available(i, at):
                return not self.regathered(i)   # (a stage 3 parameter: read from its backward copy)
            return self.position[i] >= horizon[0] and _forward_value(i)

        def expand(node: fx.Node) -> bool:
            """Add the nodes that make `node`'s storage, and what they need, to the chain."""
            sids = self.of(node)
            if node.op != "call_function" or len(sids) != 1:
                return False
            if node.target is operator.getitem:   # one output of a multi-output op (a layer norm's, attention's)
                source = node.args[0]
                writers = [a.node for a in self.storages.accesses[sids[0]] if a.writes]
                if not _replayable(source) or self.written(source):
                    return False
                if writers != [source]:   # a view among a list of them (split's): on its input
                    if self.storages.creator[sids[0]] is source or not self.of(source):
                        return False
                nodes = [source, node]
            elif not _replayable(node):
                return False
            elif self.storages.creator[sids[0]] is not node and not self.written(node):
                nodes = [node]   # a view: replayed on its input, made again first if need be
            else:
                nodes = storage_chain(sids[0])
            if nodes is None or nodes[-1] is not node:
                return False
            for n in nodes:
                if n not in in_chain:
                    chain.append(n)
                    in_chain.add(n)
            if len(chain) > MAX_REGION_NODES:
                return False
            for n in nodes:
                for i in n.all_input_nodes:
                    if i in in_chain or (n.target is aten.empty_like.default and i is n.args[0]):
                        continue   # empty_like only needs the shape: replayed as empty_strided
                    if not remade(i):
                        stops[i] = None
                    elif not expand(i):
                        return False
            return True

        if not all(expand(v) for v in seeds):
            return
        while True:
            yield sorted(chain, key=self.position.__getitem__)
            further = [i for i in stops if i not in in_chain and _forward_value(i)]
            if not further:
                return
            latest = max(further, key=self.position.__getitem__)
            horizon[0] = self.position[latest]
            if not expand(latest):
                return

    def _draws_replayable(self, chain: list[fx.Node]) -> bool:
        """One saved generator state replays the chain's draws only when no other random op drew
        between its first and its last random op in forward."""
        random = [self.position[n] for n in chain if self._draws(n)]
        if not random:
            return True
        members = set(chain)
        return not any(self._draws(n) and n not in members for n in self.nodes[random[0]:random[-1] + 1])

    def _draws(self, node: fx.Node) -> bool:
        try:
            return self._drawing[node]
        except KeyError:
            found = self._drawing[node] = draws_random_numbers(node)
            return found

    def _facts(self, s: int) -> tuple[int, int, frozenset] | None:
        """What freeing storage `s` by a replay needs, whatever the chain (cached: every chain
        grown on this step asks again): its first backward access, the latest backward access
        a replay may come at, its last forward access, and the forward nodes (aliases of it)
        backward reads it through; None if backward writes it or reads it outside backward."""
        try:
            return self._storage_facts[s]
        except KeyError:
            pass
        st, facts = self.storages, None
        accesses = st.accesses[s]
        later = self._later(accesses)
        if later and s not in st.output_reads and not any(a.writes or a.node.meta.get("phase") != "backward"
                                                          for a in later):
            # a reader of an alias backward made (a detach) reads it through the alias's own access
            through = frozenset(i for a in later for i in a.node.all_input_nodes
                                if i.meta.get("phase") != "backward" and s in self.of(i))
            facts = (later[0].position, max(a.position for a in accesses if a.position < self.backward_start),
                     through)
        self._storage_facts[s] = facts
        return facts

    def _value_bytes(self, node: fx.Node) -> int | None:
        """The allocator's bytes of `node`'s value if it is a tensor (cached: the chains grown on
        one step share most of their nodes, and each asks again)."""
        try:
            return self._bytes[node]
        except KeyError:
            val = node.meta.get("val")
            found = self._bytes[node] = block_bytes(val) if isinstance(val, torch.Tensor) else None
            return found

    def _read_in_backward(self, node: fx.Node) -> bool:
        """Whether a backward node reads `node` (cached as _value_bytes; the step is not edited
        while this _Step describes it)."""
        try:
            return self._backward_read[node]
        except KeyError:
            found = self._backward_read[node] = any(u.meta.get("phase") == "backward" for u in node.users)
            return found

    def written(self, node: fx.Node) -> list[fx.Node]:
        """The argument nodes `node` writes into (aliasing.written_args, read off the map)."""
        return self.storages.written_by(node)

    def of(self, node: fx.Node) -> list[int]:
        try:
            return self._of[node]
        except KeyError:
            found = self._of[node] = self.storages.of(node)
            return found

    def _region(self, seed: fx.Node, chain: list[fx.Node], at: int, seconds: dict[fx.Node, float]) -> Region | None:
        """What replaying `chain` right before `at` frees: every storage it makes whose backward
        readers all come at or after `at` and read it through the chain's nodes alone."""
        return _Freed(self, at).region(seed, chain, seconds)

    def _held(self, chain: list[fx.Node], at: int) -> tuple[tuple[int, int, int], ...]:
        """The backward gathers a replay of `chain` at `at` moves ahead of their waits (a stage 3
        parameter read from its backward copy): each buffer's bytes, live from `at` to its wait."""
        if self._regathered is None:
            self.regathered(chain[0])
        if not self._regathered:
            return ()
        waits = {offload_activation_gathers.wait_of(self._regathered[i]) for n in chain
                 for i in n.all_input_nodes if i in self._regathered}
        return tuple(sorted((block_bytes(w.meta["val"]), at, self.position[w]) for w in waits
                            if self.position[w] > at))

    def _later(self, accesses: list) -> list:
        """The accesses at or after backward's start (a storage's accesses are in position order)."""
        return accesses[bisect_left(accesses, self.backward_start, key=_position):]

    def _read_by_backward(self) -> list[tuple[int, list]]:
        """Each storage a forward value made that backward reads (and nothing else touches after
        forward, the step's outputs included), with its accesses from backward's start, in
        storage order: what both seeds and saved start from (made once per step)."""
        if self._backward_reads is None:
            st, found = self.storages, []
            later_of, output_reads, accesses = self._later, st.output_reads, st.accesses
            for sid, creator in enumerate(st.creator):
                if not _forward_value(creator) or sid in output_reads:
                    continue
                later = later_of(accesses[sid])
                if not later or any(a.writes or a.node.meta.get("phase") != "backward" for a in later):
                    continue
                found.append((sid, later))
            self._backward_reads = found
        return self._backward_reads

    def seeds(self) -> dict[str, int]:
        """The saved activations a recompute may start from: the name of the node backward reads
        each through (stable while the graph is edited) -> its storage."""
        if self.backward_start is None:
            return {}
        st, found = self.storages, {}
        for sid, later in self._read_by_backward():
            seeds = [i for a in later for i in a.node.all_input_nodes
                     if sid in st.of(i) and self.position[i] < self.backward_start]
            if seeds:
                found[seeds[0].name] = sid
        return found

    def regions(self, sid: int, seconds: dict[fx.Node, float]) -> list[Region]:
        """The recomputes grown from the saved activation in storage `sid` (_grow: the shortest
        first, then the longer ones), with what each frees."""
        st = self.storages
        later = self._later(st.accesses[sid])
        seeds = list(dict.fromkeys(i for a in later for i in a.node.all_input_nodes
                                   if sid in st.of(i) and self.position[i] < self.backward_start))
        found, freed = [], _Freed(self, later[0].position)   # carried from each chain to the next, longer one
        for chain in self._grow(sid, seeds, later[0].position):
            if self._draws_replayable(chain):
                region = freed.region(seeds[0], chain, seconds)
                if region is not None:
                    found.append(region)
        return found

    def block_region(self, names: Sequence[str], seconds: dict[fx.Node, float]) -> Region | None:
        """A whole block replayed (forward_blocks' unit, named by its forward nodes): what
        backward reads of the storages the block makes, and what those are made from within the
        block, replayed once before the first backward reader of any of them, from the block's
        input and what else is on the device then; None where that cannot be replayed purely."""
        if self.backward_start is None:
            return None
        by_name = self._by_name()
        block = {by_name[n] for n in names if n in by_name}
        st, wanted, firsts = self.storages, [], []
        for node in block:
            sids = self.of(node)
            if len(sids) != 1 or st.creator[sids[0]] not in block:
                continue
            facts = self._facts(sids[0])
            if facts is not None and facts[2] <= block and all(
                    a.node in block for a in st.accesses[sids[0]] if a.position < self.backward_start):
                wanted += facts[2]   # (the block's output, which the next block reads, stays: its input)
                firsts.append(facts[0])
        if not firsts:
            return None
        at = min(firsts)
        chain: set[fx.Node] = set()
        while wanted:
            node = wanted.pop()
            if node in chain:
                continue
            if not _replayable(node) and node.target is not operator.getitem:
                return None
            chain.add(node)
            for s in self.of(node):   # every write into a storage it makes is replayed with it
                if st.creator[s] not in block:
                    continue   # a view of the block's input or a parameter: those are checked below
                for a in st.accesses[s]:
                    if a.writes and a.node not in chain:
                        if a.node not in block:
                            return None
                        wanted.append(a.node)
            for i in node.all_input_nodes:
                if i in chain or (node.target is aten.empty_like.default and i is node.args[0]):
                    continue
                if i in block:
                    wanted.append(i)
                elif not self.available(i, at) and not self.regathered(i):
                    return None
            for a in self.written(node):
                if any(st.creator[s] not in block for s in self.of(a)):
                    return None
        ordered = sorted(chain, key=self.position.__getitem__)
        if not self._draws_replayable(ordered):
            return None
        seed = min((n for n in ordered if any(u.meta.get("phase") == "backward" for u in n.users)),
                   key=self.position.__getitem__, default=ordered[0])
        return self._region(seed, ordered, at, seconds)

    def _by_name(self) -> dict[str, fx.Node]:
        if self._names is None:
            self._names = {n.name: n for n in self.nodes}
        return self._names

    def saved(self, cal: Calibration, seconds: dict[fx.Node, float]) -> list[SavedActivation]:
        """Every activation that could be copied to the host between forward and backward."""
        if self.backward_start is None:
            return []
        st, found = self.storages, []
        for sid, later in self._read_by_backward():
            accesses = st.accesses[sid]
            read_as = {i for a in later for i in a.node.all_input_nodes if sid in st.of(i)}
            if len(read_as) != 1:
                continue
            value = next(iter(read_as))
            if self.position[value] >= self.backward_start or not _whole_storage(value.meta.get("val")) \
                    or len(st.of(value)) != 1:
                continue
            nbytes = block_bytes(value.meta["val"])
            first = later[0].position
            # the prefetch is issued as far ahead of the reader as the copy takes, within backward
            h2d = nbytes / cal.h2d_bytes_per_s
            prefetch_at, ahead = first, 0.0
            while prefetch_at > self.backward_start and ahead < h2d:
                prefetch_at -= 1
                ahead += seconds.get(st.nodes[prefetch_at], 0.0)
            forward = accesses[:len(accesses) - len(later)]
            found.append(SavedActivation(value.name, nbytes, max(a.position for a in forward), first, prefetch_at,
                                         nbytes / cal.d2h_bytes_per_s + h2d))
        return found


class _Freed:
    """What replaying a chain of forward nodes right before position `at` frees, carried from a
    chain to the longer chains grown from it (_Step._grow: each adds nodes, none leaves): the
    chains grown from one seed were each worked out from scratch, a fifth of the planner's time
    on the 24-block GPT. A storage the chain makes is freed when its creator is in the chain,
    its backward readers all come at or after `at` and read it through the chain's nodes alone
    (_Step._facts), and a node of the chain holding it alone has a tensor value (its bytes). The
    first two, once true, stay true as the chain grows, and whether backward writes it or reads
    it before `at` does not depend on the chain; so each storage is decided once, and a region
    lists what is freed in the order a pass over its chain in graph order meets them."""

    def __init__(self, step: _Step, at: int):
        self.step, self.at = step, at
        self.members: set[fx.Node] = set()
        self.first: dict[int, tuple[int, int]] = {}        # storage -> (position, index) of its first holder
        self.held: dict[int, list[tuple[int, fx.Node]]] = {}   # storage -> (position, node) holding it alone
        self.pending: dict[int, tuple[int, int, frozenset]] = {}   # storages not decided yet -> their facts
        self.freeing: dict[int, tuple[int, int, frozenset]] = {}   # storages freed once held as a tensor
        # storage in `freeing` -> its entry in Region.freed (None: no tensor holds it yet) and the
        # names of its holders backward reads; dropped when a node joins its holders
        self.entries: dict[int, tuple[tuple[int, int, int, int] | None, list[str]]] = {}

    def _add(self, node: fx.Node) -> None:
        step = self.step
        self.members.add(node)
        position = step.position[node]
        sids = step.of(node)
        for j, s in enumerate(sids):
            first = self.first.get(s)
            if first is None:
                self.first[s] = (position, j)
                facts = step._facts(s)
                if facts is not None and facts[0] >= self.at:
                    self.pending[s] = facts
            elif (position, j) < first:
                self.first[s] = (position, j)
        if len(sids) == 1:
            insort(self.held.setdefault(sids[0], []), (position, node), key=operator.itemgetter(0))
            self.entries.pop(sids[0], None)

    def region(self, seed: fx.Node, chain: list[fx.Node], seconds: dict[fx.Node, float]) -> Region | None:
        """The region replaying `chain` (graph order; every chain asked before is part of it)."""
        members = self.members
        for n in chain:
            if n not in members:
                self._add(n)
        creator = self.step.storages.creator
        for s, facts in list(self.pending.items()):
            if creator[s] in members and facts[2] <= members:
                self.freeing[s] = self.pending.pop(s)
        freed, rewired, entries = [], [], self.entries
        for s in sorted(self.freeing, key=self.first.__getitem__):
            entry = entries.get(s)
            if entry is None:
                entry = entries[s] = self._entry(s)
            if entry[0] is not None:
                freed.append(entry[0])
                rewired += entry[1]
        if not freed:
            return None
        # (summed in graph order, as a pass over the chain would: a float sum depends on its order)
        return Region(seed.name, tuple(n.name for n in chain), self.at, tuple(rewired), tuple(freed),
                      sum(map(seconds.get, chain, repeat(0.0))), self.step._held(chain, self.at))

    def _entry(self, s: int) -> tuple[tuple[int, int, int, int] | None, list[str]]:
        held = [n for _, n in self.held.get(s, ())]
        # the bytes of the first of them whose value is a tensor
        nbytes = next((b for b in map(self.step._value_bytes, held) if b is not None), None)
        if nbytes is None:
            return None, []
        facts = self.freeing[s]
        return (s, nbytes, facts[1], facts[0]), [n.name for n in held if self.step._read_in_backward(n)]


def forward_blocks(graph: TrainGraph) -> tuple[tuple[str, ...], ...]:
    """The forward's repeated units, each as the names of its forward nodes in graph order: a
    transformer's blocks, found from the graph alone (it keeps no module names).

    A cut is a forward value that is, right after it is made, the only forward value a later
    forward node reads (a transformer's residual stream between its sublayers). The forward
    nodes after one cut up to the next form an interval, named by its ops; the longest run of
    intervals repeating with the shortest period gives the units, one period's intervals each
    (a GPT's attention and MLP sublayers: one block, what checkpointing the block replays).
    A batch input that several forward nodes read (a residual MLP's `x`, the first block's input
    and its residual) counts as a value from its first forward reader to its last, as a forward
    value does: else the first block, whose input is no forward value, is cut apart inside and
    does not repeat.
    A batch input read until the end (a GPT's labels) would leave no cut at all, so both ways
    are tried and the one covering more forward nodes is kept.
    Empty when nothing repeats."""
    plain, counted = _blocks(graph, False), _blocks(graph, True)
    return counted if sum(map(len, counted)) > sum(map(len, plain)) else plain


def _blocks(graph: TrainGraph, count_batch: bool) -> tuple[tuple[str, ...], ...]:
    """forward_blocks, batch inputs counted as values (`count_batch`) or not."""
    position = {n: i for i, n in enumerate(graph.graph.nodes)}
    intervals: list[list[fx.Node]] = [[]]
    closing: dict[fx.Node, int] = {}   # a forward node -> how many values it reads last in forward
    opening: dict[fx.Node, int] = {}   # a forward node -> how many batch inputs it reads first
    batch = {s.name for s in graph.signature.inputs if s.kind == "batch"} if count_batch else set()
    for node in graph.graph.nodes:
        if node.op == "placeholder" and node.name in batch:
            readers = [u for u in node.users if u.meta.get("phase") == "forward"]
            first, last = min(readers, key=position.__getitem__, default=None), \
                max(readers, key=position.__getitem__, default=None)
            if first is not last:
                opening[first] = opening.get(first, 0) + 1
                closing[last] = closing.get(last, 0) + 1
    open_values = 0
    for node in graph.graph.nodes:
        open_values += opening.pop(node, 0) - closing.pop(node, 0)
        if not _forward_value(node):
            continue
        intervals[-1].append(node)
        readers = [u for u in node.users if u.meta.get("phase") == "forward"]
        if readers:
            last = max(readers, key=position.__getitem__)
            closing[last] = closing.get(last, 0) + 1
            open_values += 1
            if open_values == 1:   # the only value the rest of forward reads: a cut
                intervals.append([])
    intervals = [i for i in intervals if i]
    kinds: dict[tuple, int] = {}
    names = [kinds.setdefault(tuple(str(n.target) for n in i), len(kinds)) for i in intervals]
    best = (0, 0, 0)   # (intervals covered by whole units, -period, -start)
    for period in range(1, len(names) // 2 + 1):
        for start in range(len(names) - 2 * period + 1):
            end = start + period
            while end < len(names) and names[end] == names[end - period]:
                end += 1
            if (end - start) // period >= 2:
                best = max(best, ((end - start) // period * period, -period, -start))
    covered, period, start = best[0], -best[1], -best[2]
    if not covered:
        return ()
    return tuple(tuple(n.name for i in intervals[s:s + period] for n in i)
                 for s in range(start, start + covered, period))



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
    regathers: bool = False    # a replay reading stage 3 backward copies (their gathers placed for it)
    # the plan's StorageCache, told which nodes the edit made and rewired, and undoing it rewires
    cache: StorageCache | None = None

    def __post_init__(self) -> None:
        if self.cache is not None:
            self.cache.touched([*self.created, *(reader for reader, _, _ in self.rewired)])

    def undo(self, graph: TrainGraph, specs: list[InputSpec], gone: set[fx.Node]) -> None:
        """`gone`: the nodes undone edits erased (a later replay may have rewired one of an
        earlier replay's nodes, which a merge then erased), added to."""
        for reader, old, new in self.rewired:
            if reader not in gone:
                reader.replace_input_with(new, old)
                if self.cache is not None:
                    self.cache.touched((reader,))
        for node in reversed(self.created):
            graph.graph.erase_node(node)
        gone.update(self.created)
        if self.host_input:
            specs.pop()
        if self.regathers:   # the backward gathers back where no remaining replay needs them earlier
            offload_activation_gathers.place(graph.graph)


@dataclass(frozen=True)
class _Replay:
    """A recompute region chosen so far: what a later region that replays some of the same
    nodes extends (undone and replayed again as one region, once)."""

    region: Region
    edit: _Edit
    seeds: tuple[str, ...]     # the saved activations of the regions merged into it


class _Replays:
    """The recompute regions chosen so far, by the key (a counter, rising) each was chosen
    under, and a log of the changes: ranking a region asks which chosen replays it overlaps,
    for every region of every seed after each choice. Comparing the region with every chosen
    replay each time was a tenth of the planner's time on a 6-block GPT, yet a choice adds or
    undoes a few replays, and a region whose nodes none of them replays overlaps the same
    chosen replays as before (`unchanged_for`)."""

    def __init__(self) -> None:
        self.chosen: dict[int, _Replay] = {}
        # the key and the nodes of each replay added or undone, in turn
        self.log: list[tuple[int, frozenset[str]]] = []

    @property
    def version(self) -> int:
        return len(self.log)

    def add(self, key: int, replay: _Replay) -> None:
        self.chosen[key] = replay
        self.log.append((key, frozenset(replay.region.nodes)))

    def pop(self, key: int) -> _Replay:
        replay = self.chosen.pop(key)
        self.log.append((key, frozenset(replay.region.nodes)))
        return replay

    def unchanged_for(self, nodes: set[str], since: int) -> bool:
        """Whether no replay added or undone since `version` was `since` replays any of `nodes`:
        then the chosen replays that overlap `nodes` are the ones that did then."""
        return all(nodes.isdisjoint(changed) for _, changed in self.log[since:])

    def overlapping(self, nodes: set[str], since: int, then: tuple[int, ...]) -> tuple[int, ...]:
        """The keys of the chosen replays that replay some of `nodes` (in the order they were
        chosen), from `then`, those that did when `version` was `since`: a key is never chosen
        again once undone (a replay restored gets a new one), so it is those less the ones
        undone since, and the ones chosen since that overlap."""
        found = set(then)
        for key, changed in self.log[since:]:
            if key not in self.chosen:
                found.discard(key)
            elif not nodes.isdisjoint(changed):
                found.add(key)
        return tuple(sorted(found))

def _replay(graph: TrainGraph, seeds: Sequence[str], names: set[str], seconds: dict[fx.Node, float],
            cache: StorageCache | None = None) -> tuple[Region, _Edit] | None:
    """Replay the forward nodes `names` as one region, right before the first backward reader
    of any of `seeds` (the regions merged into it), on the graph as it is now. `cache`: the
    plan's StorageCache (its storage maps are the maps built without it)."""
    step = _Step(graph, StorageMap(graph.graph, cache=cache))
    by_name = {n.name: n for n in step.nodes}
    chain = sorted((by_name[n] for n in names), key=step.position.__getitem__)
    if not step._draws_replayable(chain):
        return None
    firsts = []
    for name in seeds:
        sids = step.of(by_name[name])
        facts = step._facts(sids[0]) if len(sids) == 1 else None
        if facts is not None:
            firsts.append((facts[0], name))
    if not firsts:
        return None
    at, seed = min(firsts)
    region = step._region(by_name[seed], chain, at, seconds)
    if region is None:
        return None
    return region, _recompute(graph, region, cache)


def _offload(graph: TrainGraph, specs: list[InputSpec], act: SavedActivation, prefetch_at: int,
             device: torch.device, cache: StorageCache | None = None, every_stream: bool = True) -> _Edit:
    """Copy `act` to a new host buffer after its last forward reader and back from
    `prefetch_at` on, its backward readers rewired to the copy. `cache`: the plan's StorageCache,
    told what the edit touched; `every_stream`: set the copy stream of every transfer node of the
    graph (the nodes other passes made may have none yet), else of the new ones alone (a plan's
    later offloads: its replays copy no transfer node, so the others have theirs already)."""
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
    created = [host, ticket, fetched, restored, landed, waited]
    if every_stream:
        assign_streams(g)
    else:
        for node in created:
            stream = stream_of(node.target)
            if stream is not None:
                node.meta["stream"] = stream
    return _Edit(created, [(r, value, restored) for r in readers], True, cache=cache)


def _recompute(graph: TrainGraph, region: Region, cache: StorageCache | None = None) -> _Edit:
    g = graph.graph
    nodes = [n for n in g.nodes if n.op != "output"]
    by_name = {n.name: n for n in nodes}
    chain = [by_name[name] for name in region.nodes]
    before = nodes[region.at]
    name = f"activations ({region.seed})"
    copies: dict[fx.Node, fx.Node] = {}
    created: list[fx.Node] = []
    # a stage 3 parameter is read from its backward copy (forward's is freed after forward)
    regathered = offload_activation_gathers.backward_copies(nodes)
    reads = {i: regathered[i] for n in chain for i in n.all_input_nodes if i in regathered}
    random = [n for n in chain if draws_random_numbers(n)]
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
                copy = g.node_copy(node, lambda n: copies.get(n, reads.get(n, n)))
            copy.meta = {key: node.meta[key] for key in ("val", "stack_trace") if key in node.meta}
            copies[node] = copy
            created.append(copy)
        if random:
            created.append(g.call_function(ops.swap_rng_state.default, (swapped, device)))
    for node in created:
        if node.meta.get("phase") != "forward":
            node.meta.update({"phase": "backward", "recompute": name})
    for node, copy in copies.items():
        copy.meta["recompute_of"] = node.name
    made = set(created)
    rewired = []
    for value in (by_name[n] for n in region.rewired):
        for reader in [u for u in value.users if u.meta.get("phase") == "backward" and u not in made]:
            reader.replace_input_with(value, copies[value])
            rewired.append((reader, value, copies[value]))
    if reads:   # each backward copy gathered before the replay reads it
        offload_activation_gathers.place(g)
    return _Edit(created, rewired, regathers=bool(reads), cache=cache)


@dataclass(frozen=True)
class _Timeline:
    """Predicted start of each node (graph order, the output excluded) and the busy spans of
    each link (d2h, h2d), with the activation copies chosen so far: what a further offload's
    copies would wait for."""

    starts: list[float]
    links: dict[str, list[tuple[float, float]]]

    def prefetch(self, act: SavedActivation, after: int, cal: Calibration) -> tuple[int, float]:
        """Where to issue `act`'s copy back (after position `after`, the peak), and how long its
        reader then stalls for it: the copy out takes the first gap on the d2h link after its
        last forward read, the copy back the latest gap on the h2d link that lands it in time."""
        out, back = act.nbytes / cal.d2h_bytes_per_s, act.nbytes / cal.h2d_bytes_per_s
        gone = _first_gap(self.links["d2h"], self.starts[act.last_forward], out) + out
        due = latest = self.starts[act.first_backward]
        for b0, b1 in reversed(self.links["h2d"]):   # the latest free slot that ends by `due`
            if b0 >= latest:
                continue
            if b1 <= latest - back:
                break
            latest = min(latest, b0)
        at = min(max(bisect_right(self.starts, latest - back) - 1, after + 1), act.first_backward)
        begin = _first_gap(self.links["h2d"], max(self.starts[at], gone), back)
        return at, max(0.0, begin + back - due)


def plan_activations(graph: TrainGraph, budget: int, cal: Calibration, device: torch.device,
                     schedule: Prediction | None = None, planned: Sequence[str] = (),
                     costs: StepCosts | None = None) -> ActivationPlan:
    """Keep, recompute or offload saved activations until the predicted peak fits `budget`
    (or nothing live at the peak is left to move); the caller checks the result against it.
    `schedule`, `planned`: the optimizer-state plan's timeline and the names of the nodes its
    `node_start` is indexed by (place_on_schedule), on which an offload's stall is predicted;
    `costs`: what that plan was made from, on which each finished plan's step is predicted
    (`retime`). Up to three plans (blocks replayed first until the budget is met, every block
    replayed, the greedy), the one whose predicted step is shortest kept (the module's
    docstring says why); the others that fit ride along in `others`.

    Recomputes are found lazily: growing every saved activation's regions again after each
    choice took minutes on a 24-block GPT, so each seed waits in a heap under the best ratio of
    all the bytes its regions free to their time (a bound on what they free at any peak), and
    only the seeds whose bound beats the best choice found so far are grown again."""
    timed = schedule is not None and costs is not None

    def step_of(p: ActivationPlan) -> float:
        """The plan's predicted step (re-timed by the state plan's model), or without a state
        plan's costs what it adds to the step."""
        if not timed:
            return p.added_seconds
        return place_on_schedule(p.graph, schedule, planned, cal, costs)[0].step_seconds

    blocks = forward_blocks(graph)
    # copies of the graph as it is now, one per further plan (a copy's notes are its own)
    blocks_first, every, retry = graph.deferred_copy(), graph.deferred_copy(), graph.deferred_copy()
    # stage 3: a plan whose replays read no backward-gathered parameter, should those strand the peak
    unmoved = graph.deferred_copy() if offload_activation_gathers.backward_copies(list(graph.graph.nodes)) else None
    plans, steps = [], {}
    if blocks:   # every block's replay (checkpointing's policy) first, the greedy after it if need be
        plans.append(_plan(blocks_first(), budget, cal, device, schedule, planned, merge=True, blocks=blocks,
                           strategy="blocks first"))
        steps[plans[-1].strategy] = step_of(plans[-1])
    if blocks and plans[-1].blocks < len(blocks):
        # checkpointing's own plan, every block replayed, though the budget needs fewer: the
        # memory it frees can buy a faster bucket plan (earlier prefetches), which
        # offload_optimizer plans again on every plan that fits (_replan_with_activations)
        plans.append(_plan(every(), budget, cal, device, schedule, planned, merge=True, blocks=blocks,
                           strategy="every block", every_block=True))
        steps[plans[-1].strategy] = step_of(plans[-1])
    # the greedy stops once it cannot beat a plan that fits: what it adds to the compute stream
    # (replays, stalls) only grows, and a re-timed step is at least the compute floor plus that
    best = min((steps[p.strategy] for p in plans if p.peak <= budget), default=None)
    bound = None if best is None else best - compute_floor(schedule, costs, cal) if timed else best
    plans.insert(0, _plan(graph, budget, cal, device, schedule, planned, merge=True, bound=bound))
    steps[plans[0].strategy] = step_of(plans[0])
    if all(p.peak > budget for p in plans):
        # greedy choices can strand the peak: a merged replay comes before the first reader of
        # any saved tensor it frees, so what it remakes is live longer in backward. Plan again
        # with separate replays and keep the lower peak
        plans.append(_plan(retry(), budget, cal, device, schedule, planned, merge=False,
                           strategy="greedy, separate replays"))
        steps[plans[-1].strategy] = step_of(plans[-1])
    if unmoved is not None and all(p.peak > budget for p in plans):
        # a replay reading a parameter's backward copy holds that bucket from the replay on:
        # choices that each lowered the peak can together strand it higher than the plan whose
        # replays read only what is on the device anyway (stage 3 before backward copies were read)
        plans.append(_plan(unmoved(), budget, cal, device, schedule, planned, merge=True,
                           strategy="greedy, no early gathers", regather=False))
        steps[plans[-1].strategy] = step_of(plans[-1])
    fits = [p for p in plans if p.peak <= budget]
    # the shortest predicted step; on a tie (the replays hide alike) the lower peak, which leaves
    # more room for what the analysis does not see, then the greedy's
    chosen = min(fits, key=lambda p: (steps[p.strategy], p.peak)) if fits else min(plans, key=lambda p: p.peak)
    what = "predicted step" if timed else "added to the predicted step"
    summary = "activation plans: " + ", ".join(
        f"{p.strategy} {steps[p.strategy] * 1e3:.4g} ms ({format_bytes(p.peak)}"
        + (", over the budget" if p.peak > budget else "") + (", cut short" if p.abandoned else "") + ")"
        for p in plans) + f" {what}; {chosen.strategy} kept"
    log.info("%s", summary)
    chosen.graph.note(_PASS, summary, "activation_plans", chosen=chosen.strategy,
        timed=timed, plans={p.strategy: {"step_seconds" if timed else "added_seconds": steps[p.strategy],
                                          "peak_bytes": p.peak, "fits": p.peak <= budget,
                                          "abandoned": p.abandoned} for p in plans})
    return replace(chosen, others=tuple(p for p in fits if p is not chosen))


def _plan(graph: TrainGraph, budget: int, cal: Calibration, device: torch.device, schedule: Prediction | None,
          planned: Sequence[str], merge: bool, blocks: Sequence[tuple[str, ...]] = (), bound: float | None = None,
          strategy: str = "greedy", every_block: bool = False, regather: bool = True) -> ActivationPlan:
    """One plan; `merge`: recomputes extend the chosen replays they overlap; `blocks`
    (forward_blocks' units): whole blocks replayed first, most bytes live at the peak per second
    of their compute first, until the budget is met (`every_block`: every block, as
    checkpointing every block does, each kept unless it raises the peak), the greedy after
    them; `bound`: give up (the plan left over the budget) once the plan adds more than this to
    the predicted step; `regather`: under ZeRO stage 3, replays may read parameters from their
    backward gathers (offload_activation_gathers), else only what is on the device anyway."""
    # the graph's node facts, kept across its edits' storage maps; each edit (_Edit) reports the
    # nodes it made and rewired, so a map reads only those again
    cache = StorageCache(records_changes=True)
    streamed = False   # an offload has set every transfer node's stream (_offload's every_stream)
    # the first map, built once for the analysis and the first step (it was built twice, the
    # analysis's without the cache; a map built with it is the map built without it)
    storages = StorageMap(graph.graph, cache=cache)
    profile = analyze_memory(graph, storages)
    keep_peak = profile.peak
    # the schedule's start of each planned node, for every edit's simulation (_simulate)
    starts_of = dict(zip(planned, schedule.node_start)) if schedule is not None else None
    choices: dict[str, str] = {}
    began = time.monotonic()
    report_at = began + PROGRESS_S
    log.info("activation plan '%s': predicted peak %s with every activation kept, budget %s", strategy,
             format_bytes(keep_peak), format_bytes(budget))

    def report() -> None:
        """A line now and then while the plan searches (PROGRESS_S)."""
        nonlocal report_at
        now = time.monotonic()
        if now >= report_at:
            report_at = now + PROGRESS_S
            made = list(choices.values())
            log.info("activation plan '%s': %d recomputed, %d offloaded so far, predicted peak %s (budget %s), "
                     "%.0f s", strategy, made.count("recompute"), made.count("offload"), format_bytes(profile.peak),
                     format_bytes(budget), now - began)

    specs = list(graph.signature.inputs)
    tried: set[tuple] = set()
    seconds: dict[fx.Node, float] = {}
    named: dict[str, float] = {}   # the forward nodes' times by name (a region names its nodes)
    heap: list[tuple[float, int, str]] = []   # (-bound, tie-break, seed)
    latest: dict[str, int] = {}    # each seed's newest heap entry (older ones are stale)
    last_grown: dict[str, list[Region]] = {}
    replays = _Replays()   # the recompute regions chosen so far
    gone: set[fx.Node] = set()
    counter = merged_count = blocks_replayed = 0
    first = True

    def time_nodes(step: _Step) -> None:
        for n in step.storages.nodes:   # the graph is edited in place: its nodes' times stay valid
            if n not in seconds:
                seconds[n] = estimate_seconds(n, cal)
                if n.meta.get("phase") == "forward":
                    named[n.name] = seconds[n]

    node_sets: dict[int, tuple[Region, set[str]]] = {}   # by id: the region is held, so its id stays its own
    # by the region's id (held in node_sets): (replays.version, its extension then)
    extensions: dict[int, tuple[int, tuple[float, tuple[int, ...]]]] = {}

    def nodes_of(region: Region) -> set[str]:
        """`region`'s node names as a set, made once: a region's extension is asked for again
        each time its seed goes back in the heap."""
        try:
            return node_sets[id(region)][1]
        except KeyError:
            found = set(region.nodes)
            node_sets[id(region)] = (region, found)
            return found

    def extension(region: Region) -> tuple[float, tuple[int, ...]]:
        """What replaying `region` adds to the step, and the chosen replays it extends: the
        replays that already replay some of its nodes are merged with it into one region,
        replayed once, so only its other nodes' time is added."""
        nodes = nodes_of(region)
        found = extensions.get(id(region))
        if found is not None and (not merge or replays.unchanged_for(nodes, found[0])):
            # the chosen replays it overlaps (and so their nodes) are those it overlapped then
            extensions[id(region)] = (replays.version, found[1])
            return found[1]
        if found is not None:
            over = replays.overlapping(nodes, found[0], found[1][1])
            if over == found[1][1]:   # the same chosen replays: the same nodes covered
                extensions[id(region)] = (replays.version, found[1])
                return found[1]
        else:
            over = tuple(k for k, rep in replays.chosen.items() if merge and not nodes.isdisjoint(nodes_of(rep.region)))
        if not over:
            result = region.seconds, ()
        else:
            covered = set().union(*(replays.chosen[k].region.nodes for k in over))
            # fsum: exact, so the result does not depend on the set's order (string hashes, and
            # so the order, differ between processes; a plan must not)
            result = math.fsum(map(named.get, nodes - covered, repeat(0.0))), over
        extensions[id(region)] = (replays.version, result)
        return result

    grown_names: dict[str, tuple[list[Region], frozenset[str]]] = {}

    def names_of(seed: str, regions: list[Region]) -> frozenset[str]:
        """Every node of `regions` (`seed`'s, as last grown), made once per growth: after each
        replay chosen, each seed's regions are asked whether they share a node with it."""
        found = grown_names.get(seed)
        if found is None or found[0] is not regions:
            found = grown_names[seed] = (regions, frozenset().union(*(r.nodes for r in regions)))
        return found[1]

    def push(seed: str, regions: list[Region]) -> None:
        nonlocal counter
        last_grown[seed] = regions
        if regions:
            counter += 1
            latest[seed] = counter
            heappush(heap, (-max(_bytes(r) / max(extension(r)[0], 1e-12) for r in regions), counter, seed))

    stamped = False

    def stamp(edit: _Edit) -> None:
        """fill_missing_meta after an edit: the whole graph the first time, then the nodes the
        edit made (the others are stamped: a pass over the graph per edit was a few percent)."""
        nonlocal stamped
        fill_missing_meta(graph, _PASS, edit.created if stamped else None)
        if stamped:
            cache.touched(edit.created)   # their values, new (a map may have read them without)
        else:
            cache.forget()   # a value given to any node missing one: check every node once
        stamped = True

    pending = list(blocks)
    while pending and (every_block or profile.peak > budget):
        report()
        step = _Step(graph, storages or StorageMap(graph.graph, cache=cache), regather)
        time_nodes(step)
        at = profile.nodes.index(profile.peak_node)
        options = []
        for names in pending:
            region = step.block_region(names, seconds)
            if region is not None and (region.bytes_live_at(at) or every_block and region.freed):
                options.append(((region.bytes_live_at(at) / max(region.seconds, 1e-12),
                                 _bytes(region) / max(region.seconds, 1e-12)), names, region))
        if not options:
            break
        _, names, region = max(options, key=lambda o: o[0])
        pending.remove(names)
        edit = _recompute(graph, region, cache)
        stamp(edit)
        storages = StorageMap(graph.graph, cache=cache)
        after = analyze_memory(graph, storages)
        # a block replayed beyond the budget frees memory away from the peak (where the buckets'
        # prefetches may go): kept unless it raises the peak
        if not (after.peak <= profile.peak if every_block else _lowered(profile, after)):
            edit.undo(graph, specs, gone)
            storages = None
            continue
        profile = after
        counter += 1
        blocks_replayed += 1
        replays.add(counter, _Replay(region, edit, region.rewired))
        for name in region.rewired:
            choices[name] = "recompute"
        graph.note(_PASS, f"activations of the block from {region.nodes[0]} ({format_bytes(_bytes(region))}): "
                   f"recompute the block ({len(region.nodes)} nodes, {region.seconds * 1e6:.3g} us, "
                   f"{len(region.freed)} saved tensors freed); predicted peak {format_bytes(profile.peak)}",
                   "activation", activation=region.seed, choice="recompute", bytes=_bytes(region),
                   seconds=region.seconds, added_seconds=region.seconds, stall_seconds=0.0,
                   recomputed=region.nodes, rewired=region.rewired, extends=(), block=True,
                   peak_after=profile.peak)
    abandoned = False
    while profile.peak > budget:
        report()
        step = _Step(graph, storages or StorageMap(graph.graph, cache=cache), regather)
        time_nodes(step)
        seeds = step.seeds()
        if first:
            first = False
            for seed, sid in seeds.items():
                push(seed, step.regions(sid, seconds))
        saved = step.saved(cal, seconds)
        for act in saved:
            choices.setdefault(act.name, "keep")
        at = profile.nodes.index(profile.peak_node)
        timeline, _, _, added = _simulate(graph, cal, seconds, schedule, planned, starts_of)
        if bound is not None and added > bound:
            abandoned = True   # another plan fits the budget adding less: this one cannot beat it
            break
        # (bytes at the peak per second of added time, how, what, prefetch position or the
        # replays a recompute extends, seconds)
        options = []
        for act in saved:
            if not act.last_forward < at < act.first_backward:
                continue   # not live at the peak: moving it would not lower it
            # its copy back is issued after the peak, on the link as the copies chosen so far
            # (and the state's transfers) leave it: ranked by the stall it adds to the step, what
            # backward's compute from there to its reader does not hide
            prefetch_at, stall = timeline.prefetch(act, at, cal)
            options.append((act.nbytes / max(stall, 1e-12), "offload", act, prefetch_at, stall))
        grown: dict[str, list[Region]] = {}
        chosen, again = None, False
        while chosen is None:
            best = max((o for o in options if _key(o) not in tried), key=lambda o: (o[0], _bytes(o[2])), default=None)
            while heap and (best is None or -heap[0][0] > best[0]):
                _, entry, seed = heappop(heap)
                if seed in grown or seed not in seeds or latest.get(seed) != entry:
                    continue
                regions = grown[seed] = step.regions(seeds[seed], seconds)
                for r in regions:
                    if r.bytes_live_at(at):
                        added, over = extension(r)
                        options.append((r.bytes_live_at(at) / max(added, 1e-12), "recompute", r, over, added))
                best = max((o for o in options if _key(o) not in tried), key=lambda o: (o[0], _bytes(o[2])),
                           default=None)
            if best is None:
                break
            _, how, what, where, cost = best
            tried.add(_key(best))
            merged: list[_Replay] = []
            if how == "recompute" and where:   # undo the replays it extends, replay them with it once
                merged = [replays.pop(k) for k in where]
                for rep in reversed(merged):
                    rep.edit.undo(graph, specs, gone)
                made = _replay(graph, (what.seed, *(s for rep in merged for s in rep.seeds)),
                               set(what.nodes).union(*(rep.region.nodes for rep in merged)), seconds, cache)
                if made is None:
                    for rep in _restore(graph, merged, seconds, cache):
                        counter += 1
                        replays.add(counter, rep)
                    again = True
                    break
                what, edit = made
            elif how == "recompute":
                edit = _recompute(graph, what, cache)
            else:
                edit = _offload(graph, specs, what, where, device, cache, every_stream=not streamed)
                streamed = True
            graph = graph.with_signature(inputs=tuple(specs))   # new host inputs are not device memory
            stamp(edit)
            storages = StorageMap(graph.graph, cache=cache)
            after = analyze_memory(graph, storages)
            if not _lowered(profile, after):
                edit.undo(graph, specs, gone)
                graph = graph.with_signature(inputs=tuple(specs))
                storages = None
                if merged:   # the positions may differ from the step's: plan again from the graph
                    for rep in _restore(graph, merged, seconds, cache):
                        counter += 1
                        replays.add(counter, rep)
                    again = True
                    break
                step = _Step(graph, StorageMap(graph.graph, cache=cache), regather)   # the same positions as before the edit
                continue
            chosen, profile = best, after
            if how == "recompute":
                counter += 1
                replays.add(counter, _Replay(what, edit, (what.seed, *(s for rep in merged for s in rep.seeds))))
        for seed, regions in grown.items():   # back in the heap under their new bounds
            push(seed, regions)
        if chosen is None:
            if again:
                fill_missing_meta(graph, _PASS)
                cache.forget()
                storages = StorageMap(graph.graph, cache=cache)
                profile = analyze_memory(graph, storages)
                continue
            break
        if how == "recompute":
            nodes = set(what.nodes)
            for seed, regions in list(last_grown.items()):   # cheaper now: extensions of this replay
                if seed not in grown and not nodes.isdisjoint(names_of(seed, regions)):
                    push(seed, regions)
            for name in what.rewired:
                choices[name] = how
            choices.setdefault(what.seed, how)
            extends = sorted({s for rep in merged for s in rep.seeds})
            merged_count += bool(merged)
            graph.note(_PASS, f"activations from {what.seed} ({format_bytes(_bytes(what))}): recompute "
                       f"({len(what.nodes)} nodes, {what.seconds * 1e6:.3g} us"
                       + (f", {cost * 1e6:.3g} us more than the {len(merged)} replays it extends" if merged else "")
                       + f", {len(what.freed)} saved tensors freed); predicted peak {format_bytes(profile.peak)}",
                       "activation", activation=what.seed, choice=how, bytes=_bytes(what), seconds=what.seconds,
                       added_seconds=cost, stall_seconds=0.0, recomputed=what.nodes, rewired=what.rewired,
                       extends=tuple(extends), block=False, peak_after=profile.peak)
        else:
            choices[what.name] = how
            graph.note(_PASS, f"activation {what.name} ({format_bytes(what.nbytes)}): offload "
                       f"({what.offload_seconds * 1e6:.3g} us over the link"
                       + (f", {cost * 1e6:.3g} us stall before its reader" if cost else "") + ")"
                       f"; predicted peak {format_bytes(profile.peak)}", "activation",
                       activation=what.name, choice=how, bytes=what.nbytes, seconds=what.offload_seconds,
                       added_seconds=cost, stall_seconds=cost, recomputed=(), rewired=(), extends=(),
                       block=False, peak_after=profile.peak)
    added = _simulate(graph, cal, seconds, schedule, planned, starts_of)[3]
    counts = {c: sum(1 for v in choices.values() if v == c) for c in ("keep", "recompute", "offload")}
    graph.note(_PASS, f"activations: {counts['keep']} kept, {counts['recompute']} recomputed"
               + (f" ({blocks_replayed} whole blocks replayed)" if blocks_replayed else "")
               + f", {counts['offload']} offloaded; predicted peak {format_bytes(keep_peak)} -> "
               f"{format_bytes(profile.peak)} (budget {format_bytes(budget)}), {added * 1e3:.3g} ms added to the "
               "predicted step (" + strategy + ")", "activations", keep_peak_bytes=keep_peak, peak_bytes=profile.peak, budget_bytes=budget,
               choices=dict(choices), strategy=strategy, added_seconds=added, blocks=blocks_replayed,
               abandoned=abandoned, **counts)
    log.info("activation plan '%s': %d recomputed, %d offloaded, predicted peak %s (budget %s%s)%s, %.2f s", strategy,
             counts["recompute"], counts["offload"], format_bytes(profile.peak), format_bytes(budget),
             ", over it" if profile.peak > budget else "",
             ", cut short: another plan fits adding less" if abandoned else "", time.monotonic() - began)
    return ActivationPlan(graph, keep_peak, profile.peak, profile.peak_node, choices, merged_count, added, strategy,
                          abandoned, blocks_replayed)


def _restore(graph: TrainGraph, merged: list[_Replay], seconds: dict[fx.Node, float],
             cache: StorageCache | None = None) -> list[_Replay]:
    """Replay again, each as it was, the regions a rejected merge undid."""
    made = [(_replay(graph, rep.seeds, set(rep.region.nodes), seconds, cache), rep.seeds) for rep in merged]
    return [_Replay(m[0], m[1], seeds) for m, seeds in made if m is not None]


def _lowered(before: MemoryProfile, after: MemoryProfile) -> bool:
    """Whether an edit lowered the peak: no higher anywhere, and lower where it was (a peak at a
    node a merge's undo erased: lower overall)."""
    if after.peak > before.peak:
        return False
    if before.peak_node in after.nodes:
        return after.live_at(before.peak_node) < before.peak
    return after.peak < before.peak


def _bytes(what: Region | SavedActivation) -> int:
    return what.nbytes


def _key(option: tuple) -> tuple:
    """What a tried option is remembered by (a rejected one is not tried again)."""
    _, how, what, prefetch_at, _ = option
    return (how, what.seed, what.nodes, what.rewired) if how == "recompute" else (how, what.name, prefetch_at)


def _first_gap(busy: list[tuple[float, float]], start: float, seconds: float) -> float:
    """The earliest time from `start` at which `seconds` fit between the busy spans of a link."""
    for b0, b1 in busy:
        if b1 <= start:
            continue
        if start + seconds <= b0:
            break
        start = b1
    return start


def _simulate(graph: TrainGraph, cal: Calibration, seconds: dict[fx.Node, float], schedule: Prediction | None,
              planned: Sequence[str], starts_of: dict[str, float] | None = None
              ) -> tuple[_Timeline, list[Event], dict[str, float], float]:
    """The step's timeline with the activation plan so far: each node starts where `schedule`
    put it (without one: after the nodes before it, at their estimated times), later by the
    recompute and the stalls before it; each activation copy takes the first gap its link (d2h
    out, h2d back) leaves from the node that issues it on, beside the state's transfers; a copy
    back that lands after its reader should start stalls the compute stream. `starts_of`:
    `schedule`'s start of each node of `planned` by name, when the caller keeps it (a planner
    simulates every edit on one schedule)."""
    if schedule is not None:
        start_of = starts_of if starts_of is not None else dict(zip(planned, schedule.node_start))
        events = schedule.events
    else:
        start_of, clock, events = {}, 0.0, []
        for node in graph.graph.nodes:
            if node.op != "output" and "activation" not in node.meta and \
                    not str(node.meta.get("recompute", "")).startswith("activations"):
                start_of[node.name] = clock
                clock += seconds.get(node) if node in seconds else estimate_seconds(node, cal)
    links: dict[str, list[tuple[float, float]]] = {"d2h": [], "h2d": []}   # busy spans, sorted
    for e in events:
        if e.track in links:
            insort(links[e.track], (e.start, e.end))
    added, starts, delay, now = [], [], 0.0, 0.0
    totals = {"recompute_seconds": 0.0, "stall_seconds": 0.0, "link_seconds": 0.0}
    issued: dict[str, float] = {}
    wait, to_host, to_device = ops.wait_device.default, ops.copy_to_host.default, ops.prefetch_to_device.default
    get_start, append = start_of.get, starts.append
    for node in graph.graph.nodes:
        if node.op == "output":
            break
        begun = get_start(node.name)
        if begun is not None:
            now = max(now, begun + delay)
        meta = node.meta
        name = meta.get("activation")
        if name and node.target is wait and issued.get(name, 0.0) > now:
            stall = issued[name] - now
            delay, now = delay + stall, now + stall
            totals["stall_seconds"] += stall
        append(now)
        replay = meta.get("recompute")   # (_replayed, inline: every node of every edit asks)
        if replay is not None and str(replay).startswith("activations"):
            took = seconds.get(node) if node in seconds else estimate_seconds(node, cal)
            if begun is None:   # not timed on the schedule already (retime)
                delay, now = delay + took, now + took
            totals["recompute_seconds"] += took
        elif name and node.target in (to_host, to_device):
            track = "d2h" if node.target is to_host else "h2d"
            nbytes = sum(t.meta["val"].numel() * t.meta["val"].element_size() for t in node.args[0])
            took = nbytes / (cal.d2h_bytes_per_s if track == "d2h" else cal.h2d_bytes_per_s)
            begin = _first_gap(links[track], max(now, issued.get(name, 0.0)), took)
            insort(links[track], (begin, begin + took))
            added.append(Event(track, f"activation {name} {'out' if track == 'd2h' else 'back'}", begin,
                               begin + took))
            issued[name] = begin + took
            totals["link_seconds"] += took
    return _Timeline(starts, links), added, totals, delay


def _replayed(node: fx.Node) -> bool:
    return str(node.meta.get("recompute", "")).startswith("activations")


def retimed_costs(graph: TrainGraph, schedule: Prediction, planned: Sequence[str], costs: StepCosts,
                  cal: Calibration, with_memory: bool = False) -> tuple[StepCosts, dict[int, int], list[str]]:
    """The state plan's costs on `graph`'s compute stream: the nodes it was planned on, at their
    costs' times, with the activation plan's replayed nodes where the graph runs them (each at
    its forward original's time), the buckets' ready and first-use points and the device-path
    prefetch points moved with their nodes. Also the prefetch points, and the names the
    sequence is indexed by (`planned` with the replayed nodes among them). `with_memory`: the
    device bytes live at each node are `graph`'s (liveness analysis) less the prefetched state
    buffers of the schedule's device-path buckets, as the state planner takes them (every
    bucket on the CPU path); else zeros (a prediction at the given prefetch points needs none)."""
    index = {name: i for i, name in enumerate(planned)}
    names: list[str] = []
    seconds: list[float] = []
    at = [0] * len(planned)       # each planned node's position in the re-timed sequence
    done, pending = 0, []         # planned nodes placed so far; replayed nodes before the next one

    def place_through(i: int) -> None:
        nonlocal done, pending
        while done <= i:
            if done == i:         # replays go right before the node the graph runs after them
                for name, took in pending:
                    names.append(name)
                    seconds.append(took)
                pending = []
            at[done] = len(names)
            names.append(planned[done])
            seconds.append(costs.node_seconds[done])
            done += 1

    for node in graph.graph.nodes:
        if node.op == "output":
            break
        i = index.get(node.name)
        if i is not None and i >= done:
            place_through(i)
        elif i is None and _replayed(node):
            original = index.get(node.meta.get("recompute_of", ""))
            pending.append((node.name, costs.node_seconds[original] if original is not None
                            else estimate_seconds(node, cal)))
    place_through(len(planned) - 1)
    for name, took in pending:
        names.append(name)
        seconds.append(took)

    def moved(i: int | None) -> int | None:
        return None if i is None else at[i]

    buckets = [replace(b, ready_node=at[b.ready_node], grads_final_node=moved(b.grads_final_node),
                       first_use_node=at[b.first_use_node]) for b in costs.buckets]
    prefetch = {b: at[i] for b, i in schedule.prefetch_node.items()}
    live = [0] * len(names)
    if with_memory:
        profile = analyze_memory(graph)
        by_name = dict(zip(profile.nodes, profile.live))
        last = 0
        for j, name in enumerate(names):   # a planned node the offload erased: the bytes before it
            last = live[j] = by_name.get(name, last)
        for b, start in prefetch.items():
            for j in range(start, len(live)):
                live[j] -= buckets[b].state_bytes
    return StepCosts(seconds, live, buckets, costs.overlap_next_step), prefetch, names


def retime(graph: TrainGraph, schedule: Prediction, planned: Sequence[str], costs: StepCosts,
           cal: Calibration) -> tuple[Prediction, list[str]]:
    """The state plan's model (offload_planner.StepModel) run again on `graph`'s compute stream
    (`retimed_costs`), the buckets' paths and prefetch points kept: a replay delays the
    gradients that become final after it, and with them the transfers and CPU updates, as a
    checkpointed model's recompute is simulated, and the step grows only where the replay is
    on the critical path. Also the names the prediction's `node_start` is indexed by."""
    timed, prefetch, names = retimed_costs(graph, schedule, planned, costs, cal)
    return StepModel(timed, cal).predict(schedule.assignment, prefetch=prefetch), names


def compute_floor(schedule: Prediction, costs: StepCosts, cal: Calibration) -> float:
    """A lower bound of any re-timed step of this state plan before the activation plan adds to
    it: every node's compute and every device-path update, back to back (`retime` adds the
    replays' compute to the compute stream, `place_on_schedule` the stalls)."""
    return sum(costs.node_seconds) + sum(b.numel / cal.device_update_params_per_s
                                         for b, path in zip(costs.buckets, schedule.assignment) if path == "device")


def place_on_schedule(graph: TrainGraph, schedule: Prediction, planned: Sequence[str],
                      cal: Calibration, costs: StepCosts | None = None) -> tuple[Prediction, dict[str, float]]:
    """The optimizer-state plan's predicted timeline with the activation plan added (_simulate):
    activation copies in the gaps the state's transfers leave on each link, late copies back
    pushing what follows back. With the state plan's `costs`, the replayed nodes are timed by
    the state plan's model itself (`retime`), so recompute that hides behind the CPU updates
    and transfers is not charged; without them (no costs kept), recompute is added in full.
    The state's transfers keep their paths (the bucket plan is made first, not jointly).
    `planned`: the names of the nodes the schedule's `node_start` is indexed by; the returned
    schedule's `node_start` is indexed by them too."""
    if costs is None:
        _, events, totals, delay = _simulate(graph, cal, {}, schedule, planned)
        return replace(schedule, step_seconds=schedule.step_seconds + delay,
                       events=[*schedule.events, *events]), totals
    timed, names = retime(graph, schedule, planned, costs, cal)
    _, events, totals, delay = _simulate(graph, cal, {}, timed, names)
    start_of = dict(zip(names, timed.node_start))
    return replace(schedule, step_seconds=timed.step_seconds + delay, events=[*timed.events, *events],
                   node_start=[start_of[name] for name in planned]), totals
