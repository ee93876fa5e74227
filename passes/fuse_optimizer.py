"""fuse_optimizer: run each parameter's update inside backward, as soon as its gradient is final.

Eagerly, every gradient lives until `optimizer.step()`, so the end of backward holds the whole
gradient set beside the optimizer state. This pass splits each subgroup's fused update kernel
into buckets of parameters whose gradients become final close together in backward, and moves
each bucket's update to the earliest point where it computes exactly what it computed before:
after the last write of its gradients (their producer, gradient accumulation, clipping) and
after the last read of the parameters and state it overwrites (the backward of a matmul still
reads its weight). Its gradients then die there. The fused kernels are elementwise per tensor,
so splitting a kernel's tensor lists changes no result bit.

What keeps an update late is reported per bucket in `explain()`. Global-norm clipping
(`clip_grad_norm_` in the step) scales every gradient by a factor that needs all of them, so
with it every update waits for the end of backward and the gradients are not freed early:
exact results cost the memory win. The pass still moves what need not wait: the norm of each
gradient is computed right after that gradient is final, inside backward, so after backward
only the total norm, the scaling and the updates remain (the `park_gradients` pass, opt-in,
keeps the waiting gradients in host memory meanwhile). A gradient read after its update
(e.g. left on `param.grad` because the step zeroes gradients first) stays alive until that read
even though its update moved; explain() lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import operator
from dataclasses import dataclass

import torch
from torch import fx

from graphoffload.aliasing import StorageMap, written_args
from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.graph import TrainGraph
from graphoffload.bucketing import greedy_buckets
from graphoffload.passes.update_kernels import UpdateKernel, update_kernels_to_rewrite

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

aten = torch.ops.aten

@dataclass
class _Update:
    """One parameter's slice of an update kernel and where it could run."""

    index: int
    name: str
    numel: int
    anchor: fx.Node             # the update must come after this node
    held_by: str | None         # what reads the gradient after the original update, if anything


def _latest(storages: StorageMap, nodes: list[fx.Node]) -> fx.Node:
    return max(nodes, key=storages.position.__getitem__)


def _plan_updates(storages: StorageMap, k: UpdateKernel) -> list[_Update]:
    """For each parameter of the kernel, the latest node its update must follow."""
    kernel, counter = k.node, k.counter
    list_pos, steps_pos = k.rule.list_positions, k.rule.steps_position
    kernel_pos = storages.position[kernel]
    own = {kernel, *k.nodes}
    scalars = [n for n in kernel.kwargs.values() if isinstance(n, fx.Node)]
    # and every write to them: a GradScaler's found_inf is set by each gradient's inf check
    scalars += [a.node for n in list(scalars) for sid in storages.of(n) for a in storages.accesses[sid]
                if a.writes and a.position < kernel_pos and a.node not in own]
    updates = []
    for i, param in enumerate(kernel.args[0]):
        must_follow = list(scalars)
        for pos in list_pos:
            if not kernel.args[pos]:
                continue
            value = kernel.args[pos][i]
            if pos == steps_pos and value.op != "placeholder":
                value = value.args[0]   # a device copy of the counter: it moves along
            # the kernel (or the counter, for state_steps) overwrites every list it gets
            writes = pos != steps_pos or counter is not None
            for sid in storages.of(value):
                for acc in storages.accesses[sid]:
                    if acc.node not in own and acc.position < kernel_pos and (acc.writes or writes):
                        must_follow.append(acc.node)
        grad = kernel.args[1][i]
        late = [a.node for sid in storages.of(grad) for a in storages.accesses[sid]
                if a.position > kernel_pos and a.node not in own]
        held_by = _describe(late[0]) if late else \
            "the step's outputs (param.grad)" if set(storages.of(grad)) & storages.output_reads else None
        name = (kernel.meta.get("param") or ("?",) * len(kernel.args[0]))[i]
        updates.append(_Update(i, name, param.meta["val"].numel(), _latest(storages, must_follow), held_by))
    return updates


