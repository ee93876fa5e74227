"""eliminate_dead_code: drop nodes whose values nobody reads and that have no side effect.

Tracing leaves `detach` and view nodes behind that nothing uses; they cost nothing to run but
clutter every dump. A node is kept when it writes into any of its arguments (its schema says
so: optimizer updates, the model's own in-place ops), draws random numbers, or is marked
impure, so side effects survive without relying on node order. A collective's wait is kept
even when its value is unread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from graphoffload.graph import TrainGraph

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext


def _has_side_effect(node: fx.Node) -> bool:
    if node.target is torch.ops._c10d_functional.wait_tensor.default:
        # completes its collective: one of a coalesced all-reduce's waits may go unread, and
        # dropping it would leave that work pending on the process group
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    # a random op advances the generator even when its value is unused: dropping it would
    # shift every later draw
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or node.is_impure()


def eliminate_dead_code(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    removed = 0
    for node in reversed(list(graph.graph.nodes)):
        if node.op != "call_function" or node.users or _has_side_effect(node):
            continue
        graph.graph.erase_node(node)
        removed += 1
    graph.note("eliminate_dead_code", f"removed {removed} unused nodes", "removed", nodes=removed)
    return graph
