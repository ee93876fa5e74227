"""Running gradient sums in host memory (`Offload(accumulate_on="host")`), for offload_optimizer.

With `accumulation_steps=k` the step keeps each gradient's running sum between calls. On the
device that costs a whole gradient set for the whole window. With offload, the optimizer
state already lives on the host and the updating call already sends every final gradient
there, so the sums can live there too, in fp32:

- an accumulating call replaces autograd's in-place add into the sum by a copy of the
  micro-batch's gradient to a host buffer as soon as it is final (inside backward) and an add
  into the host sum on the CPU worker (`graphoffload::host_accumulate_`): the device frees the
  gradient right after its copy, and no sum occupies device memory;
- the updating call drops the device add `g + sum` that made each gradient final: the CPU path
  copies the last micro-batch's gradient to the host as usual, and the worker adds the sum
  into it (and zeroes the sum) before the host update reads it.

fp32 addition commutes, so `g + sum` on the host gives the device form's bits.

A step that clips (`clip_grad_norm_`, per-tensor or foreach form) reads every accumulated
gradient on the device for its norm and scales it there. With host sums the accumulated
gradient exists only on the host, so its part of the norm is computed there, as DeepSpeed's CPU
offload does (`HostNorm`, `norm_on_host`): on the updating call each gradient goes to the host as
soon as it is final, the worker adds its sum into it (the drain) and computes its norm with the
op the step traced (`graphoffload::host_grad_norm_`), and the norm comes back to the device
(`prefetch_to_device`) just before the step combines the per-gradient norms into the global one;
device sums' norms stay on the device. The clip coefficient then goes to the host with the
update's scalars and the host update applies it (offload_optimizer's early-gradient path).

A GradScaler reads every accumulated gradient on the device the same way: its inf check
(`_amp_foreach_non_finite_check_and_unscale_`, which also unscales in place) sets `found_inf`,
which the updates and `scaler.update()` read. With host sums the check moves to the host
(`HostCheck`, `lift_check`, `check_on_host`): where the device check was, `inv_scale` is copied to
the host; after the drain the worker runs the same op on the host gradient into a host flag
(`graphoffload::host_unscale_`); and before anything reads `found_inf`, the host flags come back
and join the device one by their max (`combine_host_flags`, as ZeRO joins the ranks' flags), so
an overflow in any gradient, host or device sum, skips the whole step and the scale evolves as
eagerly. With clipping too (`scaler.unscale_` then `clip_grad_norm_`) the worker chains drain,
check and norm per gradient, and the flag comes back with the norm (`norm_on_host`'s `along`).
What still cannot work is any other read of the accumulated gradient on the device (the step's own reads):
capture records such reads even on an accumulating call (where `.grad` is None), so the first
call (which compiles the updating variant as a probe) refuses it, before anything runs.

Under ZeRO the `zero` pass has already reduce-scattered every micro-batch's gradients, so the
adds and drains here see this rank's chunks, and the sums are chunk-shaped (DeepSpeed
ZeRO-Offload's form; passes/zero.py). There `accumulate_on="auto"` does not place sums per bucket:
a bucket's placement would change its collectives too (device sums are reduced once per update,
host sums reduce-scattered every call), which the per-bucket model below does not cover. It is
one choice for the whole step instead (`StepSums`, `choose_step_sums`): the step compiles its
accumulating variant once with every sum on the device and once with every sum on the host
(trials, before its real compile) and keeps the sums on the device when that variant's predicted
peak fits the budget, else on the host; the passes then see the choice as "device" or "host".
With `activations="auto"` and neither fitting (both trials keep the activations), it takes the one
with the lesser peak and leaves the rest to the activation planner, as `_decide` does per bucket.

`Offload(accumulate_on="auto")` chooses per bucket (`SumPlacement`): sums stay on the device
while the predicted peaks of both compiled variants fit `gpu_memory_budget`; otherwise buckets
move to the host, in backward order, until they fit. The choice is made once, when both
variants' predicted peaks are known (the step compiles the other variant as a probe first), and
both variants read it from the one `SumPlacement` the step keeps, so they always agree.

The peaks are predicted with the saved activations kept (`trial_context`). With
`Offload(activations="auto")` the real compile's activation planner recomputes or offloads
activations until the peak fits, so a budget no m meets with activations kept is not refused
there: `_decide` takes the m whose kept-activation need is least (the most the sums can give,
the fewest host sums among equals), which leaves the planner the least to recompute or offload,
and the real compile's planner meets the budget or raises its own error naming the least peak it
reached (`SumPlacement.unfitted`, said in the `grad_sum_placement` note). Why not m = 0 with the
planner first, moving sums only where it fails: that needs an activation-planning compile per
candidate (each a whole search, several times the trial compiles here), to save host copies that
hide under backward; the least-need choice costs no compile beyond the trials already made.
Wherever some m fits with activations kept, the choice is the smallest such m, as without the
planner.

The decision needs each variant's peak for every count m of buckets moved. Compiling the pass
once per m (`trial_peaks`) is exact but costs a rewrite and a liveness analysis per bucket: on
a 12-layer GPT, 130 of them, 8.5x the compile of both variants. Moving a bucket's sums edits
only a few nodes beside its adds, in a form the rewrite here fixes, so `modelled_peaks` derives
every m's liveness from ONE trial compile with all sums on the device, as intervals per bucket
summed over the first m; `predicted_peaks` checks it against the trials at m = 0 and m = all and
falls back to the trials when they disagree (or the graph has a form the model does not know).
Why not search over m with a few trials instead: nothing makes the peaks fall monotonically as
buckets move (a host sum keeps the micro-batch's gradient alive until its copy, and when that
gradient is a view of a larger buffer it keeps more than the sum it saves), and a search would
still compile the pass about log2(m) times per variant; the model is exact at every m.

A restarted job need not compile the trials at all: each variant's peaks are a pure function of
the graph before the pass, the calibration, the trials' options (`trial_context`: no budget) and
the buckets that may move, so `place_sums` keeps them in the on-disk plan cache
(passes/offload_plan_cache.py, under offload_optimizer's key) and a restart reads them back and
makes the same decision (`_decide`, the budget applied only there: another budget reuses them).
Under ZeRO (`StepSums`) the step keeps each rank's trial outcomes alike (graphoffload/api.py,
`_trials_key`) and still max-reduces them over the ranks.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import fx

from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.errors import HostSumsUnsupportedError, UnsupportedError
from graphoffload.graph import InputSpec, TrainGraph, fake_mode_of, fake_value, host_fake, placeholder_name
from graphoffload.aliasing import StorageMap
from graphoffload.memory import analyze_memory, block_bytes, format_bytes, storage_span
from graphoffload.ops.host_transfer import VALUE_RULES, grad_sum_key
from graphoffload.passes.gradient_norms import norm_of_norms, norm_order
from graphoffload.passes.offload_plan_cache import load_sum_peaks, plan_path, store_sum_peaks
from graphoffload.passes.update_kernels import UpdateKernel

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

aten = torch.ops.aten
ops = torch.ops.graphoffload
SUM_DTYPE = torch.float32
# one compile of offload_optimizer under a trial context: the graph it made, and what the CUDA
# allocator holds outside the graph's tensors (offload_optimizer.unseen_device_bytes' terms)
Trial = Callable[[TrainGraph, "PassContext"], tuple[TrainGraph, dict[str, int]]]


def move_sums_to_host(graph: TrainGraph, specs: list[InputSpec], only: frozenset[str] | None = None
                      ) -> dict[str, fx.Node]:
    """Mark every running-sum placeholder (of the parameters in `only`, when given) as an fp32
    host tensor (in `specs` and its meta val); returns parameter name -> placeholder."""
    placeholders = graph.placeholders()
    sums = {}
    for i, spec in enumerate(specs):
        if spec.kind != "grad_sum" or (only is not None and spec.target not in only):
            continue
        node = placeholders[spec.name]
        specs[i] = dataclasses.replace(spec, mutable=True, host=True)
        node.meta["val"] = host_fake(graph.graph, node.meta["val"].shape, SUM_DTYPE)
        sums[spec.target] = node
    return sums


# what the refusals of a host sum say of accumulate_on="auto", which can lead to them under ZeRO
AUTO_SUMS_HINT = ("accumulate_on='auto' keeps such a sum on the device by itself (under ZeRO, where it places every "
                  "sum alike, all of them)")


def _refuse(name: str, reader: fx.Node, what: str) -> HostSumsUnsupportedError:
    where = user_line_of_stack_trace(reader.meta.get("stack_trace"))
    return HostSumsUnsupportedError(
        f"Offload(accumulate_on='host') cannot keep the running gradient sum of {name} on the host: {what} "
        f"({getattr(reader.target, '__name__', reader.target)}{f', {where}' if where else ''}). Use "
        "Offload(accumulate_on='device') for this step (host sums support clip_grad_norm_ and a GradScaler; other "
        f"reads need the accumulated gradient on the device). {AUTO_SUMS_HINT}")


@dataclass
class HostNorm:
    """clip_grad_norm_'s norm of one accumulated gradient whose running sum lives on the host,
    to be computed there (`norm_on_host`) instead of on the device."""

    reduction: fx.Node   # the device norm: `linalg_vector_norm(g, ord)` or a one-gradient `_foreach_norm([g], ord)`
    value: fx.Node       # what reads the norm reads: `reduction` itself, or its `getitem(_, 0)`
    ord: float
    foreach: bool


@dataclass
class HostCheck:
    """A GradScaler's inf check (and in-place unscale) of one accumulated gradient whose running
    sum lives on the host, to be done there (`check_on_host`) instead of on the device."""

    check: fx.Node       # `_amp_foreach_non_finite_check_and_unscale_([g], found_inf, inv_scale)`
    flag: fx.Node        # its found_inf, which the device checks and every later reader share
    inv_scale: fx.Node


_SCALINGS = (aten.mul_.Tensor, aten._foreach_mul_.Tensor)
_INF_CHECK = aten._amp_foreach_non_finite_check_and_unscale_.default


def _global_norm_part(value: fx.Node, order: float) -> bool:
    """Whether the norm `value` of one gradient is read only as clip_grad_norm_ reads it: stacked
    with the others' norms into the global norm of the same order (`gradient_norms.norm_of_norms`).
    Only such a norm can come from the host, where the step reads nothing but the global norm; the
    step's own norm of a gradient (`p.grad.norm()`, logged or returned) is a read of the
    accumulated gradient on the device like any other."""
    total = norm_of_norms([value], exactly=False)
    return total is not None and norm_order(total) == order


def _clip_reader(node: fx.Node) -> HostNorm | HostCheck | str | None:
    """How clip_grad_norm_ or a GradScaler reads an accumulated gradient (`node` reads it): its
    norm (a `HostNorm`), its in-place scaling by the clip coefficient ("scaling"), a GradScaler's
    inf check of it alone (a `HostCheck`), else None."""
    if node.target is _INF_CHECK and len(node.args[0]) == 1 and not node.kwargs:
        return HostCheck(node, node.args[1], node.args[2])
    if node.target is aten.linalg_vector_norm.default and len(node.args) <= 2 and not node.kwargs:
        order = norm_order(node)
        return HostNorm(node, node, order, False) if order is not None and _global_norm_part(node, order) else None
    if node.target is aten._foreach_norm.Scalar and len(node.args[0]) == 1 and not node.kwargs \
            and isinstance(node.args[1], (int, float)):
        items = list(node.users)
        if len(items) == 1 and items[0].target is operator.getitem and items[0].args[1] == 0 \
                and _global_norm_part(items[0], float(node.args[1])):
            return HostNorm(node, items[0], float(node.args[1]), True)
        return None
    if node.target in _SCALINGS:
        scalar = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        if isinstance(scalar, torch.Tensor) and scalar.dim() == 0:
            return "scaling"
    return None


def _accumulating_add(name: str, s: fx.Node) -> fx.Node:
    """The accumulating call's `sum.add_(grad)` into the running sum `s`, its only use."""
    adds = [u for u in s.users if u.target is aten.add_.Tensor and u.args[0] is s and len(u.args) == 2
            and not u.kwargs]
    if len(s.users) != 1 or len(adds) != 1 or adds[0].users:
        raise _refuse(name, next(iter(s.users)), "the accumulating call does more with it than add the "
                      "micro-batch's gradient")
    return adds[0]


