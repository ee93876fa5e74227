"""zero: shard the optimizer update (ZeRO stage 1) and the gradients (stage 2) over the ranks
of a `ZeRO` group, each rank training on its own micro-batch.

The captured step computes this rank's gradients and updates every parameter. This pass cuts
the parameters' gradients into buckets in the order backward produces them (`bucket_numel`
elements at most, one dtype each) and gives each parameter one owning rank, balanced within
every bucket (`graphoffload.data_parallel.bucket_owners`). Then, per bucket:

* **Gradients**, right after the bucket's last one is produced: stage 1 all-reduces them
  (`_c10d_functional.all_reduce_coalesced` + `wait_tensor`), so every rank holds every averaged
  gradient, as with DDP; stage 2 packs them rank by rank into one flat buffer (each rank's part
  padded to the largest) and reduce-scatters it (`reduce_scatter_tensor`), so a rank receives
  the averaged gradients of its own parameters only and the others die after the pack.
* **The update** kernels keep this rank's own parameters alone (their step counters too); the
  optimizer-state inputs of the others leave the graph, so the compiled step never allocates
  them (`optimizer.state` holds this rank's parameters only, as with torch's
  ZeroRedundancyOptimizer).
* **Parameters**, after the last update: each rank packs its updated parameters of the bucket
  the same way, one `all_gather_into_tensor` brings every rank's, and the parameters this rank
  does not own are overwritten from it (`copy_`), so every rank ends the step with the same
  full parameters.

Gradients are averaged (summed, then divided by the ranks: gloo has no average); the loss the
step returns stays the rank's own. Collectives are emitted in bucket order at positions every
rank's graph shares, so all ranks issue them in the same order. What the pass cannot shard yet
(gradients read besides the update: clipping, GradScaler, skip_nonfinite; with stage 2,
`.grad` left set after the step) is refused with `UnsupportedError`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from graphoffload.aliasing import written_args, written_placeholders
from graphoffload.bucketing import greedy_buckets
from graphoffload.data_parallel import bucket_owners
from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.errors import UnsupportedError
from graphoffload.graph import TrainGraph, fake_mode_of
from graphoffload.passes.update_kernels import UpdateKernel, update_kernels_to_rewrite

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass
class _Item:
    """One parameter of an update kernel: what the pass moves and where it sits in its bucket."""

    kernel: UpdateKernel
    index: int                  # in the kernel's lists
    name: str
    param: fx.Node
    grad: fx.Node
    owner: int = 0
    offset: int = 0             # where it starts in its owner's part of the bucket's flat buffer

    @property
    def numel(self) -> int:
        return self.param.meta["val"].numel()


@dataclass
class _Bucket:
    items: list[_Item]
    part: int = 0               # elements of each rank's (padded) part of the flat buffers


class _Emitter:
    """Inserts nodes with `meta["val"]` computed on the graph's fake tensors and a phase."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.fake_mode = fake_mode_of(graph)

    def __call__(self, target: Any, args: tuple, like: fx.Node, phase: str = "comm",
                 param: tuple[str, ...] | None = None) -> fx.Node:
        node = self.graph.call_function(target, args)
        fake_args = fx.map_arg(node.args, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args)
        node.meta["phase"] = phase
        if "stack_trace" in like.meta:
            node.meta["stack_trace"] = like.meta["stack_trace"]
        if param is not None:
            node.meta["param"] = param
        return node


def _items(kernels: list[UpdateKernel], output: fx.Node, stage: int) -> list[_Item]:
    """Every parameter the kernels update, after checking that nothing else reads its gradient."""
    readers = set().union(*({k.node, *k.nodes} for k in kernels))
    items = []
    for k in kernels:
        if k.found_inf is not None or k.grad_scale is not None:
            raise UnsupportedError("ZeRO data parallelism with a GradScaler or skip_nonfinite=True is not "
                                   "supported yet: the inf checks would need every rank's gradients")
        names = k.node.meta.get("param") or tuple(f"#{i}" for i in range(len(k.params)))
        for i, (param, grad) in enumerate(zip(k.params, k.grads)):
            if grad.meta.get("phase") != "backward" or written_args(grad):   # e.g. clipping's mul_
                raise UnsupportedError(
                    f"ZeRO data parallelism: the gradient of {names[i]} is changed by {grad.name} ({grad.target}) at "
                    f"{_line(grad)} between backward and optimizer.step() (e.g. clip_grad_norm_); changing or "
                    "reading gradients inside a ZeRO step is not supported yet")
            for user in grad.users:
                if user in readers:
                    continue
                if user is output and stage == 1:   # .grad left set: the averaged gradient, as DDP leaves it
                    continue
                if user is output:
                    raise UnsupportedError(
                        f"ZeRO stage 2 keeps only this rank's own gradients, but the step leaves {names[i]}.grad "
                        "set after it returns: call optimizer.zero_grad() at the end of the step, or use "
                        "ZeRO(stage=1)")
                raise UnsupportedError(
                    f"ZeRO data parallelism: the gradient of {names[i]} is read by {user.name} ({user.target}) at "
                    f"{_line(user)} besides optimizer.step() (e.g. clip_grad_norm_); changing or reading gradients "
                    "inside a ZeRO step is not supported yet")
            items.append(_Item(k, i, names[i], param, grad))
    return items


