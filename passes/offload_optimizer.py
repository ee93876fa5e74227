"""offload_optimizer: keep optimizer state in host memory and run the updates on the CPU.

ZeRO-Offload style, per update bucket (fuse_optimizer's buckets, so transfers start during
backward as soon as a bucket's gradients are final): the fp32 master weights and optimizer
moments of every parameter live in pinned host memory; the bucket's gradients are copied
device-to-host, the CPU updates the master weights with the same fused kernel torch.optim uses
(`_fused_adamw_` & co. on CPU tensors), and the updated weights go back host-to-device,
narrowed through a pinned staging buffer when the parameters are bf16/fp16. Each step is an
explicit node (runtime/host_offload.py), so the printed graph shows the schedule. When the step
makes every update wait past backward (global-norm clipping, a GradScaler's inf checks), each
gradient still leaves as soon as it is final, and the host applies clipping's clip_coef: only
scalars follow after backward (as DeepSpeed's ZeRO-Offload clips on the host).

Where `Offload.device_updates` allows (default "auto" on a GPU), a performance model picks,
per bucket, the device path instead (passes/offload_planner.py): the bucket's state is
prefetched into device buffers while backward runs, the original fused kernel updates it when
its gradients are final (so they never leave the device), and the state goes back to the host.
explain() lists each bucket's path, predicted start and end, and bytes moved.

With `accumulation_steps` and `Offload(accumulate_on="host")` the running gradient sums live on the
host too, in fp32 (passes/host_accumulation.py): every bucket takes the CPU path, an accumulating
call sends each gradient there as soon as it is final, and the updating call adds the sums on the
host before the update. explain() notes where the sums live (`grad_sums`, and `grad_sum` per bucket).

Under ZeRO (the `zero` pass ran first) the update kernels already read this rank's rows of each
parameter (slice views), its gradient chunks and chunk-shaped state, so the same rewrite offloads
the rank's chunks only: master weights and host scratch take the chunks' shapes, and the first
read of a CPU-path bucket's rows after its update is the all-gather's pack, so its upload is
waited for there (`wait_device`) before the parameters are gathered. Under stage 3 the kernels'
parameters are the rank's row placeholders themselves (nothing is gathered after the update):
the upload writes the rows and, as nothing in the step reads them after it, is waited for before
the step's output, so the next call's gathers and the user's reads find them written. With clip_grad_norm_ the
`zero` pass has already made the norm global (one all-reduce) and the scaling act on the chunks:
each chunk goes to the host when final and the host applies the coefficient, as without ZeRO.
The planner charges the
collectives on the timeline (offload_cost_model.py) and notes them (`collectives`).

The device then holds parameters, activations, gradients and prefetched state in flight only. The pass checks
the predicted device peak against `Offload.gpu_memory_budget` and fails at compile time, with
the minimum the step needs, when the budget cannot be met.
"""

from __future__ import annotations

import logging
import operator
import sys
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import fx

from graphoffload.aliasing import StorageMap
from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.errors import HostSumsUnsupportedError, PassError, UnsupportedError
from graphoffload.graph import (InputSpec, TrainGraph, fake_mode_of, fake_value, fill_missing_meta, host_fake,
                                placeholder_name, tensor_vals)
from graphoffload.memory import analyze_memory, format_bytes
from graphoffload.torch_private import empty_fake
from graphoffload.calibration import Calibration
from graphoffload.passes.offload_activations import (ActivationPlan, largest_saved_bytes, place_on_schedule,
                                                     plan_activations, retimed_costs)
from graphoffload.passes.offload_cost_model import collective_bytes, group_sizes, node_seconds
from graphoffload.passes.offload_planner import SWEEPS, BucketCost, Prediction, StepCosts, StepModel, plan, predict
from graphoffload.passes.offload_plan_cache import (activation_key, load_activations, load_plan, plan_key, plan_path,
                                                    store_activations, store_plan)
from graphoffload import aliasing, memory
from graphoffload.passes import (host_accumulation, offload_activation_edits, offload_activation_gathers,
                                 offload_activations, offload_cost_model, offload_planner, update_kernels)
from graphoffload.passes.offload_activation_edits import EditsMismatch, NotRecordable
from graphoffload.ops.host_transfer import assign_streams
from graphoffload.passes.host_accumulation import (AUTO_SUMS_HINT, HostNorm, accumulate_on_host, candidate_groups,
                                                   check_on_host, combine_host_flags, drain_host_sums, drain_on_host, lift_check,
                                                   move_sums_to_host, norm_on_host, place_sums, read_on_device,
                                                   trial_context, wait_for_sums)
from graphoffload.passes.update_kernels import UpdateKernel, find_update_kernels, update_kernels_to_rewrite

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

aten = torch.ops.aten
ops = torch.ops.graphoffload
MASTER_DTYPE = torch.float32
log = logging.getLogger("graphoffload")


# CUDA libraries allocate workspaces through the caching allocator (cuBLAS and cuBLASLt: up to
# 32 MiB per stream on Hopper) that no graph node accounts for: plans keep this much of the
# budget free, so measured peaks stay within it
CUDA_WORKSPACE_RESERVE = 64 << 20


def unseen_device_bytes(g: fx.Graph, device: torch.device) -> dict[str, int]:
    """Device memory the CUDA caching allocator holds that no graph node's value accounts for,
    as modelled terms (all 0 off CUDA; the budget check and explain() add them to the predicted
    peak):

    - cublas_workspace: cuBLAS/cuBLASLt workspaces, created by the first matmul and kept;
    - attention_backward: flash/efficient attention backward keeps an fp32 accumulator of
      B*S*H*D*4 bytes (the query's size in fp32) while it runs: the largest one;
    - copy_held: a tensor copied to the host on the copy stream is kept from reuse by
      `record_stream` until its copy ends, after the graph's last reader freed it: the largest
      single copy's device bytes.
    """
    if device.type != "cuda":
        return {"cublas_workspace": 0, "attention_backward": 0, "copy_held": 0}
    attention = max((n.args[1].meta["val"].numel() * 4 for n in g.nodes
                     if n.target is torch.ops.graphoffload.attention_backward.default), default=0)
    copies = [sum(t.meta["val"].numel() * t.meta["val"].element_size() for t in n.args[0]
                  if t.meta["val"].device.type == "cuda")
              for n in g.nodes if n.target is ops.copy_to_host.default]
    return {"cublas_workspace": CUDA_WORKSPACE_RESERVE, "attention_backward": attention,
            "copy_held": max(copies, default=0)}


def _prefetch_value(g: fx.Graph, host: list[fx.Node], device: torch.device) -> list | None:
    """`prefetch_to_device(host, device, [])`'s value, as its fake kernel gives it (a device
    tensor per host tensor, as `empty_like` makes it, then the ticket, an int64 scalar on the
    host), made by the constructor fake `empty` ends in (`torch_private.empty_fake`, as
    `graph.host_fake` makes host values): the kernel run under the mode cost 0.6-0.7 ms a
    bucket, this 0.13 ms (benchmarks/RESULTS.md).
    None where `empty_like` would not give what `empty` does (a host value that is not a
    fake tensor of the graph's mode, not strided, or not laid out as `empty` lays it out):
    then the fake kernel makes it."""
    mode = fake_mode_of(g)
    out = []
    for node in host:
        val = node.meta.get("val")
        if getattr(val, "fake_mode", None) is not mode or val.layout != torch.strided or val.numel() == 0:
            return None
        fetched = empty_fake(mode, val.shape, val.dtype, device)
        if fetched.stride() != val.stride():   # `empty_like` keeps a dense tensor's strides
            return None
        out.append(fetched)
    return out + [empty_fake(mode, (), torch.int64, torch.device("cpu"))]


def _planning_budget(ctx: PassContext, unseen: int | None = None) -> int | None:
    """The budget left to what the liveness analysis sees. `unseen`: the modelled bytes it
    misses (unseen_device_bytes); None: only the cuBLAS workspaces'."""
    budget = ctx.config.offload.budget_bytes()
    if budget is None or ctx.device.type != "cuda":
        return budget
    return budget - (CUDA_WORKSPACE_RESERVE if unseen is None else unseen)