def _final_add(name: str, s: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The updating call's uses of the running sum `s`: the add `grad + sum` that makes the
    gradient final, and the `zero_` nodes that clear the sum after the update."""
    adds = [u for u in s.users if u.target is aten.add.Tensor and u.args[1] is s and not u.kwargs]
    zeros = [u for u in s.users if u.target is aten.zero_.default and not u.users]
    if len(adds) != 1 or len(s.users) != 1 + len(zeros):
        raise _refuse(name, next(u for u in s.users if u not in adds + zeros), "the updating call reads the sum itself")
    return adds[0], zeros


def _made(node: fx.Node, meta: dict, phase: str) -> fx.Node:
    """Stamp a node made here as it is made: its value on the graph's fake tensors
    (`graph.fake_value`, as every pass fills `meta["val"]` of the nodes it makes, so a later
    helper or analysis never meets a node without one), the caller's meta and its phase."""
    node.meta["val"] = fake_value(node)
    node.meta.update(meta, phase=phase)
    return node


def wait_for_sums(g: fx.Graph, before: fx.Node, sums: list[tuple[str, fx.Node]], hosts: list[fx.Node]
                  ) -> list[fx.Node]:
    """Right before `before`, this call's first copy into the host gradient buffers `hosts` of
    the running sums `sums` ((parameter, placeholder) pairs): wait for the CPU adds into those
    sums that an earlier accumulating call handed over (they still read the same buffers). The
    first call, or one after a synchronization, finds nothing to wait for."""
    with g.inserting_before(before):
        waits = [g.call_function(ops.wait_handed_over.default, ([s, h], grad_sum_key(name)))
                 for (name, s), h in zip(sums, hosts)]
    for node in waits:
        node.meta["val"] = fake_value(node)   # the caller sets the phase and the parameter
    return waits


def accumulate_on_host(graph: TrainGraph, specs: list[InputSpec], sums: dict[str, fx.Node]) -> None:
    """The accumulating call: each `sum.add_(grad)` becomes a copy of `grad` to a host buffer
    and an add into the host sum on the worker. The call does not wait for the adds: it hands
    each over (`hand_over`, key `grad_sum_key(name)`), so they run on beside the next call's
    forward; that call waits for one right before it first touches the same sum (its copy into
    the sum's host buffer), and `synchronize()` (a checkpoint, a recompile) waits for all."""
    g = graph.graph
    for name, s in sums.items():
        add = _accumulating_add(name, s)
        grad = add.args[1]
        gval = grad.meta["val"]
        host = graph.add_host_input(specs, InputSpec("host_scratch", placeholder_name("h_grad", name), (name, "grad"),
                                                     True, True), gval.shape, gval.dtype, name)
        meta = {"param": (name,), **({"stack_trace": add.meta["stack_trace"]} if "stack_trace" in add.meta else {})}
        with g.inserting_after(add):
            ticket = g.call_function(ops.copy_to_host.default, ([grad], [host]))
        [waited] = wait_for_sums(g, ticket, [(name, s)], [host])
        with g.inserting_after(ticket):
            added = g.call_function(ops.host_accumulate_.default, (ticket, [s], [host], False))
        with g.inserting_after(added):
            handed = g.call_function(ops.hand_over.default, (added, [s], grad_sum_key(name)))
        for node, phase in ((waited, "transfer"), (ticket, "transfer"), (added, "optimizer"), (handed, "transfer")):
            _made(node, meta, phase)
        g.erase_node(add)
    graph.note("offload_optimizer", f"{len(sums)} running gradient sums: their CPU adds run on after the call returns; "
               "the next call waits for each right before it first touches that sum (its copy into the sum's host "
               "buffer), synchronize() (a checkpoint, a recompile) for all", "sums_handed_over", sums=len(sums))


def _device_reads(name: str, s: fx.Node, unit: set[fx.Node]
                  ) -> tuple[list[HostNorm], list[HostCheck], list[fx.Node]]:
    """What reads the accumulated gradient of `name` (the updating call's `grad + sum`) besides
    the bucket's update `unit`: clip_grad_norm_'s norms, a GradScaler's inf checks, and every
    other reader (clipping's scaling counts as none: the host update applies it)."""
    final, _ = _final_add(name, s)
    norms, checks, others = [], [], []
    for user in list(final.users):
        readers = list(user.users) if user.target is aten.detach.default else [user]
        for r in readers:
            if user in unit or r in unit:
                continue
            how = _clip_reader(r)
            if isinstance(how, HostNorm):
                norms.append(how)
            elif isinstance(how, HostCheck):
                checks.append(how)
            elif how is None:
                others.append(r)
    return norms, checks, others


def _host_reads(names: list[str], sums: dict[str, fx.Node], unit: set[fx.Node]
                ) -> tuple[list[HostNorm], list[HostCheck]]:
    """The reads of one bucket's accumulated gradients (parameters `names`, update `unit`) that
    the host must serve when its sums move there: clip_grad_norm_'s norms (one per gradient,
    or none) and a GradScaler's inf checks (likewise). Raises the refusal, naming the user's
    line, for any read it cannot serve; `read_on_device` pins exactly those buckets' sums."""
    norms, checks = [], []
    for name in names:
        found, checked, others = _device_reads(name, sums[name], unit)
        if others:
            raise _refuse(name, others[0], "the step reads the accumulated gradient on the device besides its "
                          "update, clip_grad_norm_ and a GradScaler")
        if len(found) > 1:
            raise _refuse(name, found[1].reduction, "the step takes more than one norm of the accumulated gradient")
        if len(checked) > 1:
            raise _refuse(name, checked[1].check, "the step checks the accumulated gradient for infs twice")
        norms += found
        checks += checked
    if norms and len(norms) != len(names):
        raise _refuse(names[0], norms[0].reduction, "the step takes the norm of some but not all of the "
                      "gradients updated together in one bucket (clip_grad_norm_ takes every one's)")
    if checks and len(checks) != len(names):
        raise _refuse(names[0], checks[0].check, "a GradScaler checks some but not all of the gradients updated "
                      "together in one bucket")
    return norms, checks


def read_on_device(kernels: list[UpdateKernel], names_of: list[list[str]], sums: dict[str, fx.Node]) -> frozenset[str]:
    """The parameters whose accumulated gradient the updating call reads on the device in a way
    host sums cannot serve (anything but its update, clip_grad_norm_'s norm and scaling, and a
    GradScaler's inf check): those with such a read of their own, and every one of a bucket
    whose reads together the host cannot serve (`_host_reads`: a norm of some but not all)."""
    out = set()
    for k, names in zip(kernels, names_of):
        unit = {k.node, *k.nodes}
        names = [name for name in names if name in sums]
        for name in names:
            try:
                if _device_reads(name, sums[name], unit)[2]:
                    out.add(name)
            except UnsupportedError:
                out.add(name)
        if not out & set(names):
            try:
                _host_reads(names, sums, unit)
            except UnsupportedError:
                out.update(names)
    return frozenset(out)


def drain_host_sums(k: UpdateKernel, names: list[str], sums: dict[str, fx.Node]
                    ) -> tuple[list[tuple[str, fx.Node]], list[HostNorm], list[HostCheck]]:
    """The updating call, for one bucket: drop the device adds `g + sum` that made its gradients
    final (and the zeroing of the sums after the update); returns the bucket's sums, in the
    order of its gradients with their parameters' names, for `host_accumulate_(..., drain=True)`
    after their copy (which waits for the adds an accumulating call handed over: `wait_for_sums`),
    and clip_grad_norm_'s norms of its gradients (one per gradient, or none), which the caller
    must move to the host (`norm_on_host`): they read the micro-batch's gradient from here on;
    likewise a GradScaler's inf checks of them (one per gradient, or none), to be done on the host
    (`check_on_host`) and erased from the device by the caller."""
    unit = {k.node, *k.nodes}
    norms, checks = _host_reads(names, sums, unit)   # refuses before anything changes
    out = []
    for name in names:
        s = sums[name]
        final, zeros = _final_add(name, s)
        grad = final.args[0]
        final.replace_all_uses_with(grad)
        for user in grad.users:   # the detached final gradient now aliases the micro-batch's gradient
            if user.target is aten.detach.default:
                with fake_mode_of(user.graph):
                    user.meta["val"] = grad.meta["val"].detach()
        for node in [final, *zeros]:
            node.graph.erase_node(node)
        out.append((name, s))
    return out, norms, checks


def drain_on_host(g: fx.Graph, copied: fx.Node, sum_: fx.Node, host: fx.Node, meta: dict) -> fx.Node:
    """Right after `copied` (the copy of the micro-batch's gradient into `host`), the worker adds
    the running sum `sum_` into it and zeroes the sum (the drain): `host` is then the accumulated
    gradient, which the host norm, the host inf check and the host update read later."""
    with g.inserting_after(copied):
        drained = g.call_function(ops.host_accumulate_.default, (copied, [sum_], [host], True))
    return _made(drained, meta, "optimizer")


def lift_check(g: fx.Graph, check: HostCheck, inv_scale: fx.Node, meta: dict) -> fx.Node:
    """Take the GradScaler's inf check `check` of one accumulated gradient (host sum) off the
    device: where it was (its inv_scale is made by then) copy inv_scale to the 0-d host scratch
    `inv_scale` instead, and erase it. Returns the copy, after which `check_on_host` goes."""
    with g.inserting_before(check.check):
        copied = g.call_function(ops.copy_to_host.default, ([check.inv_scale], [inv_scale]))
    _made(copied, meta, "transfer")
    g.erase_node(check.check)
    return copied


def check_on_host(g: fx.Graph, copied: fx.Node, drained: fx.Node, host: fx.Node, flag: fx.Node,
                  inv_scale: fx.Node, meta: dict) -> fx.Node:
    """The worker, after the drain `drained` and the copy of inv_scale `copied` (`lift_check`),
    checks and unscales the accumulated host gradient `host` into the 0-d host flag `flag`
    (`graphoffload::host_unscale_`, the device check's op on the host). Returns its ticket,
    which `combine_host_flags` waits for."""
    order = _positions(g)
    with g.inserting_after(max(copied, drained, key=order.__getitem__)):
        checked = g.call_function(ops.host_unscale_.default, (drained, copied, [host], [flag], inv_scale))
    return _made(checked, meta, "optimizer")


def combine_host_flags(g: fx.Graph, flag: fx.Node, host_flags: list[fx.Node], tickets: list[fx.Node],
                       device: torch.device, fetched_flags: list[fx.Node]) -> None:
    """Make the GradScaler's found_inf flag `flag` (set by the device checks) count the host
    checks too: right before its first reader after its last device check (and after the host
    checks' nodes; the output when nothing reads it), the host flags come to the device (`prefetch_to_device`, which waits for the checks' worker
    `tickets`) and every later reader of `flag` (the update kernels' found_inf, the step-counter
    rollback, `GradScaler.update()`) reads their max with it, so an overflow in any gradient,
    on either side, skips the whole step and backs the scale off, as eagerly. `fetched_flags`:
    host flags already on the device (fetched with clip_grad_norm_'s host norms, `norm_on_host`),
    joined too."""
    order = _positions(g)
    checks = [u for u in flag.users if u.target is _INF_CHECK]
    last = max(checks, key=order.__getitem__, default=None)
    later = [u for u in flag.users if u.target is not _INF_CHECK and (last is None or order[u] > order[last])]
    first = min(later, key=order.__getitem__) if later else g.output_node()
    latest = max([*tickets, *fetched_flags], key=order.__getitem__)
    if order.get(first, len(order)) <= order[latest]:
        where = user_line_of_stack_trace(first.meta.get("stack_trace"))
        raise HostSumsUnsupportedError(
            "Offload(accumulate_on='host') cannot check the accumulated gradients for infs on the host: the step reads "
            f"the GradScaler's found_inf ({getattr(first.target, '__name__', first.target)}"
            f"{f', {where}' if where else ''}) before the host checks are done. Use Offload(accumulate_on='device') "
            f"for this step. {AUTO_SUMS_HINT}")
    meta = {k: flag.meta[k] for k in ("stack_trace",) if k in flag.meta}
    with g.inserting_before(first):
        values, moved = list(fetched_flags), []
        if host_flags:
            fetched = g.call_function(ops.prefetch_to_device.default, (host_flags, device, tickets))
            values += [g.call_function(operator.getitem, (fetched, i)) for i in range(len(host_flags))]
            ticket = g.call_function(operator.getitem, (fetched, len(host_flags)))
            waited = g.call_function(ops.wait_device.default, (ticket, values[len(fetched_flags):]))
            moved = [fetched, *values[len(fetched_flags):], ticket, waited]
        combined = flag
        made = []
        for value in values:
            combined = g.call_function(aten.maximum.default, (combined, value))
            made.append(combined)
    for node in moved:
        _made(node, meta, "transfer")
    for node in made:
        _made(node, meta, "optimizer")
    for user in later:
        user.replace_input_with(flag, combined)


def norm_on_host(g: fx.Graph, norm: HostNorm, drained: fx.Node, host: fx.Node, out: fx.Node,
                 device: torch.device, meta: dict, along: fx.Node | None = None) -> fx.Node | None:
    """Compute `norm` (of one accumulated gradient whose sum is on the host) there: right after
    `drained` (`drain_on_host`: `host` is then the accumulated gradient, which the host update
    reads later), the worker takes its norm into the 0-d host scratch `out`; just before the step first
    reads the norm (combining the norms into the global one, after backward), the norm comes
    back to the device and replaces the device one. The chain orders every host update after
    its drain: the update waits for the clip coefficient's copy, made from the global norm.
    `along`: a 0-d host tensor made by the chain before the norm (the host inf check's flag,
    `drained` being then that check's ticket), fetched with the norm; returns its device value."""
    with g.inserting_after(drained):
        normed = g.call_function(ops.host_grad_norm_.default, (drained, [host], [out], norm.ord, norm.foreach))
    users = list(norm.value.users)
    first = users[0] if len(users) == 1 else min(users, key=_positions(g).__getitem__)
    with g.inserting_before(first):
        fetched = g.call_function(ops.prefetch_to_device.default, ([out, *([along] if along is not None else [])],
                                                                   device, [normed]))
        value = g.call_function(operator.getitem, (fetched, 0))
        extra = [g.call_function(operator.getitem, (fetched, 1))] if along is not None else []
        ticket = g.call_function(operator.getitem, (fetched, 1 + len(extra)))
        waited = g.call_function(ops.wait_device.default, (ticket, [value, *extra]))
    for node, phase in ((normed, "optimizer"), (fetched, "transfer"), (value, "transfer"), *((e, "transfer") for e in extra),
                        (ticket, "transfer"), (waited, "transfer")):
        _made(node, meta, phase)
    norm.value.replace_all_uses_with(value)
    value.meta["val"] = norm.value.meta["val"]
    for node in dict.fromkeys([norm.value, norm.reduction]):
        g.erase_node(node)
    return extra[0] if extra else None


def _positions(g: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(g.nodes)}


@dataclass
class SumPlacement:
    """Where the running sums live under `Offload(accumulate_on="auto")`, shared by the two
    compiled variants of one step (and its re-plans) through `PassContext.grad_sum_placement`.

    Buckets are the updating variant's (the accumulating one has no updates to bucket): `groups`
    lists those whose sums may move, in the order they would (backward order: see
    `candidate_groups`). `peaks[update]` is a variant's predicted device peak with the sums of the
    first m groups on the host, m = 0 .. len(groups). `host` is the decision, once made."""

    budget: int | None
    host: frozenset[str] | None = None
    groups: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    peaks: dict[bool, tuple[int, ...]] = field(default_factory=dict)
    chosen: int = 0                   # how many groups moved
    methods: dict[bool, str] = field(default_factory=dict)   # per variant: "model" or "trials" (predicted_peaks)
    pinned: frozenset[str] = frozenset()   # sums kept on the device because the step reads them there
    # no m's peaks (activations kept) fit the budget: with activations="auto" the m of least need
    # chosen, and the real compile's activation planner left to meet it (`_decide`)
    unfitted: bool = False
    trials: int = 0   # trial compiles run for `peaks` (none where both variants' came from the plan cache)
    reused: dict[bool, str] = field(default_factory=dict)   # per variant: the plan cache file its peaks came from

    def hosted(self, m: int) -> frozenset[str]:
        return frozenset(name for _, names in (self.groups or ())[:m] for name in names)

    def describe(self, budget_text: int | str) -> str:
        """The decision in a line, for the `grad_sum_placement` note."""
        m, peaks = self.chosen, self.peaks
        chosen = (f"accumulate_on='auto': {m} of {len(self.groups)} movable buckets' sums on the host, predicted peaks "
                  f"{format_bytes(peaks[False][m])} accumulating and {format_bytes(peaks[True][m])} updating")
        device = f"(all on the device: {format_bytes(peaks[False][0])} and {format_bytes(peaks[True][0])})"
        if not self.unfitted:
            return f"{chosen} within gpu_memory_budget {budget_text} {device}"
        return (f"{chosen} with the saved activations kept, over gpu_memory_budget {budget_text} at every count of "
                f"buckets moved {device}: the count with the least need chosen, and the activation planner "
                "(activations='auto') left to meet the budget")


@dataclass(frozen=True)
class StepSums:
    """`Offload(accumulate_on="auto")` under ZeRO: where ALL running sums of a step live, chosen
    once from the accumulating variant's predicted device peak with every sum on the device
    (`device_peak`) and with every sum on the host (`host_peak`), both from trial compiles and
    taken as their max over the ranks, so every rank runs the same collectives. Without a budget
    no trial runs and the peaks are None. `host_refused`: why host sums are refused for this step
    (a `HostSumsUnsupportedError` of a trial compile of either variant, on any rank), which keeps
    them on the device; None when they were not refused (or not tried: device sums fit). The
    passes read `where` as the step's accumulate_on."""

    where: Literal["device", "host"]
    budget: int | None
    device_peak: int | None = None
    host_peak: int | None = None
    host_refused: str | None = None
    # with activations="auto" and neither trial peak within the budget: the lesser taken, and the
    # real compile's activation planner left to meet the budget (`choose_step_sums`)
    unfitted: bool = False

    def describe(self) -> str:
        if self.budget is None:
            return "accumulate_on='auto': every running sum on the device (no gpu_memory_budget)"
        if self.unfitted:
            return (f"accumulate_on='auto': every running sum on the {self.where}: with the saved activations kept, "
                    f"the accumulating call's predicted peak fits gpu_memory_budget {format_bytes(self.budget)} with "
                    f"the sums neither on the device ({format_bytes(self.device_peak)}) nor on the host "
                    f"({format_bytes(self.host_peak)}): the lesser chosen, and the activation planner "
                    "(activations='auto') left to meet the budget")
        if self.host_refused is not None:
            return (f"accumulate_on='auto': every running sum on the device: the accumulating call's predicted peak "
                    f"with them, {format_bytes(self.device_peak)}, does not fit gpu_memory_budget "
                    f"{format_bytes(self.budget)}, but this step refuses host sums ({self.host_refused}), so the "
                    "budget may not be met")
        fits = "fits" if self.where == "device" else "does not fit"
        return (f"accumulate_on='auto': every running sum on the {self.where}: the accumulating call's predicted "
                f"peak with the sums on the device, {format_bytes(self.device_peak)}, {fits} gpu_memory_budget "
                f"{format_bytes(self.budget)} (with them on the host: {format_bytes(self.host_peak)})")


def choose_step_sums(budget: int | None, device_peak: int | None, host_peak: int | None,
                     host_refused: str | None = None, plan_activations: bool = False) -> StepSums:
    """Device sums (one reduction per update) when there is no budget, the accumulating call's
    predicted peak with them fits it, or the step refuses host sums (`host_refused`, why); else
    host sums (a reduce-scatter per call, no sums on the device), whose own fit the real compile's
    planner checks against the budget as usual. The peaks are the trials', activations kept: with
    `plan_activations` (activations="auto") and neither within the budget, the lesser is taken
    (device sums when equal) and the real compile's activation planner left to meet the budget."""
    if budget is None or device_peak is None or device_peak <= budget or host_refused is not None:
        return StepSums("device", budget, device_peak, host_peak, host_refused)
    if plan_activations and host_peak is not None and host_peak > budget:
        return StepSums("host" if host_peak < device_peak else "device", budget, device_peak, host_peak, unfitted=True)
    return StepSums("host", budget, device_peak, host_peak)


def candidate_groups(kernels: list[UpdateKernel], names_of: list[list[str]], pinned: frozenset[str]
                     ) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The buckets whose sums may move to the host, in the order they move. Every bucket saves
    on the device exactly the bytes its copy moves each micro-batch (the copy is in the
    gradient's own dtype, and the host add is linear in it too), so bytes saved per second of
    added link and CPU time is the same for all; what differs is how much of them hides: a
    bucket whose gradients are final earlier in backward has more of backward left to run
    beside its copy and add. So buckets move in backward order (the order of their updates).
    Buckets with a gradient the step reads on the device (`pinned`) never move."""
    return tuple((str(k.node.meta.get("bucket", b)), tuple(names)) for b, (k, names) in enumerate(zip(kernels, names_of))
                 if not pinned & set(names))


def place_sums(graph: TrainGraph, ctx: PassContext, update: bool, sums: list[str],
               groups: Callable[[frozenset[str]], tuple[tuple[str, tuple[str, ...]], ...]],
               trial: Trial, device_reads: Callable[[], frozenset[str]] = frozenset,
               cache_key: Callable[[bool], str | None] = lambda update: None) -> frozenset[str] | None:
    """The parameters whose running sums live on the host in this compile. "device"/"host":
    none/all. "auto": the step's `SumPlacement` decides once; a variant compiled before the
    decision records its predicted peak with each number of buckets moved (`predicted_peaks`,
    from `trial` compiles of copies of the graph under `trial_context`), and returns None when
    the other variant's peaks are still missing (a probe: the step discards its graph).
    `device_reads`: the parameters whose accumulated gradient the updating variant reads on the
    device besides its update and clip_grad_norm_ (`read_on_device`): their sums never move.
    `cache_key(update)`: the on-disk plan cache's key of a variant's peaks once `placement.groups`
    is set (offload_optimizer's; None: not cached): a restarted job reads them from there instead
    of compiling the trials, and a first job stores them."""
    where = ctx.config.offload.accumulate_on
    if where != "auto" or not sums:
        return frozenset(sums) if where == "host" else frozenset()
    placement = ctx.grad_sum_placement
    if placement is None:
        raise UnsupportedError("Offload(accumulate_on='auto') needs the step's sum placement in the PassContext "
                               "(grad_sum_placement): compile through offload_compile, or pick 'device' or 'host'")
    if placement.host is not None:
        return placement.host
    if placement.budget is None:   # no budget pressure: every sum stays on the device
        placement.host = frozenset()
        return placement.host
    if update not in placement.peaks:   # a variant asked again (offload_optimizer's plan-cache key asks first): once
        if update:
            placement.pinned = device_reads()
            placement.groups = groups(placement.pinned)
        elif placement.groups is None:
            raise UnsupportedError("Offload(accumulate_on='auto'): the accumulating variant was planned before the "
                                   "updating one recorded its buckets; please report this")
        key = cache_key(update)
        cached = load_sum_peaks(key, len(placement.groups) + 1) if key is not None else None
        if cached is not None:   # a restarted job: the trials' outcome from the on-disk plan cache
            placement.peaks[update], placement.methods[update] = cached
            placement.reused[update] = plan_path(key, "sums")
        else:
            def counted(g: TrainGraph, c: PassContext) -> tuple[TrainGraph, dict[str, int]]:
                placement.trials += 1
                return trial(g, c)
            placement.peaks[update], placement.methods[update] = predicted_peaks(graph, ctx, placement, update, counted)
            if key is not None:
                store_sum_peaks(key, placement.peaks[update], placement.methods[update])
    if len(placement.peaks) < 2:
        return None
    offload = ctx.config.offload
    _decide(placement, offload.gpu_memory_budget, plan_activations=offload.activations == "auto")
    return placement.host


def trial_context(ctx: PassContext, host: frozenset[str]) -> PassContext:
    """A context that compiles one candidate placement for its predicted peak only: no budget
    check, every bucket on the CPU path (the least device memory an update can take; the real
    compile's planner puts a bucket on the device path only where that fits the budget), saved
    activations kept (activations='auto' may lower the real peak further)."""
    offload = dataclasses.replace(ctx.config.offload, gpu_memory_budget=None, device_updates="never",
                                  activations="keep", plan_cache=False, replan_after=0)
    return dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, offload=offload), timings={},
                               measured_node_seconds=None,
                               grad_sum_placement=SumPlacement(None, host=host))


def trial_peak(graph: TrainGraph, ctx: PassContext, host: frozenset[str], trial: Trial) -> int:
    """The exact predicted device peak of one variant with the sums of `host` on the host: a
    trial compile of a copy of the graph, its liveness analysis and the allocator's unseen bytes."""
    out, unseen = trial(graph.copy(), trial_context(ctx, host))
    return analyze_memory(out).peak + sum(unseen.values())


def trial_peaks(graph: TrainGraph, ctx: PassContext, placement: SumPlacement, trial: Trial) -> tuple[int, ...]:
    """One trial compile per number m of groups moved (0 .. len(groups)): exact, and the oracle
    `predicted_peaks` is tested against, but a whole rewrite and analysis per m."""
    return tuple(trial_peak(graph, ctx, placement.hosted(m), trial) for m in range(len(placement.groups) + 1))


def predicted_peaks(graph: TrainGraph, ctx: PassContext, placement: SumPlacement, update: bool, trial: Trial
                    ) -> tuple[tuple[int, ...], str]:
    """A variant's predicted device peak for every m, and how it was found: "model" (two trial
    compiles, m = 0 and m = all, and `modelled_peaks` for every m from the first, which must
    give both trials' peaks exactly), else "trials" (`trial_peaks`: the rewrite has a form the
    model does not cover, or it disagreed)."""
    movable = len(placement.groups)
    if movable == 0:
        return trial_peaks(graph, ctx, placement, trial), "trials"
    base, unseen = trial(graph.copy(), trial_context(ctx, frozenset()))
    exact = (analyze_memory(base).peak + sum(unseen.values()), trial_peak(graph, ctx, placement.hosted(movable), trial))
    try:
        peaks = modelled_peaks(base, unseen, placement.groups, update)
    except _Unmodelled:
        peaks = None
    if peaks is None or (peaks[0], peaks[-1]) != exact:
        return trial_peaks(graph, ctx, placement, trial), "trials"
    return peaks, "model"


class _Unmodelled(Exception):
    """The trial graph is not in the form `modelled_peaks` models."""


def _only(values: list, what: str):
    if len(values) != 1:
        raise _Unmodelled(what)
    return values[0]


def _summed(cells: list[tuple[int, int, int]], rows: int, columns: int) -> torch.Tensor:
    """A rows x columns int64 matrix holding the sum of the values of the (row, column, value) cells."""
    out = torch.zeros(rows, columns, dtype=torch.int64)
    row, column, value = (torch.tensor(c, dtype=torch.int64) for c in zip(*cells))
    return out.index_put_((row, column), value, accumulate=True)


def modelled_peaks(base: TrainGraph, unseen: dict[str, int], groups: tuple[tuple[str, tuple[str, ...]], ...],
                   update: bool) -> tuple[int, ...]:
    """Each variant's predicted device peak with the sums of the first m groups on the host, for
    every m, from ONE trial compile with every sum on the device (`base`, under trial_context).

    Why this is exact: moving a sum changes nothing but a few nodes beside the sum's own adds,
    so the graph with m groups moved is `base` with, per moved group, known nodes dropped,
    known nodes inserted and known storages living over other spans, which the rewrite above
    fixes (`accumulate_on_host`, `drain_host_sums`, `_emit_cpu_path`):

    - every moved sum's placeholder leaves the device: its bytes leave every position;
    - accumulating call: the add `sum.add_(grad)` (one position) becomes four, the wait for the
      last call's add, the copy of `grad` (which reads it where the add did), the host add and
      its hand-over; the copy's and the add's tickets live from their node to the next one;
    - updating call: the add `final = grad + sum` and the sum's `zero_` go; everything that
      read `final` (and its views) reads `grad`, so `grad`'s storage lives until `final`'s
      last reader and `final`'s storage is gone; before the bucket's copy to the host come the
      waits for the sums' adds, after it the drain, which now reads the copy's ticket (so it
      dies there) and hands its own ticket to the update.

    So each storage is an interval over the positions of `base` plus these inserted ones, each
    present always, only with group j on the device, or only with j on the host. Live bytes are
    summed by difference arrays, one row per group, and the variant with m groups moved is the
    first m + 1 rows summed: all m at once, in time linear in the graph plus groups x nodes of
    vector work, instead of a rewrite and a liveness analysis per m. `predicted_peaks` checks
    the model against the trials at m = 0 and m = all, and `tests/test_accumulation_offload.py`
    against a trial at every m (equal to the byte)."""
    storages = StorageMap(base.graph)
    nodes, position = storages.nodes, storages.position
    n = len(nodes)
    on_host = {spec.name for spec in base.signature.inputs if spec.host}
    placeholders = base.placeholders()
    sum_of = {spec.target: placeholders[spec.name] for spec in base.signature.inputs if spec.kind == "grad_sum"}
    with fake_mode_of(base.graph):
        ticket = block_bytes(VALUE_RULES[ops.copy_to_host.default]([], []))
        drain_ticket = block_bytes(VALUE_RULES[ops.host_accumulate_.default](None, [], [], True))
    before: dict[int, list] = {}   # extra positions, inserted before / after a node of base
    after: dict[int, list] = {}
    intervals: list[tuple[object, object, int, int]] = []   # (first, last, bytes, row): +bytes in row
    presence: list[tuple[object, int, int]] = []            # (position, row, +1 or -1): present from that row on
    held = [0] * len(groups)      # per group: the largest device copy its host form adds (unseen copy_held)
    touched: set[int] = set()     # storages whose interval depends on a group

    def span_of(sid: int) -> tuple[int, tuple[int, int] | None]:
        if sid in touched:
            raise _Unmodelled("a storage shared by two groups' gradients")
        touched.add(sid)
        return storage_span(storages, sid, on_host)

    def device_only(j: int, sid: int) -> tuple[int, tuple[int, int]]:
        nbytes, span = span_of(sid)
        if span is None:
            raise _Unmodelled("a gradient that is an input")
        intervals.append((span[0], span[1], nbytes, 0))
        intervals.append((span[0], span[1], -nbytes, j + 1))
        return nbytes, span

    for j, (_, names) in enumerate(groups):
        copies: list[fx.Node] = []
        for name in names:
            s = sum_of[name]
            nbytes, _ = span_of(_only(storages.of(s), "a sum's storage"))
            intervals.append(("start", "end", nbytes, 0))       # the device sum, resident
            intervals.append(("start", "end", -nbytes, j + 1))
            try:
                add, zeros = (_accumulating_add(name, s), []) if not update else _final_add(name, s)
            except UnsupportedError as e:
                raise _Unmodelled(str(e)) from e
            presence.extend((position[node], j + 1, -1) for node in [add, *zeros])   # the device form's only
            grad = add.args[1] if not update else add.args[0]
            g_sid = _only(storages.of(grad), "a gradient's storage")
            if g_sid in storages.output_reads or (update and set(storages.of(add)) & storages.output_reads):
                raise _Unmodelled("the step returns a gradient")
            g_bytes, g_span = device_only(j, g_sid)
            if not update:
                at = position[add]
                labels = [("accumulate", name, what) for what in ("wait", "copy", "add", "hand_over")]
                after.setdefault(at, []).extend(labels)
                presence.extend((label, j + 1, 1) for label in labels)
                others = [a.position for a in storages.accesses[g_sid] if a.node is not add]
                last = max(others, default=-1)
                intervals.append((g_span[0], last if last > at else labels[1], g_bytes, j + 1))
                intervals.append((labels[1], labels[2], ticket, j + 1))
                intervals.append((labels[2], labels[3], drain_ticket, j + 1))
                if grad.meta["val"].device.type == "cuda":
                    held[j] = max(held[j], grad.meta["val"].numel() * grad.meta["val"].element_size())
                continue
            f_sid = _only(storages.of(add), "the final gradient's storage")
            device_only(j, f_sid)
            last = max(a.position for sid in (g_sid, f_sid) for a in storages.accesses[sid] if a.node is not add)
            intervals.append((g_span[0], last, g_bytes, j + 1))
            readers = [u for u in add.users] + [r for u in add.users if u.target is aten.detach.default
                                                 for r in u.users]
            copies += [r for r in readers if r.target is ops.copy_to_host.default]
        if update:
            # the waits for the sums' adds go before each copy of the bucket's gradients (one, or
            # one per gradient when they leave as they are final and the update waits past
            # backward), the drain right after the copy whose ticket the host update reads
            copies = list(dict.fromkeys(copies))
            for c, copy in enumerate(copies):
                before.setdefault(position[copy], []).append(("waits", j, c))
                presence.append((("waits", j, c), j + 1, 1))
            updates = [u for h in copies[0].args[1] for u in h.users if u.target is not ops.copy_to_host.default]
            ticket_of = _only(list(dict.fromkeys(u.args[0] for u in updates)), "one host update of a bucket")
            if ticket_of.target is not ops.copy_to_host.default:
                raise _Unmodelled("a host update that does not follow a copy")
            at, drain = position[ticket_of], ("drain", j)
            after.setdefault(at, []).append(drain)
            presence.append((drain, j + 1, 1))
            t_bytes, t_span = device_only(j, _only(storages.of(ticket_of), "a copy's ticket"))
            intervals.append((t_span[0], drain, t_bytes, j + 1))
            intervals.append((drain, max(t_span[1], at), drain_ticket, j + 1))
    # number every position: base's nodes with the inserted ones around them
    slot: dict[object, int] = {}
    main = []
    for i in range(n):
        for label in before.get(i, ()):
            slot[label] = len(slot)
        main.append(len(slot))
        slot[("node", i)] = len(slot)
        for label in after.get(i, ()):
            slot[label] = len(slot)
    size = len(slot)

    def index(at: object) -> int:
        if at == "start":
            return 0
        if at == "end" or (isinstance(at, int) and at >= n):
            return size - 1
        return main[at] if isinstance(at, int) else slot[at]

    for sid in range(len(storages.creator)):   # what no group changes
        if sid not in touched:
            nbytes, span = storage_span(storages, sid, on_host)
            intervals.append(("start", "end", nbytes, 0) if span is None else (span[0], span[1], nbytes, 0))
    rows = len(groups) + 1
    # difference arrays: +bytes where an interval starts, -bytes after it ends, one row per group
    cells = [(row, index(first), nbytes) for first, _, nbytes, row in intervals] + \
        [(row, index(last) + 1, -nbytes) for _, last, nbytes, row in intervals]
    live = _summed(cells, rows, size + 1).cumsum(1).cumsum(0)[:, :size]
    # a position is present in variant m when its rows 0..m add up to more than nothing
    cells = [(row, index(at), change) for at, row, change in presence] + [(0, i, 1) for i in main]
    present = _summed(cells, rows, size).cumsum(0) > 0
    peaks = torch.where(present, live, torch.iinfo(torch.int64).min).amax(1).tolist()
    base_held = unseen.get("copy_held", 0)
    other = sum(unseen.values()) - base_held
    out, most = [], base_held
    for m, peak in enumerate(peaks):
        out.append(peak + other + most)
        if m < len(groups):
            most = max(most, held[m])
    return tuple(out)


def _decide(placement: SumPlacement, budget_text: int | str, plan_activations: bool = False) -> None:
    """Choose how many groups move (`placement.chosen`, `.host`, `.unfitted`) from both variants'
    peaks, predicted with the activations kept: the smallest m whose peaks fit the budget (the
    fewest host sums). When none fits: with `plan_activations` (activations="auto") the m of least
    need (the smallest among equals), the real compile's activation planner left to meet the
    budget (or to refuse it, naming the least peak it reached); else a refusal naming that need."""
    need = [max(a, u) for a, u in zip(placement.peaks[False], placement.peaks[True])]
    fits = [m for m, peak in enumerate(need) if peak <= placement.budget]
    if not fits:
        least = min(range(len(need)), key=need.__getitem__)
        if plan_activations:
            placement.chosen, placement.host, placement.unfitted = least, placement.hosted(least), True
            return
        pinned = (f"; the sums of {len(placement.pinned)} parameters stay on the device because the step reads "
                  "their accumulated gradients there (the step's own reads)") if placement.pinned else ""
        raise UnsupportedError(
            f"gpu_memory_budget {budget_text} cannot be met with accumulate_on='auto': with the running gradient "
            f"sums of {least} of {len(need) - 1} movable buckets on the host the step needs at least "
            f"{format_bytes(need[least])} ({need[least]:,} bytes) on the device (accumulating call "
            f"{format_bytes(placement.peaks[False][least])}, updating call "
            f"{format_bytes(placement.peaks[True][least])}){pinned}. Raise the budget to at least that, or "
            "reduce the micro-batch, or let Offload(activations='auto') recompute or offload saved activations")
    placement.chosen, placement.host, placement.unfitted = fits[0], placement.hosted(fits[0]), False
