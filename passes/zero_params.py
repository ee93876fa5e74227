"""zero_params: ZeRO stage 3's parameter gathers, the part of the `zero` pass that shards the
parameters themselves between steps (the FSDP2 layout: this rank's `Shard(0)` rows of each).

With stage 3 a parameter's placeholder is this rank's chunk (`shard_rows` of dim 0), and the
update kernel writes that chunk in place; no rank holds a whole parameter between steps. Forward
and backward still need whole parameters, so the pass gathers them, per bucket of parameters
(consecutive in the order forward first reads them, `bucket_numel` elements at most, one dtype):

* **Forward**: one `all_gather_into_tensor` per bucket of each rank's chunks, packed rank by rank
  and padded to ceil(d0/N) rows as the gradients' reduce-scatter packs them; its `wait_tensor`
  right before the bucket's first read and the next bucket's gather issued right after it
  (prefetch: the next bucket's collective overlaps this bucket's compute); every read of the
  parameter in forward reads the gathered copy, which dies after its last forward read.
* **Backward**: the same buckets gathered again, in the order backward first reads them, with
  only the parameters backward reads (a linear's weight for the input's gradient; not its bias;
  with `Offload(activations="auto")` the whole bucket, so the activation planner's replays of
  forward regions find every parameter they read gathered again: offload_activation_gathers),
  prefetched likewise; but when backward first reads the bucket forward read last (the last
  layer), forward's copies of it are kept for backward instead (as FSDP2 keeps its root
  module's parameters): one gather fewer, one bucket held from forward into backward. What backward read of the forward's copy is recomputed from the new one:
  the chain of views forward made of the parameter alone (`t(weight)`, saved for the matmul's
  backward) is repeated on the backward copy, so the forward copy is not kept alive until
  backward; that chain must be pure (no random op, no write).

A 0-dim parameter is not sharded (every rank holds and updates it, as stages 1 and 2 do).
What else reads a sharded parameter (the step's outputs, a node outside forward and backward
besides its update) is refused with `UnsupportedError`, before the graph is changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from graphoffload.aliasing import written_args
from graphoffload.bucketing import greedy_buckets
from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.errors import UnsupportedError
from graphoffload.ops.rng import draws_random_numbers

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# zero's node maker: (target, args, like, phase=..., param=...) -> the new node, with meta["val"]
Emit = Callable[..., fx.Node]


@dataclass(eq=False)   # a key of dicts: one per parameter, compared by identity
class ShardedParam:
    """One parameter stage 3 shards: its placeholder (from now on this rank's chunk), its whole
    shape and its layout in the gather buffers (as the `zero` pass lays out the gradients'
    reduce-scatter: `chunk_rows` = ceil(d0/N) rows a rank's part holds, `part` its elements,
    `local_shape` this rank's chunk), and where forward and backward read it."""

    node: fx.Node
    name: str
    shape: tuple[int, ...]
    chunk_rows: int
    part: int
    local_shape: tuple[int, ...]
    update: fx.Node | None                # the update kernel that writes its chunk (None: an accumulating call's)
    forward: list[fx.Node] = field(default_factory=list)
    backward: list[fx.Node] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GatherReport:
    """What `gather_for_use` emitted, for the pass's note."""

    forward_buckets: tuple[int, ...]       # whole-parameter elements each forward gather brings
    backward_buckets: tuple[int, ...]      # ... each backward gather
    recomputed: int                        # forward views of a parameter repeated in backward
    sharded: tuple[str, ...]               # parameter names, in forward order
    kept: tuple[str, ...]                  # parameters backward reads from forward's copy (not gathered again)


def _line(node: fx.Node) -> str:
    return user_line_of_stack_trace(node.meta.get("stack_trace")) or "an unknown line"


def classify_reads(params: list[ShardedParam], position: dict[fx.Node, int]) -> None:
    """Sort every read of each parameter into forward and backward reads; refuse any other."""
    for p in params:
        for user in sorted(p.node.users, key=position.__getitem__):
            phase = user.meta.get("phase")
            if user is p.update:
                continue
            if phase == "forward" and user.op == "call_function":
                p.forward.append(user)
            elif phase == "backward" and user.op == "call_function":
                p.backward.append(user)
            else:
                raise UnsupportedError(
                    f"ZeRO stage 3 shards parameter {p.name} between steps, but {user.name} ({user.target}, "
                    f"{phase}) at {_line(user)} reads it outside forward and backward (a returned parameter or "
                    "a read after the update?); return a copy made in forward, or use ZeRO(stage=2)")
        returned = [v for v in _forward_views(p.node, _is_view) if any(u.op == "output" for u in v.users)]
        if returned:   # the step returns the parameter (a view of it): eager's would show the update
            raise UnsupportedError(
                f"ZeRO stage 3 shards parameter {p.name} between steps, but the step returns it ({returned[0].name}, "
                f"at {_line(returned[0])}), a view that would show the update; return a copy made in forward "
                "(.clone()), or use ZeRO(stage=2)")


def padded_flat(emit: Emit, chunk: fx.Node, shape: tuple[int, ...] | list[int], chunk_rows: int, name: str,
                like: fx.Node) -> fx.Node:
    """A rank's `chunk` of a tensor shaped `shape` (its rows of dim 0), padded to `chunk_rows`
    rows and flattened: its piece of a gather buffer. Stages 1-2 (the updated chunks) and stage
    3 (the parameters' chunks) lay out their gathers alike, so this and `whole_from_gathered`
    are the one layout both use."""
    pad = chunk_rows - chunk.meta["val"].shape[0]
    if pad:
        chunk = emit(aten.constant_pad_nd.default, (chunk, [0, 0] * (len(shape) - 1) + [0, pad]), like,
                     param=(name,))
    return emit(aten.reshape.default, (chunk, [-1]), like, param=(name,))


def whole_from_gathered(emit: Emit, by_rank: fx.Node, offset: int, part: int, shape: tuple[int, ...] | list[int],
                        chunk_rows: int, world: int, name: str, like: fx.Node) -> fx.Node:
    """The whole tensor (shaped `shape`) from a gathered buffer viewed as [world, bucket part]:
    columns [offset, offset + part) hold every rank's padded chunk of it (`padded_flat`)."""
    cols = by_rank if offset == 0 and part == by_rank.meta["val"].shape[1] else \
        emit(aten.slice.Tensor, (by_rank, 1, offset, offset + part), like, param=(name,))
    rows = emit(aten.reshape.default, (cols, [world * chunk_rows, *shape[1:]]), like, param=(name,))
    if world * chunk_rows != shape[0]:
        rows = emit(aten.slice.Tensor, (rows, 0, 0, shape[0]), like, param=(name,))
    return rows


def _pack(emit: Emit, bucket: list[ShardedParam], world: int, group: str) -> fx.Node:
    """This rank's chunks of the bucket, padded and flattened into one buffer; the launched
    all-gather of it (its wait comes later)."""
    pieces = [padded_flat(emit, p.node, p.shape, p.chunk_rows, p.name, p.node) for p in bucket]
    # a copy even of one chunk: the collective reads its input until its wait, and a view of the
    # chunk would let an update fused into backward (which follows the last read it can see, this
    # launch) overwrite the chunk while the gather still reads it
    flat = emit(aten.cat.default, (pieces,), bucket[0].node)
    return emit(c10d.all_gather_into_tensor.default, (flat, world, group), bucket[0].node)


def _unpack(emit: Emit, bucket: list[ShardedParam], launched: fx.Node, world: int,
            like: fx.Node, copy: str) -> dict[ShardedParam, fx.Node]:
    """Wait for the bucket's gather; each whole parameter from every rank's padded chunk, marked
    `meta["gathered"] = copy` ("forward" | "backward"): the activation planner's replays read a
    parameter's backward copy in place of forward's freed one (offload_activation_gathers)."""
    gathered = emit(c10d.wait_tensor.default, (launched,), like)
    if copy == "backward":   # where it was placed: a replay may move it earlier, an undo back
        gathered.meta["gather_home"] = like.name
    by_rank = emit(aten.view.default, (gathered, [world, sum(p.part for p in bucket)]), like)
    whole, offset = {}, 0
    for p in bucket:
        whole[p] = whole_from_gathered(emit, by_rank, offset, p.part, p.shape, p.chunk_rows, world, p.name, like)
        whole[p].meta["gathered"] = copy
        offset += p.part
    return whole


def _gather_in_order(emit: Emit, graph: fx.Graph, buckets: list[list[ShardedParam]], first: list[fx.Node],
                     world: int, group: str, copy: str, kept: dict[ShardedParam, fx.Node] | None = None
                     ) -> dict[ShardedParam, fx.Node]:
    """Per bucket, in order: its gather's wait and unpacking right before `first[i]`, its
    first read, and the next bucket's gather launched right after (one bucket ahead). With
    `kept`, the first bucket is not gathered: its whole parameters are `kept`'s. `copy`: which
    ("forward" | "backward"); a backward launch and wait record where they were placed
    (`meta["gather_home"]`, the name of the node they precede)."""
    whole: dict[ShardedParam, fx.Node] = dict(kept or {})
    launched = None
    for i, bucket in enumerate(buckets):
        with graph.inserting_before(first[i]):
            if i or not kept:
                if launched is None:
                    launched = _launch(emit, bucket, world, group, first[i], copy)
                whole.update(_unpack(emit, bucket, launched, world, first[i], copy))
            launched = _launch(emit, buckets[i + 1], world, group, first[i], copy) if i + 1 < len(buckets) else None
    return whole


def _launch(emit: Emit, bucket: list[ShardedParam], world: int, group: str, before: fx.Node, copy: str) -> fx.Node:
    launched = _pack(emit, bucket, world, group)
    if copy == "backward":
        launched.meta["gather_home"] = before.name
    return launched


def _is_view(node: fx.Node) -> bool:
    """Whether the op returns an alias of an input (`detach`, `t`, `view`, ...), per its schema."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def _forward_views(start: fx.Node, only: Callable[[fx.Node], bool] = lambda n: True) -> set[fx.Node]:
    """Forward nodes computed from `start` alone (every node input `start` or one of them),
    those `only` accepts."""
    chain: set[fx.Node] = set()
    frontier = [start]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in chain or user.meta.get("phase") != "forward" or user.op != "call_function" or not only(user):
                continue
            if all(i is start or i in chain for i in user.all_input_nodes):
                chain.add(user)
                frontier.append(user)
    return chain


def _recompute_backward_reads(graph: fx.Graph, p: ShardedParam, forward_whole: fx.Node,
                              backward_whole: fx.Node | None, position: dict[fx.Node, int]) -> int:
    """Point backward's reads of the forward copy's views at the same views of the backward copy
    (made right before the first backward read that needs each). Returns the nodes repeated."""
    chain = _forward_views(forward_whole)
    reads = sorted({(u, v) for v in chain for u in v.users if u.meta.get("phase") == "backward"},
                   key=lambda r: (position.get(r[0], len(position)), r[1].name))
    if not reads:
        return 0
    assert backward_whole is not None   # the caller gathered every parameter backward reads
    copies: dict[fx.Node, fx.Node] = {forward_whole: backward_whole}

    def repeat(node: fx.Node) -> fx.Node:
        if node not in copies:
            if written_args(node) or draws_random_numbers(node):
                raise UnsupportedError(
                    f"ZeRO stage 3: backward reads {node.name} ({node.target}), which forward computed from "
                    f"parameter {p.name} at {_line(node)} and which writes its input or draws random numbers, so "
                    "it cannot be recomputed from the parameter gathered again; use ZeRO(stage=2)")
            for i in node.all_input_nodes:
                repeat(i)
            copy = graph.node_copy(node, lambda n: copies[n])
            copy.meta = {k: v for k, v in node.meta.items() if k not in ("pass",)}
            copy.meta["phase"] = "backward"
            copies[node] = copy
        return copies[node]

    for user, view in reads:
        with graph.inserting_before(user):
            user.replace_input_with(view, repeat(view))
    return len(copies) - 1


def gather_for_use(emit: Emit, graph: fx.Graph, params: list[ShardedParam], world: int, group: str,
                   bucket_numel: int, whole_buckets: bool = False) -> GatherReport:
    """Make every sharded parameter's placeholder this rank's chunk and gather the whole
    parameter before forward and again before backward reads it (see the module docstring).
    `classify_reads` must have run (it refuses what cannot be sharded before anything changes).
    `whole_buckets`: a bucket backward reads is gathered again whole, with the parameters
    backward does not read (a linear's bias), for replays of forward in backward to read."""
    fake_mode = emit.fake_mode
    for p in params:   # from here the placeholder holds this rank's rows
        val = p.node.meta["val"]
        with fake_mode:
            p.node.meta["val"] = torch.empty(p.local_shape, dtype=val.dtype, device=val.device)

    position = {n: i for i, n in enumerate(graph.nodes)}
    read_in_forward = sorted((p for p in params if p.forward), key=lambda p: position[p.forward[0]])
    buckets = greedy_buckets(read_in_forward, lambda p: p.numel, bucket_numel, key=lambda p: p.node.meta["val"].dtype)
    first = [min((p.forward[0] for p in b), key=position.__getitem__) for b in buckets]
    forward = _gather_in_order(emit, graph, buckets, first, world, group, "forward")
    for p, whole in forward.items():
        for user in p.forward:
            user.replace_input_with(p.node, whole)

    # backward: the forward buckets, with what backward reads of them (directly or through views)
    position = {n: i for i, n in enumerate(graph.nodes)}
    backward_first: dict[ShardedParam, fx.Node] = {}
    for p in params:
        reads = list(p.backward)
        if p in forward:
            reads += [u for v in _forward_views(forward[p]) for u in v.users if u.meta.get("phase") == "backward"]
        if reads:
            backward_first[p] = min(reads, key=position.__getitem__)
    unbucketed = [p for p in params if p in backward_first and p not in forward]   # never read in forward
    back_buckets = [b if whole_buckets and any(p in backward_first for p in b) else
                    [p for p in b if p in backward_first] for b in buckets] + [[p] for p in unbucketed]
    back_buckets = [b for b in back_buckets if b]
    back_buckets.sort(key=lambda b: min(position[backward_first[p]] for p in b if p in backward_first))
    back_first = [min((backward_first[p] for p in b if p in backward_first), key=position.__getitem__)
                  for b in back_buckets]
    # backward usually first reads the bucket forward read last: its forward copies are kept for
    # it (as FSDP2 keeps its root module's parameters) rather than freed and gathered again
    kept = {p: forward[p] for p in back_buckets[0]} if back_buckets and buckets and \
        set(back_buckets[0]) <= set(buckets[-1]) else {}
    backward = _gather_in_order(emit, graph, back_buckets, back_first, world, group, "backward", kept)
    position = {n: i for i, n in enumerate(graph.nodes)}
    recomputed = 0
    for p in params:
        for user in p.backward:
            user.replace_input_with(p.node, backward[p])
        if p in forward and p not in kept:
            recomputed += _recompute_backward_reads(graph, p, forward[p], backward.get(p), position)
    gathered = back_buckets[1:] if kept else back_buckets
    return GatherReport(tuple(sum(p.numel for p in b) for b in buckets),
                        tuple(sum(p.numel for p in b) for b in gathered), recomputed,
                        tuple(p.name for p in read_in_forward), tuple(p.name for p in kept))