def _move_to_host(node: fx.Node, dtype: torch.dtype | None) -> None:
    val = node.meta["val"]
    node.meta["val"] = host_fake(node.graph, val.shape, dtype or val.dtype)


def _host_lr(lr: fx.Node) -> fx.Node:
    # the lowering copies the lr to the device for device kernels; the host update reads the input
    return lr if lr.op == "placeholder" else lr.all_input_nodes[0]


def _tag(nodes: list[fx.Node], meta: dict, phase: str) -> None:
    """Stamp nodes this pass just made, inputs first: the caller's meta, `phase`, and, unless the
    caller set one, `meta["val"]` on the graph's fake tensors (filled when a node is made, as every
    pass does, so a helper or analysis run before the pass ends never meets a node without one)."""
    for node in nodes:
        node.meta.update(meta)
        node.meta["phase"] = phase
        if "val" not in node.meta:
            node.meta["val"] = fake_value(node)


@dataclass
class _EarlyGradients:
    """A bucket whose update waits past backward (for clip_grad_norm_'s norm, a GradScaler's
    inf checks) while its gradients are final inside backward: each can go to the host there.
    When the step multiplies them by one scalar after backward (clip_coef) and nothing else
    reads them after it, the host update does that multiply."""

    sources: list[fx.Node]     # each gradient, as it is when final (before any scaling)
    final_at: list[fx.Node]    # its last access before that
    scalings: list[fx.Node]    # the device scaling nodes the host multiply replaces
    multiplier: fx.Node | None


def _scaling_operands(node: fx.Node, storage: int, storages: StorageMap) -> tuple[fx.Node, fx.Node] | None:
    """(gradient, scalar) when `node` multiplies the gradient in `storage` in place by a scalar."""
    if node.target not in (aten.mul_.Tensor, aten._foreach_mul_.Tensor):
        return None
    source, multiplier = node.args
    source = source[0] if isinstance(source, (list, tuple)) and len(source) == 1 else source
    mval = getattr(multiplier, "meta", {}).get("val")
    if isinstance(source, fx.Node) and storage in storages.of(source) and \
            isinstance(mval, torch.Tensor) and mval.dim() == 0:
        return source, multiplier
    return None


def _find_early_gradients(storages: StorageMap, k: UpdateKernel, end: int, keep: bool = False
                          ) -> _EarlyGradients | None:
    """`end`: the position of the last backward node. `keep`: copy the gradients as they are
    final even when that is the end of backward (host inf checks must run before the update)."""
    if storages.position[k.first_node] <= end:
        return None   # the update runs inside backward: its one copy right before it is early enough
    unit = {k.node, *k.nodes}
    found = _EarlyGradients([], [], [], None)
    for grad, param in zip(k.grads, k.params):
        sids = storages.of(grad)
        if len(sids) != 1 or sids[0] in storages.output_reads:
            return None
        accesses = [a for a in storages.accesses[sids[0]] if a.node not in unit]
        source, final_at = grad, accesses[-1]
        operands = _scaling_operands(accesses[-1].node, sids[0], storages)
        if operands is not None:
            if len(accesses) < 2 or (found.sources and found.multiplier is None):
                return None
            source, multiplier = operands
            if found.multiplier not in (None, multiplier):
                return None
            found.scalings.append(accesses[-1].node)
            found.multiplier, final_at = multiplier, accesses[-2]
        elif found.multiplier is not None:
            return None
        sval = source.meta.get("val")
        if not (isinstance(sval, torch.Tensor) and sval.is_contiguous() and sval.shape == param.meta["val"].shape):
            return None
        found.sources.append(source)
        found.final_at.append(final_at.node)
    if not keep and found.multiplier is None and min(storages.position[n] for n in found.final_at) >= end:
        return None   # all final at the end of backward: the bucket's one copy before its update is as early
    return found


def _why_after_backward(storages: StorageMap, k: UpdateKernel, found: _EarlyGradients) -> str:
    """What keeps an update past backward, from the graph: the latest node it depends on (a
    data edge, or a write into one of its gradients), named as the user wrote it."""
    unit = {k.node, *k.nodes}
    first = storages.position[k.first_node]
    inputs = [i for nd in unit for i in nd.all_input_nodes if i not in unit and i.op != "placeholder"]
    writes = [a.node for gr in k.grads for sid in storages.of(gr) for a in storages.accesses[sid]
              if a.writes and a.node not in unit and a.position < first]
    culprit = max(inputs + writes, key=storages.position.__getitem__, default=None)
    if "bucket" not in k.node.meta:
        return "because fuse_optimizer is disabled (every update runs after backward)"
    if found.multiplier is not None:
        what = "clip_grad_norm_'s global norm"
    elif k.found_inf is not None:
        what = "a GradScaler's inf checks of every gradient"
    elif culprit is not None and culprit.meta.get("phase") == "backward":
        param = (culprit.meta.get("param") or ("",))[0]
        what = f"the gradient{f' of {param}' if param else ''}, final only at the end of backward"
    else:
        what = f"{getattr(culprit.target, '__name__', culprit.target)}" if culprit is not None else "its inputs"
    where = user_line_of_stack_trace(culprit.meta.get("stack_trace")) if culprit is not None else None
    return f"for {what}" + (f" ({where})" if where else "")


def _emit_cpu_path(g: fx.Graph, k: UpdateKernel, masters: list[fx.Node], host_grads: list[fx.Node],
                   staging: list[fx.Node], scaling: dict[str, tuple[fx.Node, fx.Node]], meta: dict,
                   early: _EarlyGradients | None, hand_over: tuple[str, fx.Node] | None,
                   read_after: fx.Node | None, host_sums: list[tuple[str, fx.Node]],
                   norms: list[tuple[HostNorm, fx.Node]], device: torch.device,
                   checks: list[tuple[fx.Node, fx.Node, fx.Node]]) -> list[tuple[fx.Node, fx.Node, bool]]:
    """`scaling`: "grad_scale"/"found_inf"/"grad_multiplier" -> (device, host) nodes of a
    GradScaler's tensors and of the scalar in `early`, copied with the gradients so the host
    update can unscale, skip and scale.

    With `early`, each gradient goes to the host as soon as it is final, inside backward (and
    the host applies the scaling after backward): the device frees it there instead of keeping
    it until the update. The update's ticket is the scalars' copy, issued after every
    gradient's on the same in-order copy stream, so when it is done they all are.

    With `hand_over` = (key, node) (Offload.overlap_next_step), the step does not wait for the
    upload: it hands it over under `key`, and the next step waits for it before `node`, its
    forward's first reader of the bucket's parameters.

    With `read_after` (the first node that reads the bucket's parameters after the update: a
    weight norm logged after optimizer.step()), the step waits for the upload right before
    that node and never hands it over.

    With `host_sums` (Offload.accumulate_on="host", the updating call): the running sums of the
    bucket's gradients ((parameter, placeholder), in the gradients' order), which the worker adds
    into their host copies (and zeroes) before the update. Each copy into a sum's host buffer
    first waits for the add into that sum the last accumulating call handed over.

    With `norms` ((clip_grad_norm_'s norm, its 0-d host scratch) per gradient, with `early` and
    `host_sums`): each gradient's drain runs right after its early copy, and its norm is taken on
    the host from the accumulated gradient and brought back for the global norm
    (`host_accumulation.norm_on_host`); the update then finds its gradients drained.

    With `checks` ((the copy of inv_scale that replaced the device inf check, the 0-d host flag,
    the host inv_scale) per gradient, with `early` and `host_sums`): likewise each gradient's
    drain runs right after its early copy and the worker checks and unscales the accumulated
    gradient there (`host_accumulation.check_on_host`), before its norm when it has one. Returns,
    per check, (its host flag, its ticket, False), or with a norm (its host flag, the flag's
    device value fetched with the norm, True), for `combine_host_flags`."""
    parked, sum_waits, checked = [], [], []
    if early is not None:
        for i, (source, final_at, host) in enumerate(zip(early.sources, early.final_at, host_grads)):
            with g.inserting_after(final_at):
                parked.append(g.call_function(ops.copy_to_host.default, ([source], [host])))
            if host_sums:
                sum_waits += wait_for_sums(g, parked[-1], host_sums[i:i + 1], [host])
            if norms or checks:
                last = drain_on_host(g, parked[-1], host_sums[i][1], host, meta)
                if checks:   # the check unscales in place: before the norm, as scaler.unscale_ runs before clipping
                    last = check_on_host(g, checks[i][0], last, host, checks[i][1], checks[i][2], meta)
                if norms:
                    along = norm_on_host(g, norms[i][0], last, host, norms[i][1], device, meta,
                                         checks[i][1] if checks else None)
                    if checks:
                        checked.append((checks[i][1], along, True))
                elif checks:
                    checked.append((checks[i][1], last, False))
    with g.inserting_before(k.first_node):
        grads = [] if early is not None else k.grads
        to_host = g.call_function(ops.copy_to_host.default, (
            grads + [d for d, _ in scaling.values()], ([] if early is not None else host_grads) +
            [h for _, h in scaling.values()]))
        if host_sums and early is None:
            sum_waits += wait_for_sums(g, to_host, host_sums, host_grads)
        summed = [g.call_function(ops.host_accumulate_.default, (to_host, [s for _, s in host_sums], host_grads,
                                                                 True))] if host_sums and not norms and not checks \
            else []
        update = k.emit_host_update(g, summed[0] if summed else to_host, masters, host_grads, _host_lr,
                                    tuple(scaling[key][1] if key in scaling else None
                                          for key in ("grad_scale", "found_inf", "grad_multiplier")))
        to_device = g.call_function(ops.copy_to_device.default, (update, masters, staging, k.params))
    waits = []
    with g.inserting_before(read_after or g.output_node()):
        if hand_over is None or read_after is not None:
            waits.append(g.call_function(ops.wait_device.default, (to_device, k.params)))
        else:
            key, first_reader = hand_over
            waits.append(g.call_function(ops.hand_over.default, (to_device, k.params, key)))
            with g.inserting_before(first_reader):
                waits.append(g.call_function(ops.wait_handed_over.default, (k.params, key)))
    _tag([*sum_waits, *parked, to_host], meta, "transfer")
    _tag([*summed, update], meta, "optimizer")
    _tag([to_device, *waits], meta, "transfer")
    return checked


