"""The optimizer update kernels in a graph, as units that scheduling passes move and rewrite.

One rule per fused kernel (which arguments are per-parameter lists, which is the step
counter list, and its host variant), and `UpdateKernel`: a kernel node with the
`_foreach_add_` that increments its step counters and the device copies of those counters.
fuse_optimizer splits and moves these units; offload_optimizer turns them into host updates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx

if TYPE_CHECKING:
    from graphoffload.graph import TrainGraph

aten = torch.ops.aten
graphoffload_ops = torch.ops.graphoffload


def _host_adam(decoupled: bool) -> Callable:
    def emit(g: fx.Graph, k: UpdateKernel, after: fx.Node, masters: list[fx.Node], host_grads: list[fx.Node],
             lr: fx.Node, scaling: tuple[fx.Node | None, ...]) -> fx.Node:
        kw = k.node.kwargs
        return g.call_function(graphoffload_ops.host_adam_.default, (
            after, masters, host_grads, list(k.node.args[2]), list(k.node.args[3]), list(k.node.args[4]),
            k.step_placeholders(), lr, kw["beta1"], kw["beta2"], kw["weight_decay"], kw["eps"], kw["amsgrad"],
            kw["maximize"], decoupled, *scaling))
    return emit


def _host_sgd(g: fx.Graph, k: UpdateKernel, after: fx.Node, masters: list[fx.Node], host_grads: list[fx.Node],
              lr: fx.Node, scaling: tuple[fx.Node | None, ...]) -> fx.Node:
    kw = k.node.kwargs
    return g.call_function(graphoffload_ops.host_sgd_.default, (
        after, masters, host_grads, list(k.node.args[2]), lr, kw["weight_decay"], kw["momentum"],
        kw["dampening"], kw["nesterov"], kw["maximize"], kw["is_first_step"], *scaling))


@dataclass(frozen=True)
class KernelRule:
    list_positions: tuple[int, ...]      # per-parameter list arguments
    steps_position: int | None           # the step counters, incremented before the kernel
    emit_host_update: Callable


UPDATE_KERNELS: dict[object, KernelRule] = {
    aten._fused_adamw_: KernelRule((0, 1, 2, 3, 4, 5), 5, _host_adam(decoupled=True)),
    aten._fused_adam_: KernelRule((0, 1, 2, 3, 4, 5), 5, _host_adam(decoupled=False)),
    aten._fused_sgd_: KernelRule((0, 1, 2), None, _host_sgd),
}


def kernel_rule(node: fx.Node) -> KernelRule | None:
    if node.op != "call_function":
        return None
    return UPDATE_KERNELS.get(getattr(node.target, "overloadpacket", None))


@dataclass
class UpdateKernel:
    node: fx.Node
    rule: KernelRule
    counter: fx.Node | None      # `_foreach_add_(steps, 1)` of this kernel, if any
    step_rollback: fx.Node | None = None   # `_foreach_sub_(steps, found_inf)` after it, with a GradScaler:
                                           # takes back the step of an update found_inf skipped

    def emit_counter(self, graph: fx.Graph, steps: list[fx.Node]) -> fx.Node:
        """A copy of this kernel's step-counter increment, on `steps`, at the insertion point."""
        return graph.call_function(self.counter.target, (steps, *self.counter.args[1:]), dict(self.counter.kwargs))

    def emit_step_rollback(self, graph: fx.Graph, steps: list[fx.Node]) -> fx.Node:
        """A copy of this kernel's step rollback (GradScaler), on `steps`, at the insertion point."""
        found_inf = self.step_rollback.args[1][0]
        return graph.call_function(self.step_rollback.target, (steps, [found_inf] * len(steps)))

    @property
    def nodes(self) -> list[fx.Node]:
        """The nodes of the unit besides the kernel (counters and their device copies)."""
        return [n for n in (self.counter, *self.step_copies(), self.step_rollback) if n is not None]

    @property
    def found_inf(self) -> fx.Node | None:
        return self.node.kwargs.get("found_inf")

    @property
    def grad_scale(self) -> fx.Node | None:
        return self.node.kwargs.get("grad_scale")

    @property
    def params(self) -> list[fx.Node]:
        return list(self.node.args[0])

    @property
    def grads(self) -> list[fx.Node]:
        return list(self.node.args[1])

    def param_inputs(self) -> list[fx.Node]:
        """The parameter placeholders the kernel updates: `params` themselves, or, where the
        `zero` pass gave the kernel this rank's rows of a parameter (a `slice` view), the
        placeholder the view is of."""
        out = []
        for p in self.params:
            while p.op != "placeholder" and p.target is aten.slice.Tensor:
                p = p.args[0]
            out.append(p)
        return out

    def step_copies(self) -> list[fx.Node]:
        """Device copies of the step counters (when the counters live elsewhere)."""
        if self.rule.steps_position is None:
            return []
        return [s for s in self.node.args[self.rule.steps_position] if s.op != "placeholder"]

    def step_placeholders(self) -> list[fx.Node]:
        if self.rule.steps_position is None:
            return []
        return [s if s.op == "placeholder" else s.args[0] for s in self.node.args[self.rule.steps_position]]

    def state_placeholders(self) -> list[fx.Node]:
        """Optimizer-state placeholders the kernel updates (moments, momentum, step counters)."""
        out = []
        for pos in self.rule.list_positions[2:]:
            if pos == self.rule.steps_position:
                out += self.step_placeholders()
            else:
                out += list(self.node.args[pos] or [])
        return out

    @property
    def first_node(self) -> fx.Node:
        return self.counter if self.counter is not None else self.node

    def emit_host_update(self, g: fx.Graph, after: fx.Node, masters: list[fx.Node], host_grads: list[fx.Node],
                         host_lr: Callable[[fx.Node], fx.Node],
                         scaling: tuple[fx.Node | None, ...] = (None, None, None)) -> fx.Node:
        """The host variant of the kernel; `scaling`: host copies of (grad_scale, found_inf,
        grad_multiplier), the GradScaler's tensors and a scalar the gradients are multiplied by."""
        return self.rule.emit_host_update(g, self, after, masters, host_grads, host_lr(self.node.kwargs["lr"]),
                                          scaling)

    def erase(self) -> None:
        g = self.node.graph
        copies = self.step_copies()
        if self.step_rollback is not None:
            g.erase_node(self.step_rollback)
        g.erase_node(self.node)
        for copy in copies:
            if not copy.users:
                g.erase_node(copy)
        if self.counter is not None:
            g.erase_node(self.counter)