def _line(node: fx.Node) -> str:
    return user_line_of_stack_trace(node.meta.get("stack_trace")) or "an unknown line"


def _layout(items: list[_Item], position: dict[fx.Node, int], bucket_numel: int, world: int) -> list[_Bucket]:
    """Buckets in the order their gradients become final, owners and offsets in the flat buffers."""
    ordered = sorted(items, key=lambda it: (position[it.grad], it.kernel.node.name, it.index))
    groups = greedy_buckets(ordered, lambda it: it.numel, bucket_numel,
                            key=lambda it: (it.grad.meta["val"].dtype, it.param.meta["val"].dtype))
    buckets = []
    for group, owners in zip(groups, bucket_owners([[it.numel for it in g] for g in groups], world)):
        loads = [0] * world
        for it, owner in zip(group, owners):
            it.owner, it.offset = owner, loads[owner]
            loads[owner] += it.numel
        buckets.append(_Bucket(group, max(loads)))
    return buckets


def _pack(emit: _Emitter, bucket: _Bucket, tensor_of: Any, ranks: range) -> fx.Node:
    """One flat buffer: for each rank of `ranks`, its items' tensors flattened, padded to the part size."""
    pieces = []
    like = tensor_of(bucket.items[0])
    for r in ranks:
        mine = [it for it in bucket.items if it.owner == r]
        pieces += [emit(aten.reshape.default, (tensor_of(it), [-1]), like) for it in mine]
        pad = bucket.part - sum(it.numel for it in mine)
        if pad:
            pieces.append(emit(aten.new_zeros.default, (like, [pad]), like))
    return emit(aten.cat.default, (pieces,), like)


def _piece(emit: _Emitter, flat: fx.Node, start: int, it: _Item) -> fx.Node:
    part = emit(aten.slice.Tensor, (flat, 0, start, start + it.numel), it.grad, param=(it.name,))
    return emit(aten.view.default, (part, list(it.param.meta["val"].shape)), it.grad, param=(it.name,))


def _reduce_gradients(emit: _Emitter, bucket: _Bucket, stage: int, rank: int, world: int,
                      group: str) -> dict[fx.Node, fx.Node]:
    """Stage 1: every gradient averaged; stage 2: this rank's own. Returns grad -> its average."""
    last = bucket.items[-1].grad
    averaged = {}
    if stage == 1:
        grads = [it.grad for it in bucket.items]
        red = emit(c10d.all_reduce_coalesced.default, (grads, "sum", group), last)
        for i, it in enumerate(bucket.items):
            item = emit(operator.getitem, (red, i), it.grad, param=(it.name,))
            wait = emit(c10d.wait_tensor.default, (item,), it.grad, param=(it.name,))
            averaged[it.grad] = emit(aten.div.Scalar, (wait, world), it.grad, param=(it.name,))
        return averaged
    flat = _pack(emit, bucket, lambda it: it.grad, range(world))
    red = emit(c10d.reduce_scatter_tensor.default, (flat, "sum", world, group), last)
    mine = emit(aten.div.Scalar, (emit(c10d.wait_tensor.default, (red,), last), world), last)
    for it in bucket.items:
        if it.owner == rank:   # a tensor of its own: fusion treats the update's gradients as written,
            # so views of one buffer would chain every update of the bucket after the one before
            averaged[it.grad] = emit(aten.clone.default, (_piece(emit, mine, it.offset, it),), it.grad,
                                     param=(it.name,))
    return averaged


def _gather_parameters(emit: _Emitter, bucket: _Bucket, rank: int, world: int, group: str) -> int:
    """All-gather the bucket's updated parameters; overwrite those this rank does not own."""
    flat = _pack(emit, bucket, lambda it: it.param, range(rank, rank + 1))
    gathered = emit(c10d.wait_tensor.default,
                    (emit(c10d.all_gather_into_tensor.default, (flat, world, group), flat),), flat)
    others = [it for it in bucket.items if it.owner != rank]
    for it in others:
        emit(aten.copy_.default, (it.param, _piece(emit, gathered, it.owner * bucket.part + it.offset, it)),
             it.param, param=(it.name,))
    return len(others)