def _emit_device_path(g: fx.Graph, k: UpdateKernel, masters: list[fx.Node], prefetch_after: fx.Node,
                      device: torch.device, meta: dict, carry: bool) -> None:
    """Prefetch the bucket's state, update it on the device with the original kernel when its
    gradients are final, write the state (and the master weights) back to the host.

    The step's end waits on the host for the write-back to land (`wait_host`), unless `carry`
    (Offload.overlap_next_step): then the copy lands after the step returns
    (`carry_host_write`), and only its readers wait for it -- the next step's prefetch of the
    same state in stream order, `synchronize()` before outside access on the host."""
    states = [list(k.node.args[pos] or []) if pos != k.rule.steps_position else k.step_placeholders()
              for pos in k.rule.list_positions[2:]]
    narrow = masters and masters[0].meta["val"].dtype != k.params[0].meta["val"].dtype
    host = [t for lst in states for t in lst] + (masters if narrow else [])
    if prefetch_after.op == "placeholder":   # new placeholders (the master weights) go there too
        prefetch_after = next(nd for nd in g.nodes if nd.op != "placeholder").prev
    with g.inserting_after(prefetch_after):
        fetched = g.call_function(ops.prefetch_to_device.default, (host, device, []))
    value = _prefetch_value(g, host, device)
    if value is not None:   # else fill_missing_meta runs the fake kernel
        fetched.meta["val"] = value
    with g.inserting_after(fetched):
        items = [g.call_function(operator.getitem, (fetched, i)) for i in range(len(host) + 1)]
    ticket, on_device = items[-1], dict(zip(host, items))
    args = list(k.node.args)
    for pos, lst in zip(k.rule.list_positions[2:], states):
        args[pos] = [on_device[t] for t in lst]
    targets = [on_device[m] for m in masters] if narrow else k.params
    args[0] = targets
    with g.inserting_before(k.first_node):
        waited = g.call_function(ops.wait_device.default, (ticket, items[:-1]))
        nodes = [waited]
        if narrow:   # the fp32 master weights take fp32 gradients
            args[1] = [g.call_function(torch.ops.aten._to_copy.default, (gr,), {"dtype": MASTER_DTYPE})
                       for gr in k.grads]
            nodes += args[1]
        if k.counter is not None:
            steps = args[k.rule.steps_position]
            nodes.append(k.emit_counter(g, steps))
        update = g.call_function(k.node.target, tuple(args), dict(k.node.kwargs))
        if k.step_rollback is not None:   # GradScaler: a skipped update's step does not count
            nodes.append(k.emit_step_rollback(g, args[k.rule.steps_position]))
        if narrow:
            nodes.append(g.call_function(torch.ops.aten._foreach_copy_.default, (k.params, targets)))
        back_from = [on_device[t] for lst in states for t in lst] + targets
        back_to = [t for lst in states for t in lst] + masters
        write_back = g.call_function(ops.copy_to_host.default, (back_from, back_to))
    with g.inserting_before(g.output_node()):
        landed = g.call_function((ops.carry_host_write if carry else ops.wait_host).default, (write_back, back_to))
    _tag([fetched, *items, waited], meta, "transfer")
    _tag([n for n in nodes if n is not waited] + [update], meta, "optimizer")
    _tag([write_back, landed], meta, "transfer")


def _first_read_after_update(k: UpdateKernel, storages: StorageMap) -> fx.Node | None:
    """The first node after the bucket's update that reads (or writes) any of its parameters,
    through any view, or None when only the step's outputs do."""
    unit = {k.node, *k.nodes}
    updated_at = max(storages.position[n] for n in unit if n in storages.position)
    after = [a.node for p in k.params for s in storages.of(p) for a in storages.accesses[s]
             if a.position > updated_at and a.node not in unit]
    return min(after, key=storages.position.__getitem__, default=None)


def _first_reader(k: UpdateKernel, position: dict[fx.Node, int]) -> fx.Node:
    """The first node that reads any of the bucket's parameters (in forward; not the views of
    this rank's rows the `zero` pass makes for the update right after the inputs)."""
    return min((u for p in k.param_inputs() for u in p.users if u in position and u.meta.get("phase") != "optimizer"),
               key=position.__getitem__)


def _calibration(ctx: PassContext) -> Calibration:
    """The calibration the plans are made with: the user's, else this device's (cached on disk)."""
    offload = ctx.config.offload
    return offload.calibration or Calibration.load_or_measure(ctx.device, threads=offload.cpu_threads)


