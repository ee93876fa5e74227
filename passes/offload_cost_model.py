"""Compute-stream time of each node: measured where profiled, else a roofline estimate.

The estimate is max(flops / device_flops, bytes / device_bytes_per_s) with the calibration's
rates; flops are counted for matmuls and graphoffload's attention ops (one rule each, below),
every other op is charged for the bytes it reads and writes. Views move no data. Good enough
to place updates within backward; measured times (`measured`, node name -> seconds) replace
the estimate node by node.
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


def estimate_seconds(node: fx.Node, cal: Calibration) -> float:
    """Roofline time of one node on the device."""
    if node.op != "call_function" or _is_view(node):
        return 0.0
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
    estimates = [estimate_seconds(n, cal) for n in nodes]
    if not measured:
        return estimates
    hits = [(measured[n.name], e) for n, e in zip(nodes, estimates) if n.name in measured]
    scale = sum(m for m, _ in hits) / max(sum(e for _, e in hits), 1e-30) if hits else 1.0
    return [measured.get(n.name, e * scale) for n, e in zip(nodes, estimates)]
