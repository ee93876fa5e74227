"""Liveness-based memory analysis of a TrainGraph: bytes live at each node, predicted peak.

Every node output either aliases an argument (views, in-place ops: the op schema says so) or
owns a new storage. A storage lives from the node that creates it to the last node that reads
it or any alias of it; graph outputs live to the end. Inputs (parameters, buffers, optimizer
state, the batch) are owned by the user and count as resident for the whole step; inputs the
signature places in host memory (offloaded state) are not counted. Sizes are
rounded up to the CUDA caching allocator's 512-byte blocks, so the prediction is comparable
with `torch.cuda.max_memory_allocated`. Later passes (fusion, offload) plan against this.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from itertools import accumulate
from operator import attrgetter

import torch

from graphoffload.aliasing import StorageMap
from graphoffload.graph import TrainGraph

_BLOCK = 512
_name = attrgetter("name")


def block_bytes(t: torch.Tensor) -> int:
    """Bytes of `t`'s storage as the CUDA caching allocator hands them out (512-byte blocks)."""
    try:
        n = t.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - some fake tensors have no storage
        n = t.numel() * t.element_size()
    return -(-n // _BLOCK) * _BLOCK


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


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


def storage_span(storages: StorageMap, sid: int, on_host: Collection[str]) -> tuple[int, tuple[int, int] | None]:
    """(device bytes, (first, last) position it is live at) of storage `sid`, as the analysis
    counts it: a placeholder or constant is resident (span None; 0 bytes when the signature
    places it on the host), a storage the step's outputs read lives to the end."""
    creator = storages.creator[sid]
    val = creator.meta["val"]
    tensor = val if isinstance(val, torch.Tensor) else next(v for v, i in zip(val, storages.ids[creator]) if i == sid)
    if creator.op in ("placeholder", "get_attr"):
        return (0 if creator.op == "placeholder" and creator.name in on_host else _bytes(tensor, storages)), None
    # a storage's accesses are recorded in node order: its last is the last one
    last = len(storages.nodes) if sid in storages.output_reads else storages.accesses[sid][-1].position
    return _bytes(tensor, storages), (storages.position[creator], last)


def _bytes(tensor: torch.Tensor, storages: StorageMap) -> int:
    """block_bytes, kept in the map's StorageCache where it has one: a planner analyses each
    edit of one graph, whose values stay the same tensors."""
    if storages.cache is None:
        return block_bytes(tensor)
    sizes = storages.cache.sizes
    found = sizes.get(id(tensor))
    if found is None:
        found = sizes[id(tensor)] = (tensor, block_bytes(tensor))
    return found[1]


def analyze_memory(graph: TrainGraph, storages: StorageMap | None = None) -> MemoryProfile:
    """`storages`: the graph's StorageMap when the caller has it already (a planner that
    analyses many edits of one graph), else built here. Each storage is counted as
    storage_span counts it, in one loop (a planner analyses every edit of a graph of tens of
    thousands of storages: a call per storage was a tenth of its time)."""
    storages = storages or StorageMap(graph.graph)
    nodes = storages.nodes
    on_host = {s.name for s in graph.signature.inputs if s.host}
    end = len(nodes)
    delta = [0] * (end + 2)
    resident = 0
    ids, position, accesses, output_reads = storages.ids, storages.position, storages.accesses, storages.output_reads
    sizes = storages.cache.sizes if storages.cache is not None else None
    Tensor = torch.Tensor
    for sid, creator in enumerate(storages.creator):
        val = creator.meta["val"]
        tensor = val if isinstance(val, Tensor) else next(v for v, i in zip(val, ids[creator]) if i == sid)
        op = creator.op
        if op == "placeholder" and creator.name in on_host:
            continue   # in host memory: no device bytes
        if sizes is None:
            nbytes = block_bytes(tensor)
        else:
            found = sizes.get(id(tensor))
            if found is None:
                found = sizes[id(tensor)] = (tensor, block_bytes(tensor))
            nbytes = found[1]
        if op == "placeholder" or op == "get_attr":
            resident += nbytes
            continue
        # a storage's accesses are recorded in node order: its last is the last one
        delta[position[creator]] += nbytes
        delta[(end if sid in output_reads else accesses[sid][-1][0]) + 1] -= nbytes
    if not end:
        return MemoryProfile((), (), resident, resident, "")
    live = tuple(accumulate(delta[:end], initial=resident))[1:]
    peak_i = live.index(max(live))   # the first node at the peak
    return MemoryProfile(tuple(map(_name, nodes)), live, resident, live[peak_i], nodes[peak_i].name)


def without_recompute(graph: TrainGraph) -> TrainGraph:
    """The step as it would run without activation checkpointing, for comparing memory: every
    recomputed node whose forward twin (`meta["recompute_of"]`) is in the graph is dropped and
    its readers read the twin, so the forward's values live until backward reads them, as
    eager keeps them without checkpointing. A recomputed node with no twin left (a detach, an
    output of a multi-output op that forward did not read) stays where it is, now reading
    forward values, which keeps them alive just as long."""
    copy = graph.copy()
    by_name = {n.name: n for n in copy.graph.nodes}
    for node in list(copy.graph.nodes):
        twin = by_name.get(node.meta["recompute_of"]) if "recompute_of" in node.meta else None
        if twin is not None and "recompute" in node.meta:
            node.replace_all_uses_with(twin)
            copy.graph.erase_node(node)
    return copy