def _choose_paths(graph: TrainGraph, kernels: list[UpdateKernel], ctx: PassContext, state_bytes_on_device: int,
                  early: list[_EarlyGradients | None], host_sums: list[bool],
                  assignment: tuple[tuple[str, ...], dict[int, int]] | None = None
                  ) -> tuple[list[str], dict[int, int], StepCosts | None]:
    """CPU or device path per bucket, where device-path prefetches start (node index), and the
    costs the plan was made from (None without a plan: the activation planner re-times them).
    `host_sums[b]`: bucket b's running gradient sums are on the host, so it takes the CPU path."""
    offload = ctx.config.offload
    n = len(kernels)
    mode = offload.device_updates
    if host_sums and all(host_sums):
        graph.note("offload_optimizer", "running gradient sums on the host: every bucket takes the CPU path",
                   "no_plan", reason="accumulate_on host")
        return ["cpu"] * n, {}, None
    if mode == "never" or (mode == "auto" and offload.calibration is None and ctx.device.type != "cuda"):
        if mode == "auto":
            graph.note("offload_optimizer", "no accelerator: every bucket takes the CPU path", "no_plan",
                       reason="no accelerator")
        return ["cpu"] * n, {}, None
    cal = _calibration(ctx)
    nodes = [nd for nd in graph.graph.nodes if nd.op != "output"]
    index = {nd: i for i, nd in enumerate(nodes)}
    live = [lv - state_bytes_on_device for lv in analyze_memory(graph).live]
    buckets = []
    for b, k in enumerate(kernels):
        numel = sum(p.meta["val"].numel() for p in k.params)
        param_bytes = sum(p.meta["val"].numel() * p.meta["val"].element_size() for p in k.params)
        grad_bytes = sum(gr.meta["val"].numel() * gr.meta["val"].element_size() for gr in k.grads)
        n_states = len([pos for pos in k.rule.list_positions[2:] if pos != k.rule.steps_position and k.node.args[pos]])
        narrow = k.params[0].meta["val"].dtype != MASTER_DTYPE
        state = numel * 4 * (n_states + (1 if narrow else 0))
        final = max(index[n] for n in early[b].final_at) if early[b] is not None else None
        buckets.append(BucketCost(f"bucket {k.node.meta.get('bucket', b)}", numel, index[k.first_node] - 1,
                                  grad_bytes, param_bytes, state, final, index[_first_reader(k, index)]))
    seconds = node_seconds(graph.graph, cal, ctx.measured_node_seconds)
    _note_collectives(graph, nodes, seconds, cal)
    for k in kernels:   # the update kernels themselves are what the plan replaces
        for node in (k.node, k.counter):
            if node is not None:
                seconds[index[node]] = 0.0
    costs = StepCosts(seconds, live, buckets, offload.overlap_next_step)
    # what the plan's copies may hold past their frees is not known before it: bound it by the
    # largest bucket's gradients
    unseen = unseen_device_bytes(graph.graph, ctx.device)
    if ctx.device.type == "cuda":
        unseen["copy_held"] = max(b.grad_bytes for b in buckets)
    budget = _planning_budget(ctx, sum(unseen.values()))
    if assignment is not None:   # re-planned with the activation plan in the step (_replan_with_activations)
        chosen, candidates = StepModel(costs, cal).predict(assignment[0], prefetch=assignment[1]), {}
    elif isinstance(mode, int):
        chosen = predict(costs, [("device" if i % mode == mode - 1 else "cpu") for i in range(n)], cal,
                         budget)
        candidates = {}
        if chosen is None:
            raise UnsupportedError(f"device_updates={mode} cannot meet gpu_memory_budget {offload.gpu_memory_budget}")
    else:
        # re-plans from measured node times are never cached: no restart measures the same times
        chosen, candidates = _plan_or_reuse(graph, costs, cal, budget,
                                            offload.plan_cache and ctx.measured_node_seconds is None)
    if any(host_sums) and any(p == "device" for p, h in zip(chosen.assignment, host_sums) if h):
        # buckets whose sums are on the host take the CPU path: the search's choice with them moved back
        # (it does not search under that constraint; all-CPU fits whenever offload fits)
        forced = [("cpu" if h else p) for p, h in zip(chosen.assignment, host_sums)]
        chosen = predict(costs, forced, cal, budget) or predict(costs, ["cpu"] * n, cal, budget)
        candidates = {}
    graph.note("offload_optimizer", f"plan: {chosen.assignment.count('device')} of {n} buckets on the device, "
               f"predicted step {chosen.step_seconds * 1e3:.3g} ms" + "".join(
                   f"; {name} {t * 1e3:.3g} ms" for name, t in candidates.items()), "plan",
               device_buckets=chosen.assignment.count("device"), buckets=n, step_seconds=chosen.step_seconds,
               candidates=dict(candidates))
    for b, bucket in enumerate(buckets):
        spans = [e for e in chosen.events if e.bucket == b]
        start, end, moved = min(e.start for e in spans), max(e.end for e in spans), sum(_moved(e, bucket) for e in spans)
        graph.note("offload_optimizer", f"{bucket.name}: {chosen.assignment[b]} path, "
                   f"{start * 1e3:.3g}-{end * 1e3:.3g} ms, {moved / 2**20:.2f} MiB moved", "bucket",
                   bucket=bucket.name, path=chosen.assignment[b], start_s=start, end_s=end, moved_bytes=moved)
    graph.schedule = chosen
    return list(chosen.assignment), chosen.prefetch_node, costs


def _note_collectives(graph: TrainGraph, nodes: list[fx.Node], seconds: list[float], cal: Calibration) -> None:
    """explain()'s record of what the plan charges for the step's collectives (ZeRO's bucket
    collectives): their time on the compute stream (the bytes a rank sends, at the calibration's
    link rate, or measured), and their buffers, which the liveness analysis counts in the peak
    like any value of the graph (the packed input and the collective's output)."""
    sizes = group_sizes(graph.graph)
    found = [(i, nd, collective_bytes(nd, sizes)) for i, nd in enumerate(nodes)]
    found = [(i, nd, sent) for i, nd, sent in found if sent is not None]
    if not found:
        return
    buffers = [sum(t.numel() * t.element_size() for a in nd.all_input_nodes for t in tensor_vals(a))
               + sum(t.numel() * t.element_size() for t in tensor_vals(nd)) for _, nd, _ in found]
    sent, took = sum(s for *_, s in found), sum(seconds[i] for i, *_ in found)
    measured = cal.collective_bytes_per_s is not None
    graph.note("offload_optimizer", f"{len(found)} collectives: {format_bytes(sent)} sent by this rank, "
               f"{took * 1e3:.3g} ms on the predicted timeline (at {cal.link_bytes_per_s / 1e9:.3g} GB/s, "
               + ("the calibration's collective rate" if measured else "the device-to-host link's rate: no collective "
                  "rate calibrated") + f"); their buffers, up to {format_bytes(max(buffers))} at once, count in the "
               "predicted peak", "collectives", collectives=len(found), sent_bytes=sent, seconds=took,
               link_bytes_per_s=cal.link_bytes_per_s, calibrated=measured, largest_buffer_bytes=max(buffers))


def _plan_or_reuse(graph: TrainGraph, costs: StepCosts, cal: Calibration, budget: int | None,
                   use_cache: bool) -> tuple[Prediction, dict[str, float]]:
    """The planner's choice, from the on-disk plan cache when the same costs, calibration and
    budget were planned before (Offload.plan_cache)."""
    if not use_cache:
        return plan(costs, cal, budget)
    key = plan_key(costs, cal, budget, SWEEPS)
    cached = load_plan(key)
    if cached is not None:
        graph.note("offload_optimizer", f"plan reused from the on-disk plan cache ({plan_path(key)})", "plan_reused",
                   path=plan_path(key))
        return cached
    chosen, candidates = plan(costs, cal, budget, SWEEPS)
    store_plan(key, chosen, candidates)
    return chosen, candidates


def _activations_summary(plan: ActivationPlan) -> str:
    counts = {c: sum(1 for v in plan.choices.values() if v == c) for c in ("recompute", "offload")}
    return (f", after activations='auto' recomputed {counts['recompute']} and offloaded {counts['offload']} saved "
            f"activations (keeping them all needs {format_bytes(plan.keep_peak)}); the peak is at "
            f"{plan.peak_node}, where no saved activation is left to move")


def _moved(event, bucket: BucketCost) -> int:
    if event.track == "d2h":
        return bucket.grad_bytes if event.name.startswith("grads") else bucket.state_bytes
    if event.track == "h2d":
        return bucket.upload_bytes if event.name.startswith("upload") else bucket.state_bytes
    return 0