def _sole_node(candidates: set) -> fx.Node | None:
    """The one node all candidates agree on, or None when they differ or one is missing."""
    return next(iter(candidates)) if len(candidates) == 1 and None not in candidates else None


def find_update_kernels(graph: fx.Graph) -> list[UpdateKernel]:
    counters: dict[fx.Node, fx.Node] = {}     # step-counter placeholder -> its `_foreach_add_`
    rollbacks: dict[fx.Node, fx.Node] = {}   # ... -> its `_foreach_sub_` (skipped steps)
    for node in graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        for table, op in ((counters, aten._foreach_add_), (rollbacks, aten._foreach_sub_)):
            if packet is op:
                for t in node.args[0]:
                    table[t] = node
    out = []
    for node in graph.nodes:
        rule = kernel_rule(node)
        if rule is None:
            continue
        counter = rollback = None
        if rule.steps_position is not None:
            roots = [s if s.op == "placeholder" else s.args[0] for s in node.args[rule.steps_position]]
            counter = _sole_node({counters.get(r) for r in roots})
            if node.kwargs.get("found_inf") is not None:
                rollback = _sole_node({rollbacks.get(r) for r in roots})
        out.append(UpdateKernel(node, rule, counter, rollback))
    return out


def update_kernels_to_rewrite(graph: TrainGraph, pass_name: str, verb: str) -> list[UpdateKernel]:
    """The step's update kernels, for a pass that rewrites them; when there are none, the pass
    notes that it has nothing to `verb` (and returns the graph unchanged)."""
    kernels = find_update_kernels(graph.graph)
    if not kernels:
        graph.note(pass_name, f"no optimizer update in the step: nothing to {verb}")
    return kernels
