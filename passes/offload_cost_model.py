"""Compute-stream time of each node: measured where profiled, else a roofline estimate.

The estimate is max(flops / device_flops, bytes / device_bytes_per_s) with the calibration's
rates; flops are counted for matmuls and graphoffload's attention ops (one rule each, below),
every other op is charged for the bytes it reads and writes. Views move no data. A collective
(ZeRO's reduce-scatter, all-gather and all-reduce, ring attention's all-reduce) is charged for the
bytes one rank sends in the ring algorithm, at the calibration's `link_bytes_per_s`, on the
compute stream at its launch: the graph waits for it right after (`wait_tensor`), so no overlap
with compute is assumed. Good enough to place updates within backward; measured times
(`measured`, node name -> seconds) replace the estimate node by node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import fx

from graphoffload.aliasing import written_args
from graphoffload.calibration import Calibration
from graphoffload.graph import tensor_vals
from graphoffload.ops.attention import ATTENTION, ATTENTION_BACKWARD

aten = torch.ops.aten


def _shape(node: fx.Node, i: int) -> tuple[int, ...]:
    arg = node.args[i]
    return tuple(arg.meta["val"].shape) if isinstance(arg, fx.Node) else ()


def _attention_flops(node: fx.Node) -> float:
    q, k = _shape(node, 0), _shape(node, 1)
    return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]


FLOP_RULES: dict[object, Callable[[fx.Node], float]] = {
    aten.mm: lambda n: 2.0 * math.prod(_shape(n, 0)) * _shape(n, 1)[-1],
    aten.addmm: lambda n: 2.0 * math.prod(_shape(n, 1)) * _shape(n, 2)[-1],
    aten.bmm: lambda n: 2.0 * math.prod(_shape(n, 0)) * _shape(n, 1)[-1],
    aten.baddbmm: lambda n: 2.0 * math.prod(_shape(n, 1)) * _shape(n, 2)[-1],
    ATTENTION.overloadpacket: _attention_flops,
    ATTENTION_BACKWARD.overloadpacket: lambda n: 2.5 * _attention_flops(n),
}


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and all(
        r.alias_info is not None for r in schema.returns) and not written_args(node)


c10d = torch.ops._c10d_functional
# per collective: (index of its group size argument or None, bytes one rank sends in the ring
# algorithm as a multiple of its input's bytes, from the group size N)
_RING: dict[object, tuple[int | None, Callable[[int], float]]] = {
    c10d.reduce_scatter_tensor.default: (2, lambda n: (n - 1) / n),
    c10d.all_gather_into_tensor.default: (1, lambda n: n - 1.0),
    c10d.all_reduce.default: (None, lambda n: 2 * (n - 1) / n),
    c10d.all_reduce_coalesced.default: (None, lambda n: 2 * (n - 1) / n),
}


def collective_bytes(node: fx.Node, sizes: Mapping[str, int] | None = None) -> int | None:
    """Bytes one rank sends for a functional collective (None: not a collective). The group size
    is read from the node where it says it (reduce-scatter, all-gather), else from `sizes` (group
    name -> size, `group_sizes`), else bounded (an all-reduce sends under twice its bytes)."""
    ring = _RING.get(node.target)
    if ring is None:
        return None
    position, factor = ring
    n = node.args[position] if position is not None else (sizes or {}).get(node.args[-1])
    vals = [t for arg in (node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]])
            for t in tensor_vals(arg)]
    nbytes = sum(t.numel() * t.element_size() for t in vals)
    return int(nbytes * (factor(n) if n else 2.0))


def group_sizes(graph: fx.Graph) -> dict[str, int]:
    """Group name -> size, from the collectives of `graph` that name both (an all-reduce names
    only its group)."""
    out = {}
    for node in graph.nodes:
        ring = _RING.get(node.target)
        if ring is not None and ring[0] is not None:
            out[node.args[ring[0] + 1]] = node.args[ring[0]]
    return out


def estimate_seconds(node: fx.Node, cal: Calibration, sizes: Mapping[str, int] | None = None) -> float:
    """Roofline time of one node on the device; a collective's on the link (`sizes`: the group
    sizes of `group_sizes`)."""
    if node.op != "call_function" or _is_view(node):
        return 0.0
    if node.target in _RING:
        return collective_bytes(node, sizes) / cal.link_bytes_per_s
    rule = FLOP_RULES.get(getattr(node.target, "overloadpacket", None))
    flops = rule(node) if rule else 0.0
    nbytes = sum(t.numel() * t.element_size() for t in tensor_vals(node))
    nbytes += sum(t.numel() * t.element_size() for i in node.all_input_nodes for t in tensor_vals(i))
    return max(flops / cal.device_flops, nbytes / cal.device_bytes_per_s)


def node_seconds(graph: fx.Graph, cal: Calibration, measured: Mapping[str, float] | None = None) -> list[float]:
    """Seconds each node (every node but the output, in graph order) keeps the compute stream
    busy. Measured nodes take their measured time; the others take the estimate scaled by how
    far the estimate was off on the measured ones, so a wrong calibration is corrected too."""
    nodes = [n for n in graph.nodes if n.op != "output"]
    sizes = group_sizes(graph)
    estimates = [estimate_seconds(n, cal, sizes) for n in nodes]
    if not measured:
        return estimates
    hits = [(measured[n.name], e) for n, e in zip(nodes, estimates) if n.name in measured]
    scale = sum(m for m, _ in hits) / max(sum(e for _, e in hits), 1e-30) if hits else 1.0
    return [measured.get(n.name, e * scale) for n, e in zip(nodes, estimates)]
