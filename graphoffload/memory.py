"""Liveness-based memory analysis of a TrainGraph: bytes live at each node, predicted peak.

Every node output either aliases an argument (views, in-place ops: the op schema says so) or
owns a new storage. A storage lives from the node that creates it to the last node that reads
it or any alias of it; graph outputs live to the end. Inputs (parameters, buffers, optimizer
state, the batch) are owned by the user and count as resident for the whole step. Sizes are
rounded up to the CUDA caching allocator's 512-byte blocks, so the prediction is comparable
with `torch.cuda.max_memory_allocated`. Later passes (fusion, offload) plan against this.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from graphoffload.graph import TrainGraph

_BLOCK = 512


def _nbytes(t: torch.Tensor) -> int:
    try:
        n = t.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - some fake tensors have no storage
        n = t.numel() * t.element_size()
    return -(-n // _BLOCK) * _BLOCK


@dataclass(frozen=True)
class MemoryProfile:
    """Predicted memory of one run of a graph, in bytes."""

    nodes: tuple[str, ...]
    live: tuple[int, ...]         # bytes live while each node runs (inputs, outputs, resident)
    resident: int                 # placeholders: parameters, buffers, state, batch
    peak: int
    peak_node: str

    def live_at(self, node_name: str) -> int:
        return self.live[self.nodes.index(node_name)]


def _aliased_arg(node: fx.Node, ret_index: int):
    """The argument value (node or list of nodes) output `ret_index` of `node` aliases, if any."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or ret_index >= len(schema.returns):
        return None
    ret = schema.returns[ret_index].alias_info
    if ret is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and set(arg.alias_info.before_set) & set(ret.before_set):
            return node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
    return None


def analyze_memory(graph: TrainGraph) -> MemoryProfile:
    nodes = [n for n in graph.graph.nodes if n.op != "output"]
    sids: dict[fx.Node, list[int | None]] = {}   # node -> storage id of each of its outputs
    size: list[int] = []
    born: list[int] = []
    resident_ids: set[int] = set()

    def new_storage(t: torch.Tensor, at: int) -> int:
        size.append(_nbytes(t))
        born.append(at)
        return len(size) - 1

    def storage_of(value) -> int | None:
        return sids[value][0] if isinstance(value, fx.Node) and sids.get(value) else None

    for i, node in enumerate(nodes):
        val = node.meta.get("val")
        if node.op == "placeholder":
            sids[node] = [new_storage(val, 0)] if isinstance(val, torch.Tensor) else [None]
            resident_ids.update(s for s in sids[node] if s is not None)
            continue
        if node.target is operator.getitem:
            src, j = node.args
            sids[node] = [sids[src][j] if j < len(sids.get(src, [])) else None]
            continue
        outs = val if isinstance(val, (list, tuple)) else [val]
        schema = getattr(node.target, "_schema", None)
        single_return = schema is not None and len(schema.returns) == 1
        sids[node] = []
        for j, out in enumerate(outs):
            if not isinstance(out, torch.Tensor):
                sids[node].append(None)
                continue
            alias = _aliased_arg(node, 0 if single_return else j)
            if isinstance(alias, (list, tuple)):
                alias = alias[j] if j < len(alias) else None
            sid = storage_of(alias)
            sids[node].append(new_storage(out, i) if sid is None else sid)

    last = list(born)
    for i, node in enumerate(nodes):
        for inp in node.all_input_nodes:
            for sid in sids.get(inp, []):
                if sid is not None:
                    last[sid] = max(last[sid], i)
    end = len(nodes)
    for out in graph.graph.output_node().all_input_nodes:
        for sid in sids.get(out, []):
            if sid is not None:
                last[sid] = end

    delta = [0] * (end + 2)
    for sid, nbytes in enumerate(size):
        if sid not in resident_ids:
            delta[born[sid]] += nbytes
            delta[last[sid] + 1] -= nbytes
    resident = sum(size[s] for s in resident_ids)
    live, running = [], resident
    for i in range(end):
        running += delta[i]
        live.append(running)
    if not live:
        return MemoryProfile((), (), resident, resident, "")
    peak_i = max(range(end), key=live.__getitem__)
    return MemoryProfile(tuple(n.name for n in nodes), tuple(live), resident, live[peak_i],
                         nodes[peak_i].name)