def _note_grad_sums(graph: TrainGraph, host: dict[str, fx.Node], device: dict[str, fx.Node],
                    buckets: dict[str, list[str]], ctx: PassContext) -> None:
    """explain()'s record of where each bucket's running gradient sums live (accumulation_steps)."""
    if not host and not device:
        return
    nbytes = {w: sum(s.meta["val"].numel() * s.meta["val"].element_size() for s in sums.values())
              for w, sums in (("host", host), ("device", device))}
    where = "mixed" if host and device else "host" if host else "device"
    graph.note("offload_optimizer", "running gradient sums: " + ", ".join(
        f"{len(sums)} on the {w} ({format_bytes(nbytes[w])}{', fp32' if w == 'host' else ''})"
        for w, sums in (("host", host), ("device", device)) if sums), "grad_sums", where=where,
        sums=len(host) + len(device), bytes=sum(nbytes.values()), host_sums=len(host), device_sums=len(device),
        host_bytes=nbytes["host"], device_bytes=nbytes["device"])
    for bucket, names in buckets.items():
        w = "host" if names[0] in host else "device"
        graph.note("offload_optimizer", f"bucket {bucket}: running gradient sums on the {w}", "grad_sum",
                   bucket=bucket, where=w, params=tuple(names))
    placement = ctx.grad_sum_placement
    if ctx.config.offload.accumulate_on == "auto" and placement is not None and placement.peaks:
        m, peaks = placement.chosen, placement.peaks
        graph.note("offload_optimizer", placement.describe(ctx.config.offload.gpu_memory_budget), "grad_sum_placement",
                   moved=m, movable=len(placement.groups), buckets=tuple(b for b, _ in placement.groups[:m]),
                   budget=placement.budget, accumulate_peak=peaks[False][m], update_peak=peaks[True][m],
                   peaks={"accumulate": peaks[False], "update": peaks[True]},
                   method={"accumulate": placement.methods[False], "update": placement.methods[True]},
                   unfitted=placement.unfitted)
        reused = {("update" if update else "accumulate"): path for update, path in sorted(placement.reused.items())}
        graph.note("offload_optimizer", f"accumulate_on='auto' placement: {placement.trials} trial compiles"
                   + "".join(f"; the {'updating' if v == 'update' else 'accumulating'} variant's peaks reused from the "
                             f"on-disk plan cache ({path})" for v, path in reused.items()), "grad_sum_peaks",
                   trial_compiles=placement.trials, reused=reused)


def _trial(graph: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, dict[str, int]]:
    """`graph` compiled by this pass under `ctx`, and what the CUDA allocator holds outside the
    graph's tensors (host_accumulation.place_sums' trials)."""
    out = offload_optimizer(graph, ctx)
    return out, unseen_device_bytes(out.graph, ctx.device)


def _plan_activations(graph: TrainGraph, ctx: PassContext, planned: list[str], costs: StepCosts | None = None,
                      edits: dict | None = None, record: bool = False
                      ) -> tuple[TrainGraph, ActivationPlan | None, dict | None]:
    """With Offload(activations="auto"): keep, recompute or offload the saved activations until
    the predicted peak fits the budget (offload_activations.py), on the state plan's timeline
    when there is one (`planned`: the names its node times are indexed by; `costs`: what it was
    planned from, re-simulated with the activation plan's recompute in it). `edits`: a plan's
    recorded edits (the on-disk cache's), re-applied instead of planning (then no
    ActivationPlan); `record`: also return what the planner changed (offload_activation_edits),
    None where it cannot be written down."""
    offload = ctx.config.offload
    if offload.activations != "auto":
        return graph, None, None
    cal = _calibration(ctx)
    recorded = activations = None
    if edits is not None:
        graph = offload_activation_edits.apply(graph, edits, "offload_optimizer")
        placed = edits["placed"]
    else:
        unseen = unseen_device_bytes(graph.graph, ctx.device)
        if ctx.device.type == "cuda":   # an activation's copy out may hold its block a while too
            unseen["copy_held"] = max(unseen["copy_held"], largest_saved_bytes(graph))
        before = offload_activation_edits.snapshot(graph) if record else None
        activations = plan_activations(graph, _planning_budget(ctx, sum(unseen.values())), cal, ctx.device,
                                       graph.schedule, planned, costs)
        graph, placed = activations.graph, bool(activations.choices)
        if before is not None:
            try:
                recorded = {**offload_activation_edits.record(before, graph), "placed": placed}
            except NotRecordable as exc:
                log.info("the activation plan is not cached: %s", exc)
    if graph.schedule is not None and placed:
        graph.schedule, added = place_on_schedule(graph, graph.schedule, planned, cal, costs)
        graph.note("offload_optimizer", "activations on the schedule: "
                   f"{added['link_seconds'] * 1e3:.3g} ms of copies in the links' gaps beside the state's "
                   f"transfers, {added['stall_seconds'] * 1e3:.3g} ms waiting for copies back, "
                   f"{added['recompute_seconds'] * 1e3:.3g} ms recomputing; predicted step "
                   f"{graph.schedule.step_seconds * 1e3:.3g} ms", "activations_on_schedule",
                   step_seconds=graph.schedule.step_seconds, **added)
    return graph, activations, recorded


def _check_budget(graph: TrainGraph, ctx: PassContext, device_peak: int, activations: ActivationPlan | None) -> None:
    """Fail at compile time, with the least the step needs, when the predicted peak (plus what the
    CUDA allocator holds outside the graph's tensors) is over Offload.gpu_memory_budget."""
    offload = ctx.config.offload
    unseen = unseen_device_bytes(graph.graph, ctx.device)
    if any(unseen.values()):
        graph.note("offload_optimizer", "device memory no node holds, modelled: " + ", ".join(
            f"{name.replace('_', ' ')} {format_bytes(b)}" for name, b in unseen.items()))
    budget = _planning_budget(ctx, sum(unseen.values()))
    if budget is not None and device_peak > budget:
        reserve = offload.budget_bytes() - budget
        kept = (f", plus {format_bytes(reserve)} the CUDA allocator holds outside the graph's tensors ("
                + ", ".join(f"{name.replace('_', ' ')} {format_bytes(b)}" for name, b in unseen.items() if b)
                + ")") if reserve else ""
        raise UnsupportedError(
            f"gpu_memory_budget {offload.gpu_memory_budget} cannot be met: with its optimizer state "
            f"offloaded the step still needs at least {format_bytes(device_peak)} ({device_peak:,} bytes) "
            f"on the device (parameters, activations and gradients in flight){kept}"
            + (_activations_summary(activations) if activations is not None else
               "; Offload(activations='auto') may recompute or offload saved activations to fit") +
            ". Raise the budget, or reduce the batch or sequence length.")


def _activations_of_accumulating_call(graph: TrainGraph, ctx: PassContext, edits: dict | None = None,
                                      record: bool = False) -> tuple[TrainGraph, _Decisions | None]:
    """A call that only adds into the running sums holds a micro-batch's activations too: with
    activations="auto" they are planned under the same budget as in the updating call (`edits`,
    `record`: the plan cache's, as `_plan_activations` takes them; no bucket plan here)."""
    graph, activations, recorded = _plan_activations(graph, ctx, [], edits=edits, record=record)
    if activations is not None:
        _check_budget(graph, ctx, analyze_memory(graph).peak, activations)
    return graph, _Decisions(None, recorded) if record else None


