"""offload_optimizer: keep optimizer state in host memory and run the updates on the CPU.

ZeRO-Offload style, per update bucket (fuse_optimizer's buckets, so transfers start during
backward as soon as a bucket's gradients are final): the fp32 master weights and optimizer
moments of every parameter live in pinned host memory; the bucket's gradients are copied
device-to-host, the CPU updates the master weights with the same fused kernel torch.optim uses
(`_fused_adamw_` & co. on CPU tensors), and the updated weights go back host-to-device,
narrowed through a pinned staging buffer when the parameters are bf16/fp16. Each step is an
explicit node (runtime/host_offload.py), so the printed graph shows the schedule.

The device then holds parameters, activations and gradients in flight only. The pass checks
the predicted device peak against `Offload.gpu_memory_budget` and fails at compile time, with
the minimum the step needs, when the budget cannot be met.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from graphoffload.errors import UnsupportedError
from graphoffload.graph import InputSpec, TrainGraph, fake_mode_of
from graphoffload.memory import analyze_memory, format_bytes
from graphoffload.passes.update_kernels import UpdateKernel, find_update_kernels
from graphoffload.runtime import host_offload  # noqa: F401  (registers the ops)

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

ops = torch.ops.graphoffload
MASTER_DTYPE = torch.float32


def _host_placeholder(graph: TrainGraph, specs: list[InputSpec], spec: InputSpec, like: torch.Tensor,
                      dtype: torch.dtype) -> fx.Node:
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    with graph.graph.inserting_after(placeholders[-1]):
        node = graph.graph.placeholder(spec.name)
    with fake_mode_of(graph.graph):
        node.meta["val"] = torch.empty(like.shape, dtype=dtype, device="cpu")
    node.meta.update({"phase": "input", "param": (spec.target[0],)})
    specs.append(spec)
    return node


def _move_to_host(node: fx.Node, dtype: torch.dtype | None) -> None:
    val = node.meta["val"]
    with fake_mode_of(node.graph):
        node.meta["val"] = torch.empty(val.shape, dtype=dtype or val.dtype, device="cpu")


def _host_lr(lr: fx.Node) -> fx.Node:
    # the lowering copies the lr to the device for device kernels; the host update reads the input
    return lr if lr.op == "placeholder" else lr.all_input_nodes[0]


def offload_optimizer(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    offload = ctx.config.offload
    g = graph.graph
    kernels = find_update_kernels(g)
    if not kernels:
        graph.note("offload_optimizer", "no optimizer update in the step: nothing to offload")
        return graph
    specs = list(graph.signature.inputs)
    spec_of = {s.name: i for i, s in enumerate(specs)}
    output = g.output_node()
    moved_bytes = 0
    for k in kernels:
        names = [spec.target for spec in (specs[spec_of[p.name]] for p in k.params)]
        masters, host_grads, staging = [], [], []
        for name, param, grad in zip(names, k.params, k.grads):
            pv, gv = param.meta["val"], grad.meta["val"]
            safe = "".join(c if c.isalnum() else "_" for c in name)
            masters.append(_host_placeholder(graph, specs, InputSpec(
                "state", f"s_master_param_{safe}", (name, "master_param"), True, True), pv, MASTER_DTYPE))
            host_grads.append(_host_placeholder(graph, specs, InputSpec(
                "host_scratch", f"h_grad_{safe}", (name, "grad"), True, True), pv, gv.dtype))
            if pv.dtype != MASTER_DTYPE:
                staging.append(_host_placeholder(graph, specs, InputSpec(
                    "host_scratch", f"h_upload_{safe}", (name, "upload"), True, True), pv, pv.dtype))
            moved_bytes += pv.numel() * 4
        for state in k.state_placeholders():
            i = spec_of[state.name]
            specs[i] = InputSpec(specs[i].kind, specs[i].name, specs[i].target, True, True)
            _move_to_host(state, None if specs[i].target[1] == "step" else MASTER_DTYPE)
            moved_bytes += state.meta["val"].numel() * 4
        meta = {key: k.node.meta[key] for key in ("param", "subgroup", "bucket", "stack_trace") if key in k.node.meta}
        with g.inserting_before(k.first_node):
            to_host = g.call_function(ops.copy_to_host.default, (list(k.grads), host_grads))
            update = k.emit_host_update(g, to_host, masters, host_grads, _host_lr)
            to_device = g.call_function(ops.copy_to_device.default, (update, masters, staging, list(k.params)))
        with g.inserting_before(output):
            waited = g.call_function(ops.wait_device.default, (to_device, list(k.params)))
        for node, phase in ((to_host, "transfer"), (update, "optimizer"), (to_device, "transfer"), (waited, "transfer")):
            node.meta.update(meta)
            node.meta["phase"] = phase
        k.erase()
    graph = graph.with_signature(inputs=tuple(specs))

    device_peak = analyze_memory(graph).peak
    graph.note("offload_optimizer", f"{len(kernels)} update buckets offloaded: {format_bytes(moved_bytes)} of "
               f"master weights and optimizer state in host memory; predicted device peak "
               f"{format_bytes(device_peak)}")
    budget = offload.budget_bytes()
    if budget is not None and device_peak > budget:
        raise UnsupportedError(
            f"gpu_memory_budget {offload.gpu_memory_budget} cannot be met: with its optimizer state "
            f"offloaded the step still needs at least {format_bytes(device_peak)} ({device_peak:,} bytes) "
            "on the device (parameters, activations and gradients in flight). Raise the budget, or "
            "reduce the batch or sequence length.")
    return graph
