"""park_gradients: gradients whose update must wait past backward wait in host memory instead.

After fuse_optimizer an update runs as soon as its gradients are final, except where the step
reads every gradient before any update: global-norm clipping (`clip_grad_norm_`) scales each
gradient by a factor computed from all of them, so every update, and every gradient, waits for
the end of backward and the memory fusion saves is spent again. This pass copies each such
gradient to a pinned host buffer right after its last read in backward (fusion has moved its
norm there), so its device memory is freed while backward runs, and brings the gradients back
one bucket ahead of their update: after backward only two buckets of gradients are on the
device. The data makes an exact round trip, so results do not change.

The cost: each parked gradient crosses the host link twice. The copy out overlaps backward;
the copy back runs after it, one bucket ahead of the updates, and is only partly hidden
(about gradient bytes / host-to-device bandwidth, e.g. 2.7 GB of bf16 gradients at 55 GB/s:
~50 ms a step). Opt in with `FuseOptimizer(park_gradients=True)`; explain() lists what was
parked and why anything was not.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx

from graphoffload.aliasing import StorageMap
from graphoffload.graph import InputSpec, TrainGraph, fill_missing_meta, placeholder_name
from graphoffload.memory import analyze_memory, format_bytes
from graphoffload.ops.host_transfer import assign_streams
from graphoffload.passes.update_kernels import UpdateKernel, find_update_kernels

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

ops = torch.ops.graphoffload


@dataclass
class _Parked:
    """One gradient to park: the node to copy from, after which node, and the nodes after
    backward that read it (they read the restored copy instead)."""

    param: str
    storage: int
    source: fx.Node
    aliases: set[fx.Node]      # the values made in backward that those nodes read it through
    after: fx.Node
    readers: list[fx.Node]
    host: fx.Node | None = None      # its host buffer and the ticket of the copy there, once emitted
    ticket: fx.Node | None = None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def _plan_parking(storages: StorageMap, grad: fx.Node, param: str, end: int,
                  output: fx.Node) -> _Parked | str:
    """How to park one gradient, or why it cannot be parked."""
    sids = storages.of(grad)
    if len(sids) != 1:
        return "its value is not one tensor"
    sid = sids[0]
    creator = storages.creator[sid]
    if creator.op != "call_function" or storages.position[creator] > end:
        return "it is not produced in backward"
    accesses = storages.accesses[sid]
    early = [a for a in accesses if a.position <= end]
    readers = sorted({a.node for a in accesses if a.position > end}, key=storages.position.__getitem__)
    if sid in storages.output_reads:
        readers.append(output)
    # the nodes after backward read the gradient through values made in backward: one contiguous
    # view, so that a contiguous restored copy can stand in for it
    aliases = {i for r in readers for i in r.all_input_nodes
               if sid in storages.of(i) and storages.position.get(i, end + 1) <= end}
    vals = [a.meta.get("val") for a in aliases]
    if not vals or not all(isinstance(v, torch.Tensor) and v.is_contiguous() and _same_view(v, vals[0])
                           for v in vals):
        return "it is read after backward through a strided or partial view"
    source = max(aliases, key=storages.position.__getitem__)
    after = max((a.node for a in early), key=storages.position.__getitem__)
    if storages.position[after] >= end:
        return "it is final only at the end of backward"
    return _Parked(param, sid, source, aliases, after, readers)


def _reads_other_buckets(reader: fx.Node, own: set[int], storages: StorageMap, parked: set[int]) -> bool:
    return any(s in parked and s not in own for i in reader.all_input_nodes for s in storages.of(i))


def park_gradients(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    if ctx.config.offload is not None:
        graph.note("park_gradients", "left to offload_optimizer, whose host updates take waiting gradients "
                   "to the host as soon as they are final")
        return graph
    g = graph.graph
    storages = StorageMap(g)
    backward = [n for n in g.nodes if n.meta.get("phase") == "backward"]
    if not backward:
        graph.note("park_gradients", "no backward in the step: nothing to park")
        return graph
    end = storages.position[backward[-1]]
    output = g.output_node()
    waiting = [k for k in find_update_kernels(g) if storages.position[k.first_node] > end]
    if not waiting:
        graph.note("park_gradients", "every update runs inside backward: no gradient waits, nothing to park")
        return graph
    before_peak = analyze_memory(graph).peak

    plans: list[tuple[UpdateKernel, list[_Parked]]] = []
    for k in waiting:
        names = k.node.meta.get("param") or tuple(p.name for p in k.params)
        bucket = []
        for grad, name in zip(k.grads, names):
            plan = _plan_parking(storages, grad, name, end, output)
            if isinstance(plan, str):
                graph.note("park_gradients", f"{name}: stays on the device: {plan}")
            else:
                bucket.append(plan)
        if bucket:
            plans.append((k, bucket))
    # a node after backward that reads gradients of several buckets (a GradScaler's unscale of
    # all gradients) would need them all back at once: parking those saves nothing
    parked_sids = {p.storage for _, bucket in plans for p in bucket}
    kept_plans = []
    for k, bucket in plans:
        own = {p.storage for p in bucket}
        shared = [p for p in bucket if any(_reads_other_buckets(r, own, storages, parked_sids) for r in p.readers)]
        for p in shared:
            graph.note("park_gradients", f"{p.param}: stays on the device: read after backward together "
                       "with other buckets' gradients (e.g. by a GradScaler's unscale_)")
        bucket = [p for p in bucket if p not in shared]
        if bucket:
            kept_plans.append((k, bucket))
    if not kept_plans:
        graph.note("park_gradients", "no gradient waits past backward: nothing to park")
        return graph

    specs = list(graph.signature.inputs)
    device = ctx.device
    parked_bytes = 0
    for _, bucket in kept_plans:
        for p in bucket:
            val = p.source.meta["val"]
            p.host = graph.add_host_input(specs, InputSpec(
                "host_scratch", placeholder_name("h_parked_grad", p.param), (p.param, "parked_grad"), True, True),
                val.shape, val.dtype, p.param)
            with g.inserting_after(p.after):
                p.ticket = g.call_function(ops.copy_to_host.default, ([p.source], [p.host]))
            p.ticket.meta.update({"phase": "transfer", "param": (p.param,)})
            parked_bytes += val.numel() * val.element_size()

    # each bucket comes back while the bucket before it is scaled and updated
    position = storages.position
    first_reader = [min((r for p in bucket for r in p.readers if r is not output), key=position.__getitem__)
                    for _, bucket in kept_plans]
    for j, (k, bucket) in enumerate(kept_plans):
        issue_at = min(first_reader[max(j - 1, 0)], first_reader[j], key=position.__getitem__)
        meta = {"phase": "transfer", "param": tuple(p.param for p in bucket), "bucket": k.node.meta.get("bucket")}
        with g.inserting_before(issue_at):
            # the copy back waits for the copies out in stream order: the host never blocks here
            fetched = g.call_function(ops.prefetch_to_device.default,
                                      ([p.host for p in bucket], device, [p.ticket for p in bucket]))
            items = [g.call_function(operator.getitem, (fetched, i)) for i in range(len(bucket) + 1)]
        with g.inserting_before(first_reader[j]):
            waited = g.call_function(ops.wait_device.default, (items[-1], items[:-1]))
        for node in (fetched, *items, waited):
            node.meta.update(meta)
        for p, restored in zip(bucket, items):
            for reader in p.readers:
                for alias in p.aliases & set(reader.all_input_nodes):
                    reader.replace_input_with(alias, restored)

    assign_streams(graph.graph)   # node.meta["stream"] of its copies
    graph = graph.with_signature(inputs=tuple(specs))
    fill_missing_meta(graph, "park_gradients")
    after_peak = analyze_memory(graph).peak
    count = sum(len(b) for _, b in kept_plans)
    graph.note("park_gradients", f"{count} gradients ({format_bytes(parked_bytes)}) in {len(kept_plans)} waiting "
               f"buckets parked in host memory during backward, each bucket brought back one bucket ahead "
               f"of its update; predicted device peak {format_bytes(before_peak)} -> {format_bytes(after_peak)}",
               "parked", gradients=count, bytes=parked_bytes, buckets=len(kept_plans), peak_before=before_peak,
               peak_after=after_peak)
    return graph