def _replan_with_activations(fresh: Callable[[], TrainGraph], graph: TrainGraph, ctx: PassContext, planned: list[str],
                             costs: StepCosts, activations: ActivationPlan, record: bool = False
                             ) -> tuple[TrainGraph, _Decisions | None] | None:
    """The bucket plan is made before the activations are planned, against the memory and
    compute of the step with every activation kept; a checkpointed model's bucket plan is made
    with its recompute in it (which can favour the CPU path: replays fill compute time that
    device-path updates and prefetches would want, and its memory, into which prefetches can
    start earlier). So the state is planned again the same way on the step as each activation
    plan that fits left it (the chosen one and `activations.others`, among them every block
    replayed, which frees more than the budget needs; offload_activations.retimed_costs: its
    replays timed, its memory), one bucket plan per activation plan. The pass then runs again
    from the graph before it (`fresh`) with a candidate's paths and prefetch points, planning
    the activations anew against them, fastest predicted candidate first, and again with the
    next while that one is predicted faster than the fastest run so far: a run's activation
    plans are made anew on its prefetches' memory, and the greedy's can differ from the one
    its candidate was made on (only a run, not the prediction, says what the step is). The
    fastest run that fits is kept if faster than the first plan, with what it decided (`record`);
    None: the first."""
    cal = _calibration(ctx)
    made_plans: list[tuple[Prediction, list[str], str]] = []
    for candidate in (activations, *activations.others):
        timed, _, names = retimed_costs(candidate.graph, graph.schedule, planned, costs, cal, with_memory=True)
        unseen = unseen_device_bytes(candidate.graph.graph, ctx.device)
        made, _ = plan(timed, cal, _planning_budget(ctx, sum(unseen.values())))
        made_plans.append((made, names, candidate.strategy))
    # fastest predicted first (stable: the chosen activation plan's on a tie)
    made_plans.sort(key=lambda m: m[0].step_seconds)
    index = {name: i for i, name in enumerate(planned)}
    kept: TrainGraph | None = None
    kept_decisions: _Decisions | None = None
    tried = runs = 0
    for chosen, names, strategy in made_plans:
        bar = graph.schedule.step_seconds if kept is None else kept.schedule.step_seconds
        if chosen.step_seconds >= bar:
            break   # sorted: no later candidate is predicted faster than what is kept
        # the run below plans the activations anew on this bucket plan, and a plan made by a
        # search that reads the memory (the greedy) can come out other than the candidate's, and
        # slower: so each candidate predicted faster than the best run so far is run in turn
        # (on the 4-layer benchmark GPT the greedy's bucket plan, predicted fastest, ran 2.7%
        # slower than the every-block candidate's)
        tried += 1
        log.info("planning the activations again on the bucket plan made with the '%s' activation plan in the "
                 "step (%d of %d buckets on the device, predicted %.4g ms)", strategy,
                 chosen.assignment.count("device"), len(chosen.assignment), chosen.step_seconds * 1e3)
        for prefetch in _prefetch_points(chosen.prefetch_node, names, index):
            runs += 1
            try:
                other, decisions = _run(fresh(), ctx, (chosen.assignment, prefetch), record=record)
            except UnsupportedError:
                continue   # its activations could not fit the budget
            if other.schedule.step_seconds < bar:
                bar, kept, kept_on, kept_decisions = other.schedule.step_seconds, other, (chosen, strategy), decisions
            if other.schedule.step_seconds <= chosen.step_seconds:
                break   # ran as predicted (or faster)
    if kept is None:
        return None
    chosen, strategy = kept_on
    kept.note("offload_optimizer", f"bucket plan made again with an activation plan in the step ({strategy}): "
              f"{chosen.assignment.count('device')} of {len(chosen.assignment)} buckets on the device, predicted "
              f"step {kept.schedule.step_seconds * 1e3:.4g} ms (the first plan, "
              f"{graph.schedule.assignment.count('device')} on the device, with its activation plan: "
              f"{graph.schedule.step_seconds * 1e3:.4g} ms; {tried} of {len(made_plans)} candidates' bucket plans "
              f"run, {runs} runs)", "state_replanned",
              step_seconds=kept.schedule.step_seconds, first_step_seconds=graph.schedule.step_seconds,
              device_buckets=chosen.assignment.count("device"),
              first_device_buckets=graph.schedule.assignment.count("device"), made_on=strategy,
              candidates=len(made_plans), tried=tried, runs=runs,
              candidate_steps={s: made.step_seconds for made, _, s in made_plans})
    return kept, kept_decisions


def _prefetch_points(prefetch_node: dict[int, int], names: list[str], index: dict[str, int]) -> list[dict[int, int]]:
    """A bucket plan's prefetch points (indices into `names`, the re-timed sequence, replayed
    nodes among the planned ones) on the nodes the first plan indexed (`index`), for a run from
    the graph before any replay: one at a replayed node goes to the planned node before the
    replay (it starts no later; its state is live during the replay) and, where that differs,
    to the one after it (as in the candidate's memory, later) as a second choice. Starting
    after a whole block's replay made the every-block candidate's run 7% slower than predicted
    on the 4-layer benchmark GPT (its state arrived late); starting before it was 6e-6 slower
    on a model of it scaled 8x down (the replay's memory, with the state in it, changed the
    activation plan), which the later point ran as predicted."""
    preceding, following = [0] * len(names), [0] * len(names)
    latest = 0
    for j, name in enumerate(names):
        latest = preceding[j] = index.get(name, latest)
    upcoming = len(index) - 1
    for j in range(len(names) - 1, -1, -1):
        upcoming = following[j] = index.get(names[j], upcoming)
    early = {b: preceding[j] for b, j in prefetch_node.items()}
    late = {b: following[j] for b, j in prefetch_node.items()}
    return [early] if late == early else [early, late]


@dataclass(frozen=True)
class _Decisions:
    """What a run of the pass decided that a restarted job can make again without searching:
    the buckets' paths and device-path prefetch points it was given (None: the first run's,
    planned as it plans them, from the bucket plan cache) and the activation planner's edits
    (offload_activation_edits.record; None: not recordable)."""

    assignment: tuple[tuple[str, ...], dict[int, int]] | None
    edits: dict | None


# the code the activation planning runs: a change to any of it is another key in the plan cache
_PLANNING_CODE = (sys.modules[__name__], offload_activations, offload_activation_gathers, offload_planner,
                  offload_cost_model, offload_activation_edits, host_accumulation, update_kernels, memory, aliasing)


def _activation_cache_key(graph: TrainGraph, ctx: PassContext) -> str | None:
    """The on-disk key of this step's activation plan, or None where none is kept: plan_cache
    off, re-plans from measured node times (no restart measures the same times), and a probe of
    the other variant of an accumulating step compiled before accumulate_on="auto" decided where
    the running sums live (`_sums_on_host` is None there: its run stops at the placement and its
    graph is dropped, so it has nothing to store, and must not read a plan made for a placement
    it has not got). The trial compiles of the placement (host_accumulation.trial_context, the
    step's _trial_options) run with plan_cache=False and activations="keep", so never get here.
    With running sums the key holds the parameters whose sums are on the host: the same graph
    before the pass is another graph after the placement, and a plan is for that one."""
    offload = ctx.config.offload
    if not offload.plan_cache or ctx.measured_node_seconds is not None:
        return None
    on_host = _sums_on_host(graph, ctx)
    if on_host is None:
        return None
    return activation_key(offload_activation_edits.structure(graph), _calibration(ctx),
                          f"{offload!r} on {ctx.device}, sums on the host: {sorted(on_host)}", _PLANNING_CODE)


def _peak_of(graph: TrainGraph) -> int:
    """The predicted device peak of the pass's graph: the updating call's note, else (an
    accumulating call, which has no update to offload) its liveness analysis."""
    notes = graph.notes_of("offload_optimizer", "offloaded")
    return notes[-1].fields["device_peak_bytes"] if notes else analyze_memory(graph).peak


def _with_cached_activations(graph: TrainGraph, ctx: PassContext, key: str) -> TrainGraph:
    """The pass with Offload(activations="auto") and the plan cache: a stored plan's decisions
    re-applied to the step, when they give the stored predicted peak and step; else planned
    (both from a copy of the step as it came, so the two name their nodes alike) and stored."""
    fresh = graph.deferred_copy()
    stored = load_activations(key)
    path = plan_path(key, "activations")
    if stored is not None:
        why = None
        try:
            assignment = stored["assignment"]
            if assignment is not None:
                assignment = (tuple(assignment[0]), {int(b): int(i) for b, i in assignment[1].items()})
            reused, _ = _run(fresh(), ctx, assignment, edits=stored["edits"])
            peak = _peak_of(reused)
            step = reused.schedule.step_seconds if reused.schedule is not None else None
            if (peak, step) != (stored["peak_bytes"], stored["step_seconds"]):
                why = (f"re-applied, it predicts a peak of {peak:,} bytes and a step of {step} s, not the stored "
                       f"{stored['peak_bytes']:,} and {stored['step_seconds']}")
        except (EditsMismatch, UnsupportedError, PassError, KeyError, IndexError, TypeError, ValueError,
                AttributeError) as exc:
            why = f"it does not fit this step ({type(exc).__name__}: {exc})"
        if why is None:
            reused.note("offload_optimizer", f"activation plan and bucket plan reused from the on-disk plan cache "
                        f"({path}): the search skipped; predicted peak {format_bytes(peak)}, step "
                        + (f"{step * 1e3:.4g} ms" if step is not None else "not predicted") + ", as stored",
                        "activations_reused", path=path, peak_bytes=peak, step_seconds=step)
            return reused
        log.warning("not reusing the cached activation plan %s: %s; planning again", path, why)
    out, decisions = _run(fresh(), ctx, record=True)
    if decisions is not None and decisions.edits is not None:
        assignment = decisions.assignment
        store_activations(key, {
            "assignment": None if assignment is None else [list(assignment[0]),
                                                           {str(b): i for b, i in assignment[1].items()}],
            "edits": decisions.edits, "peak_bytes": _peak_of(out),
            "step_seconds": out.schedule.step_seconds if out.schedule is not None else None})
    return out