def _hoist_scalar_inputs(graph: fx.Graph, kernels: list[fx.Node]) -> None:
    """Move the kernels' scalar inputs computed from placeholders alone (the lr copied to the
    device) to the top, so they do not pin the updates after them."""
    storages = StorageMap(graph)
    top = _AfterPlaceholders(graph)
    for kernel in kernels:
        for value in kernel.kwargs.values():
            chain: list[fx.Node] = []
            if isinstance(value, fx.Node) and _early_chain(value, storages, storages.position[kernel], chain):
                top.move(chain)


def _buckets(updates: list[_Update], position: dict[fx.Node, int], bucket_numel: int) -> list[list[_Update]]:
    """Group updates that become ready in order, at most `bucket_numel` elements a bucket."""
    ordered = sorted(updates, key=lambda u: (position[u.anchor], u.index))
    return greedy_buckets(ordered, lambda u: u.numel, bucket_numel)


def _emit_bucket(graph: fx.Graph, k: UpdateKernel, bucket: list[_Update], after: fx.Node, number: int) -> fx.Node:
    kernel, counter = k.node, k.counter
    list_pos, steps_pos = k.rule.list_positions, k.rule.steps_position
    idx = sorted(u.index for u in bucket)
    args = list(kernel.args)
    for pos in list_pos:
        args[pos] = [kernel.args[pos][i] for i in idx] if kernel.args[pos] else []
    names = tuple(kernel.meta["param"][i] for i in idx) if kernel.meta.get("param") else None
    meta = {"phase": "optimizer", "subgroup": kernel.meta.get("subgroup"), "bucket": number,
            "val": None, "stack_trace": kernel.meta.get("stack_trace")}
    if names:
        meta["param"] = names
    last = after
    if counter is not None:
        steps = [s if s.op == "placeholder" else s.args[0] for s in args[steps_pos]]
        with graph.inserting_after(last):
            new_counter = k.emit_counter(graph, steps)
        new_counter.meta.update(meta)
        last = new_counter
        for s in args[steps_pos]:   # device copies of the counters follow their increment
            if s.op != "placeholder":
                last.append(s)
                last = s
    with graph.inserting_after(last):
        new_kernel = graph.call_function(kernel.target, tuple(args), dict(kernel.kwargs))
    new_kernel.meta.update(meta)
    if k.step_rollback is not None:   # GradScaler: the steps of a skipped update do not count
        steps = [s if s.op == "placeholder" else s.args[0] for s in args[steps_pos]]
        with graph.inserting_after(new_kernel):
            rollback = k.emit_step_rollback(graph, steps)
        rollback.meta.update(meta)
    return new_kernel


def _describe(node: fx.Node) -> str:
    where = user_line_of_stack_trace(node.meta.get("stack_trace"))
    return f"{node.name} [{node.meta.get('phase')}]" + (f" at {where}" if where else "")


_COLLECTIVES = {"all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce",
                "reduce_scatter_tensor": "reduce-scatter"}


def _collective_before(node: fx.Node) -> str | None:
    """Which gradient collective `node` ends ("all-reduce", "reduce-scatter"), when it is the
    collective's wait or what the pass that emitted it computes from it (an average, a slice)."""
    while node.meta.get("phase") == "comm":
        name = getattr(node.target, "__name__", "").split(".")[0]
        if name in _COLLECTIVES:
            return _COLLECTIVES[name]
        inputs = node.all_input_nodes
        if not inputs:
            return None
        node = inputs[0]
    return None


def _is_pure(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and not written_args(node) and torch.Tag.nondeterministic_seeded not in tags


# foreach ops that compute each tensor on its own: one call over many gradients equals one call per
# gradient, bit for bit. Reductions return a list; scalings write their list in place.
_PER_TENSOR_FOREACH = {aten._foreach_norm, aten._foreach_mul_, aten._foreach_div_,
                       aten._amp_foreach_non_finite_check_and_unscale_}


def _split_foreach_gradient_ops(graph: fx.Graph) -> None:
    """`_foreach_norm(grads)` and `_foreach_mul_(grads, clip_coef)` over many gradients become
    one call per gradient, so each norm can run as soon as its own gradient is final and each
    scaling next to its own bucket's update."""
    for node in list(graph.nodes):
        if getattr(node.target, "overloadpacket", None) not in _PER_TENSOR_FOREACH or \
                node.meta.get("phase") != "optimizer" or len(node.args[0]) < 2:
            continue
        n = len(node.args[0])
        parts = []
        for i in range(n):
            # list arguments of the same length (`_foreach_mul_.List`) split along with the tensors
            args = tuple([a[i]] if isinstance(a, (list, tuple)) and len(a) == n else a for a in node.args)
            with graph.inserting_before(node):
                part = graph.call_function(node.target, args, dict(node.kwargs))
            part.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            if node.users:
                with graph.inserting_before(node):
                    item = graph.call_function(operator.getitem, (part, 0))
                item.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                parts.append(item)
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(parts[user.args[1]])
                graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)