def _keep_own(k: UpdateKernel, own: list[int]) -> None:
    """Cut the kernel (and its step counters) down to the parameters at `own`; erase it if none."""
    if not own:
        k.erase()
        return
    node = k.node
    args = list(node.args)
    for pos in k.rule.list_positions:
        if node.args[pos]:
            args[pos] = [node.args[pos][i] for i in own]
    dropped_copies = [s for i, s in enumerate(k.step_copies()) if i not in own]
    node.args = tuple(args)
    if node.meta.get("param"):
        node.meta["param"] = tuple(node.meta["param"][i] for i in own)
    if k.counter is not None:
        kept = set(k.step_placeholders())
        k.counter.args = ([s for s in k.counter.args[0] if s in kept], *k.counter.args[1:])
    for copy in dropped_copies:
        if not copy.users:
            node.graph.erase_node(copy)


def zero(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    dp = ctx.config.data_parallel
    if dp is None:
        return graph
    kernels = update_kernels_to_rewrite(graph, "zero", "shard")
    if not kernels:
        return graph
    g = graph.graph
    rank, world, group = dp.rank, dp.world_size, dp.group_name
    output = next(n for n in g.nodes if n.op == "output")
    items = _items(kernels, output, dp.stage)
    position = {n: i for i, n in enumerate(g.nodes)}
    buckets = _layout(items, position, dp.bucket_numel, world)
    emit = _Emitter(g)

    # gradients: each bucket's collective right after its last gradient; the update (and, with
    # stage 1, the step's outputs) read the averages instead
    readers = {it.grad: list(it.grad.users) for it in items}
    for bucket in buckets:
        last = max((it.grad for it in bucket.items), key=position.__getitem__)
        with g.inserting_before(last.next):   # (inserting_after would put each new node first)
            averaged = _reduce_gradients(emit, bucket, dp.stage, rank, world, group)
        for grad, avg in averaged.items():
            for user in readers[grad]:
                user.replace_input_with(grad, avg)

    # updates: this rank's own parameters only; the others' state leaves the graph
    last_kernel = max((k.node for k in kernels), key=position.__getitem__)
    resume = last_kernel.next
    for k in kernels:
        _keep_own(k, [it.index for it in items if it.kernel is k and it.owner == rank])
    placeholders = graph.placeholders()
    unread = {s.name for s in graph.signature.inputs if s.kind == "state" and not placeholders[s.name].users}
    for name in unread:
        g.erase_node(placeholders[name])

    # parameters: gathered after the last update, in bucket order
    copied = 0
    with g.inserting_before(resume):
        for bucket in buckets:
            copied += _gather_parameters(emit, bucket, rank, world, group)
    g.lint()
    graph.gm.recompile()
    written = written_placeholders(g)
    inputs = tuple(s if s.mutable or s.name not in written else type(s)(s.kind, s.name, s.target, True)
                   for s in graph.signature.inputs if s.name not in unread)
    graph = graph.with_signature(inputs=inputs)

    own = [it for it in items if it.owner == rank]
    total, mine = sum(it.numel for it in items), sum(it.numel for it in own)
    padded = sum(b.part for b in buckets) * world
    collective = "all-reduce" if dp.stage == 1 else "reduce-scatter"
    graph.note("zero", f"ZeRO stage {dp.stage}, rank {rank} of {world}: owns {len(own)} of {len(items)} parameters "
               f"({mine:,} of {total:,} elements); {len(buckets)} gradient buckets, one {collective} and one "
               f"all-gather each; {copied} parameters overwritten from their owners; optimizer state inputs of "
               f"{len(unread)} tensors dropped", "shards", stage=dp.stage, rank=rank, world=world,
               buckets=len(buckets), gradient_collective=collective, owned_params=tuple(it.name for it in own),
               params=len(items), owned_numel=mine, numel=total, dropped_state_inputs=len(unread),
               bucket_parts=tuple(b.part for b in buckets), padded_numel=padded)
    if padded > 1.25 * total:
        graph.note("zero", f"the padded buffers hold {padded:,} elements for {total:,} parameter elements: whole "
                   "parameters are owned, and a bucket with few of them cannot be split evenly; larger "
                   "ZeRO(bucket_numel=...) buckets balance better", "padding", padded_numel=padded, numel=total)
    return graph