def offload_optimizer(graph: TrainGraph, ctx: PassContext,
                      assignment: tuple[tuple[str, ...], dict[int, int]] | None = None) -> TrainGraph:
    """`assignment`: the buckets' paths and device-path prefetch points, chosen already
    (_replan_with_activations). With Offload(activations="auto") and the plan cache, a restarted
    job's compile re-applies the plan kept on disk (_with_cached_activations)."""
    if assignment is None and ctx.config.offload.activations == "auto":
        key = _activation_cache_key(graph, ctx)
        if key is not None:
            return _with_cached_activations(graph, ctx, key)
    return _run(graph, ctx, assignment)[0]


def _sums_on_host(graph: TrainGraph, ctx: PassContext, kernels: list | None = None) -> frozenset[str] | None:
    """The parameters whose running sums this compile keeps on the host (host_accumulation.place_sums;
    empty without `grad_sum` inputs), or None: a probe of the other variant before
    accumulate_on="auto" decided, whose graph is dropped. Once decided, the step's SumPlacement
    answers at once, so the cache key (_activation_cache_key) and the run both ask."""
    specs = graph.signature.inputs
    if not any(s.kind == "grad_sum" for s in specs):
        return frozenset()
    kernels = find_update_kernels(graph.graph) if kernels is None else kernels
    spec_of = {s.name: s for s in specs}
    placeholders = graph.placeholders()
    device_sums = {s.target: placeholders[s.name] for s in specs if s.kind == "grad_sum"}
    names_of = [[spec_of[p.name].target for p in k.param_inputs()] for k in kernels]
    return place_sums(graph, ctx, bool(kernels), list(device_sums), lambda pinned: candidate_groups(
        kernels, names_of, pinned), _trial, lambda: read_on_device(kernels, names_of, device_sums),
        lambda update: _sum_peaks_cache_key(graph, ctx, update))


def _sum_peaks_cache_key(graph: TrainGraph, ctx: PassContext, update: bool) -> str | None:
    """The on-disk key of one variant's predicted peaks under accumulate_on="auto"
    (host_accumulation.place_sums), or None where none is kept: plan_cache off, or a re-plan from
    measured node times. The trials compile `graph` under host_accumulation.trial_context, so the
    key holds that context's Offload options (no budget: the peaks do not depend on it), the
    graph before the pass, the calibration, the buckets that may move and those pinned, and the
    code of the pass (the trials run all of it)."""
    offload = ctx.config.offload
    placement = ctx.grad_sum_placement
    if not offload.plan_cache or ctx.measured_node_seconds is not None or placement is None:
        return None
    trials = trial_context(ctx, frozenset()).config.offload
    return activation_key(offload_activation_edits.structure(graph), _calibration(ctx),
                          f"running-sum peaks of the {'updating' if update else 'accumulating'} variant, trials "
                          f"under {trials!r} on {ctx.device}, movable buckets {placement.groups}, pinned "
                          f"{sorted(placement.pinned)}", _PLANNING_CODE)