class _AfterPlaceholders:
    """Where nodes computed from placeholders alone go: right after the placeholders, in the
    order they are moved (inputs first)."""

    def __init__(self, graph: fx.Graph):
        self.last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        self.moved: set[fx.Node] = set()

    def move(self, chain: list[fx.Node]) -> None:
        for node in chain:
            if node not in self.moved:
                self.last.append(node)
                self.last = node
                self.moved.add(node)


def _early_chain(node: fx.Node, storages: StorageMap, before: int, chain: list[fx.Node]) -> bool:
    """Whether `node` can be computed right after the placeholders instead of where it is, for a
    reader at position `before`: it is pure, and every value it reads is one nothing writes
    before that reader (a placeholder, or a node that can move too; those are appended to
    `chain`, inputs first). A placeholder `node` itself must not be written before either."""
    if node.op == "placeholder":
        return not _written_before(node, storages, before)
    if node in chain:
        return True
    if not _is_pure(node) or any(_written_before(i, storages, before) or not _early_chain(i, storages, before, chain)
                                 for i in node.all_input_nodes):
        return False
    chain.append(node)
    return True


def _written_before(node: fx.Node, storages: StorageMap, before: int) -> bool:
    return any(a.writes and a.node is not node and a.position < before
               for sid in storages.of(node) for a in storages.accesses[sid])


_INF_CHECK = aten._amp_foreach_non_finite_check_and_unscale_


def _hoist_inf_checks(graph: fx.Graph) -> int:
    """Move a GradScaler's per-gradient inf check and unscale (split by
    _split_foreach_gradient_ops) to right after its gradient's last access in backward. Every
    part sets the shared found_inf flag only to 1, so their order does not matter; its creation
    and the inverse scale, computed from placeholders alone, move to the top first."""
    checks = [n for n in graph.nodes if getattr(n.target, "overloadpacket", None) is _INF_CHECK
              and n.meta.get("phase") == "optimizer" and len(n.args[0]) == 1]
    if not checks:
        return 0   # no GradScaler: no storage map to build (one per pass on a deep model costs)
    storages = StorageMap(graph)
    top = _AfterPlaceholders(graph)
    moved = 0
    for check in checks:
        grad, found_inf, inv_scale = check.args
        grad = grad[0]
        pos = storages.position[check]
        chain: list[fx.Node] = []
        if not (_early_chain(found_inf, storages, pos, chain) and _early_chain(inv_scale, storages, pos, chain)):
            continue
        flag = set(storages.of(found_inf))
        # nothing but other checks may touch the flag before this one
        if any(a.position < pos and a.node is not check and
               getattr(a.node.target, "overloadpacket", None) is not _INF_CHECK and a.node not in chain
               for sid in flag for a in storages.accesses[sid]):
            continue
        top.move(chain)
        accesses = [a.node for sid in storages.of(grad) for a in storages.accesses[sid] if a.position < pos]
        anchor = _latest(storages, accesses + [grad])
        if anchor.next is not check:
            anchor.append(check)
            moved += 1
    return moved


def _hoist_gradient_reductions(graph: fx.Graph) -> int:
    """Move pure post-backward ops that read only gradients (the per-gradient norms of
    clip_grad_norm_) to right after their gradient's last write, inside backward."""
    candidates = [node for node in graph.nodes if node.meta.get("phase") == "optimizer" and _is_pure(node)
                  and node.all_input_nodes and all(i.meta.get("phase") == "backward" for i in node.all_input_nodes)]
    if not candidates:
        return 0   # no storage map to build (one per pass on a deep model costs)
    storages = StorageMap(graph)
    moved = 0
    for node in candidates:
        inputs = node.all_input_nodes
        pos = storages.position[node]
        writes = [a.node for i in inputs for sid in storages.of(i) for a in storages.accesses[sid]
                  if a.writes and a.position < pos]
        anchor = _latest(storages, writes + inputs)
        if anchor.next is not node:
            anchor.append(node)
            moved += 1
    return moved


def fuse_optimizer(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    cfg = ctx.config.fuse_optimizer
    g = graph.graph
    kernels = update_kernels_to_rewrite(graph, "fuse_optimizer", "fuse")
    if not kernels:
        return graph
    total = sum(p.meta["val"].numel() for k in kernels for p in k.params)
    bucket_numel = cfg.bucket_numel or min(max(total // 32, 1 << 16), 1 << 24)
    _hoist_scalar_inputs(g, [k.node for k in kernels])
    _split_foreach_gradient_ops(g)
    checks = _hoist_inf_checks(g)
    if checks:
        graph.note("fuse_optimizer", f"{checks} GradScaler inf checks of single gradients moved into backward, "
                   "each right after its gradient is final (the updates still wait for all of them)")
    hoisted = _hoist_gradient_reductions(g)
    if hoisted:
        graph.note("fuse_optimizer", f"{hoisted} reductions of single gradients (clip_grad_norm_'s norms) "
                   "moved into backward, each right after its gradient is final")
    storages = StorageMap(g)
    backward = [n for n in g.nodes if n.meta.get("phase") == "backward"]
    last_backward = backward[-1] if backward else None
    plans = [(k, _buckets(_plan_updates(storages, k), storages.position, bucket_numel)) for k in kernels]

    number, in_backward, held = 0, 0, []
    for k, buckets in plans:
        for bucket in buckets:
            anchor = _latest(storages, [u.anchor for u in bucket])
            _emit_bucket(g, k, bucket, anchor, number)
            ready_in_backward = last_backward is not None and \
                storages.position[anchor] <= storages.position[last_backward]
            in_backward += ready_in_backward
            names = [u.name for u in bucket]
            label = f"bucket {number}: {names[0]}" + (f" +{len(names) - 1}" if len(names) > 1 else "")
            numel = sum(u.numel for u in bucket)
            if ready_in_backward:
                graph.note("fuse_optimizer", f"{label} ({numel:,} elements) runs in backward after {_describe(anchor)}",
                           "bucket", bucket=number, params=tuple(names), numel=numel, in_backward=True,
                           after=anchor.name)
            elif (collective := _collective_before(anchor)) is not None:
                graph.note("fuse_optimizer", f"{label} ({numel:,} elements) stays after backward: it must follow "
                           f"{_describe(anchor)}, the end of its gradients' {collective}, whose bucket closes "
                           "after the last backward op (smaller SequenceParallel(bucket_numel=...) or "
                           "ZeRO(bucket_numel=...) buckets close earlier)", "bucket", bucket=number,
                           params=tuple(names), numel=numel, in_backward=False, after=anchor.name,
                           waits_for=collective)
            else:
                graph.note("fuse_optimizer", f"{label} ({numel:,} elements) stays after backward: it must follow "
                           f"{_describe(anchor)}, which writes or reads its gradients, parameters or state "
                           "after the last backward op (e.g. global-norm gradient clipping)", "bucket", bucket=number,
                           params=tuple(names), numel=numel, in_backward=False, after=anchor.name,
                           waits_for="after backward")
            held += [f"{u.name} (read by {u.held_by})" for u in bucket if u.held_by]
            number += 1
        for node in (k.step_rollback, k.node, k.counter):
            if node is not None:
                g.erase_node(node)
    graph.note("fuse_optimizer", f"{number} update buckets (bucket_numel={bucket_numel:,}), "
               f"{in_backward} run inside backward", "buckets", buckets=number, in_backward=in_backward,
               bucket_numel=bucket_numel)
    if number - in_backward > 1 and not cfg.park_gradients:
        graph.note("fuse_optimizer", "the gradients of buckets that stay after backward live until their update; "
                   "FuseOptimizer(park_gradients=True) keeps them in host memory meanwhile (exact; costs "
                   "two host transfers of those gradients a step)")
    if held:
        graph.note("fuse_optimizer", "gradients read after their update stay alive until then: " + ", ".join(held))
    return graph