def _run(graph: TrainGraph, ctx: PassContext, assignment: tuple[tuple[str, ...], dict[int, int]] | None = None,
         edits: dict | None = None, record: bool = False) -> tuple[TrainGraph, _Decisions | None]:
    """The pass, and (`record`) what the run that made its graph decided; `edits`: the
    activation planner's recorded edits, re-applied instead of planning (no re-plan then)."""
    offload = ctx.config.offload
    # the step as it came, before anything below edits it in place: what a second bucket plan,
    # made with the activation plan in the step, starts from
    fresh = (graph.deferred_copy() if offload.activations == "auto" and assignment is None and edits is None
             else None)
    kernels = find_update_kernels(graph.graph)
    host_sums: dict[str, fx.Node] = {}
    specs = list(graph.signature.inputs)
    spec_of = {s.name: i for i, s in enumerate(specs)}
    placeholders = graph.placeholders()
    device_sums = {s.target: placeholders[s.name] for s in specs if s.kind == "grad_sum"}
    on_host = _sums_on_host(graph, ctx, kernels)
    if on_host is None:   # a probe of the other variant before the placement is decided: its graph is dropped
        return graph, None
    if on_host:
        host_sums = move_sums_to_host(graph, specs, on_host)
        device_sums = {name: s for name, s in device_sums.items() if name not in host_sums}
    if not kernels and (host_sums or device_sums):   # an accumulating call
        _note_grad_sums(graph, host_sums, device_sums, {}, ctx)
        if not host_sums:
            return _activations_of_accumulating_call(graph, ctx, edits, record)
        accumulate_on_host(graph, specs, host_sums)   # its gradients go to the host sums
        assign_streams(graph.graph)
        graph = graph.with_signature(inputs=tuple(specs))
        fill_missing_meta(graph, "offload_optimizer")
        return _activations_of_accumulating_call(graph, ctx, edits, record)
    kernels = update_kernels_to_rewrite(graph, "offload_optimizer", "offload")
    if not kernels:
        return graph, None
    g = graph.graph
    names_of = [[specs[spec_of[p.name]].target for p in k.param_inputs()] for k in kernels]
    bucket_params = {str(k.node.meta.get("bucket", b)): names for b, (k, names) in enumerate(zip(kernels, names_of))}
    drained = [drain_host_sums(k, names, host_sums) if host_sums.keys() & set(names) else ([], [], [])
               for k, names in zip(kernels, names_of)]
    sums_of, norms_of = [d[0] for d in drained], [d[1] for d in drained]
    # a GradScaler's inf checks of host-sum gradients leave the device (done on the host after
    # each drain); the copy of inv_scale to the host takes each one's place, before the analysis below
    lifted: list[list[tuple[fx.Node, fx.Node, fx.Node]]] = []
    flag_of: dict[fx.Node, fx.Node] = {}   # host flag -> the device flag it joins
    for b, d in enumerate(drained):
        lifted.append([])
        for name, check in zip(names_of[b], d[2]):
            scalar = {}
            for what, like in (("found_inf", check.flag), ("inv_scale", check.inv_scale)):
                scalar[what] = graph.add_host_input(specs, InputSpec(
                    "host_scratch", placeholder_name(f"h_{what}_check", name), (name, f"{what}_check"), True, True),
                    torch.Size([]), like.meta["val"].dtype, name)
            meta = {"param": (name,), **{key: check.check.meta[key] for key in ("stack_trace",)
                                         if key in check.check.meta}}
            lifted[-1].append((lift_check(g, check, scalar["inv_scale"], meta), scalar["found_inf"],
                               scalar["inv_scale"]))
            flag_of[scalar["found_inf"]] = check.flag
    state_bytes = sum(st.meta["val"].numel() * st.meta["val"].element_size()
                      for k in kernels for st in k.state_placeholders())
    storages = StorageMap(g)
    backward = [storages.position[nd] for nd in g.nodes if nd.meta.get("phase") == "backward"]
    early = [_find_early_gradients(storages, k, max(backward), keep=bool(lifted[b])) if backward else None
             for b, k in enumerate(kernels)]
    planned = [nd.name for nd in g.nodes if nd.op != "output"]   # what the schedule's node times index
    paths, prefetch_at, costs = _choose_paths(graph, kernels, ctx, state_bytes, early, [bool(s) for s in sums_of],
                                              assignment)
    early = [found if path == "cpu" else None for found, path in zip(early, paths)]
    for b, norms in enumerate(norms_of):
        if lifted[b] and early[b] is None:
            raise HostSumsUnsupportedError(
                f"Offload(accumulate_on='host') cannot check {names_of[b][0]}'s accumulated gradient for infs on the "
                "host: that needs its bucket's gradients final inside backward and nothing else reading them (the "
                "step returns or keeps a gradient). Use Offload(accumulate_on='device') for this step. "
                + AUTO_SUMS_HINT)
        if norms and early[b] is None:
            where = user_line_of_stack_trace(norms[0].reduction.meta.get("stack_trace"))
            raise HostSumsUnsupportedError(
                f"Offload(accumulate_on='host') cannot take clip_grad_norm_'s norm of {names_of[b][0]}'s accumulated "
                f"gradient on the host{f' ({where})' if where else ''}: that needs its bucket's update to wait past "
                "backward for the global norm, its gradients final inside backward and nothing else reading them "
                "(the step returns or keeps a gradient, or does more than clip them). Use "
                "Offload(accumulate_on='device') for this step. " + AUTO_SUMS_HINT)
    read_after = [_first_read_after_update(k, storages) for k in kernels]
    causes = {b: _why_after_backward(storages, k, found) for b, (k, found) in enumerate(zip(kernels, early))
              if found is not None}   # read before the loop below erases the kernels
    nodes = [nd for nd in g.nodes if nd.op != "output"]
    replaced = {nd for k in kernels for nd in (k.node, *k.nodes)}   # erased as the loop goes

    position = {nd: i for i, nd in enumerate(nodes)}
    def prefetch_anchor(index: int) -> fx.Node:
        anchor = nodes[index]
        while anchor in replaced:
            anchor = anchor.prev
        return anchor
    moved_bytes = 0
    host_checks: list[tuple[fx.Node, fx.Node, bool]] = []   # the host inf checks (_emit_cpu_path)
    waits_past_backward: dict[str, list[str]] = {}   # cause -> buckets whose update waits for it
    for b, k in enumerate(kernels):
        names = [specs[spec_of[p.name]].target for p in k.param_inputs()]
        masters, host_grads, staging = [], [], []
        for name, param, grad in zip(names, k.params, k.grads):
            pv, gv = param.meta["val"], grad.meta["val"]
            masters.append(graph.add_host_input(specs, InputSpec(
                "state", placeholder_name("s_master_param", name), (name, "master_param"), True, True), pv.shape, MASTER_DTYPE, name))
            if paths[b] == "cpu":
                host_grads.append(graph.add_host_input(specs, InputSpec(
                    "host_scratch", placeholder_name("h_grad", name), (name, "grad"), True, True), pv.shape, gv.dtype, name))
                if pv.dtype != MASTER_DTYPE:
                    staging.append(graph.add_host_input(specs, InputSpec(
                        "host_scratch", placeholder_name("h_upload", name), (name, "upload"), True, True), pv.shape, pv.dtype, name))
            moved_bytes += pv.numel() * 4
        for state in k.state_placeholders():
            i = spec_of[state.name]
            specs[i] = InputSpec(specs[i].kind, specs[i].name, specs[i].target, True, True)
            _move_to_host(state, None if specs[i].target[1] == "step" else MASTER_DTYPE)
            moved_bytes += state.meta["val"].numel() * 4
        meta = {key: k.node.meta[key] for key in ("param", "subgroup", "bucket", "stack_trace") if key in k.node.meta}
        if paths[b] == "cpu":
            multiplier = early[b].multiplier if early[b] is not None else None
            scaling = {what: (d, graph.add_host_input(specs, InputSpec(
                "host_scratch", placeholder_name(f"h_{what}", names[0]), (names[0], what), True, True), d.meta["val"].shape,
                d.meta["val"].dtype, names[0]))
                for what, d in (("grad_scale", k.grad_scale), ("found_inf", k.found_inf),
                                ("grad_multiplier", multiplier)) if d is not None}
            norms = [(norm, graph.add_host_input(specs, InputSpec(
                "host_scratch", placeholder_name("h_norm", name), (name, "norm"), True, True), torch.Size([]),
                norm.value.meta["val"].dtype, name)) for name, norm in zip(names, norms_of[b])]
            host_checks += _emit_cpu_path(
                g, k, masters, host_grads, staging, scaling, meta, early[b],
                (f"bucket {b}", _first_reader(k, position)) if offload.overlap_next_step else None,
                read_after[b], sums_of[b], norms, ctx.device, lifted[b])
        else:
            _emit_device_path(g, k, masters, prefetch_anchor(prefetch_at[b]), ctx.device, meta,
                              carry=offload.overlap_next_step)
        k.erase()
        if early[b] is not None:
            waits_past_backward.setdefault(causes[b], []).append(str(k.node.meta.get("bucket", b)))
            for node in early[b].scalings:
                g.erase_node(node)
    for flag in dict.fromkeys(flag_of.values()):
        joined = [c for c in host_checks if flag_of[c[0]] is flag]
        combine_host_flags(g, flag, [h for h, _, fetched in joined if not fetched],
                           [t for _, t, fetched in joined if not fetched], ctx.device,
                           [v for _, v, fetched in joined if fetched])
    if flag_of:
        graph.note("offload_optimizer", f"{len(flag_of)} accumulated gradients (host sums) checked for infs and "
                   "unscaled on the host after their drain; their flags come back and join the device's by their "
                   "max before anything reads found_inf", "host_inf_checks", checks=len(flag_of))
    if host_sums or device_sums:
        _note_grad_sums(graph, host_sums, device_sums, bucket_params, ctx)
    read_in_step = [b for b, path in enumerate(paths) if path == "cpu" and read_after[b] is not None]
    if read_in_step:
        graph.note("offload_optimizer", f"{len(read_in_step)} CPU-path buckets' parameters are read after the "
                   "update inside the step: the step waits for their uploads before that read"
                   + (" and does not hand them over" if offload.overlap_next_step else ""), "read_after_update",
                   buckets=len(read_in_step))
    if offload.overlap_next_step:
        graph.note("offload_optimizer", f"{paths.count('cpu') - len(read_in_step)} CPU-path buckets hand their "
                   "uploads over to the next step, which waits for each right before its forward first reads "
                   "the bucket's parameters", "handed_over", buckets=paths.count("cpu") - len(read_in_step))
        if paths.count("device"):
            graph.note("offload_optimizer", f"{paths.count('device')} device-path buckets' state write-backs land "
                       "after the step returns: the next step's prefetch of that state waits for them in stream "
                       "order, and synchronize() before any outside access", "carried_write_backs",
                       buckets=paths.count("device"))
    for cause, buckets in waits_past_backward.items():
        graph.note("offload_optimizer", f"{len(buckets)} buckets' updates ({', '.join(buckets)}) wait past backward "
                   f"{cause}, but their gradients go to the host as soon as they are final, inside backward, "
                   "so the device frees them there" + (" (the host applies clip_grad_norm_'s scaling)"
                                                       if "clip_grad_norm_" in cause else ""),
                   "waits_past_backward", cause=cause, buckets=tuple(buckets))
    assign_streams(g)   # node.meta["stream"]: which copy stream each transfer runs on
    graph = graph.with_signature(inputs=tuple(specs))
    fill_missing_meta(graph, "offload_optimizer")   # the prefetched buffers' sizes count below
    graph, activations, recorded = _plan_activations(graph, ctx, planned, costs, edits, record)
    device_peak = analyze_memory(graph).peak
    graph.note("offload_optimizer", f"{len(kernels)} update buckets offloaded: {format_bytes(moved_bytes)} of "
               f"master weights and optimizer state in host memory; predicted device peak "
               f"{format_bytes(device_peak)}", "offloaded", buckets=len(kernels), host_bytes=moved_bytes,
               device_peak_bytes=device_peak)
    _check_budget(graph, ctx, device_peak, activations)
    if fresh is not None and costs is not None and activations is not None and (activations.choices or activations.others):
        replanned = _replan_with_activations(fresh, graph, ctx, planned, costs, activations, record)
        if replanned is not None:
            return replanned
    return graph, _Decisions(assignment, recorded) if record else None
