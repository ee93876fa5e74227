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

fp32 addition commutes, so `g + sum` on the host gives the device form's bits. What cannot
work this way is a step that reads the accumulated gradient on the device besides its update
(`clip_grad_norm_`'s norm, a GradScaler's inf checks): capture records such reads even on an
accumulating call (where `.grad` is None), so the first call refuses it, before anything runs.

`Offload(accumulate_on="auto")` chooses per bucket (`SumPlacement`): sums stay on the device
while the predicted peaks of both compiled variants fit `gpu_memory_budget`; otherwise buckets
move to the host, in backward order, until they fit. The choice is made once, when both
variants' predicted peaks are known (the step compiles the other variant as a probe first), and
both variants read it from the one `SumPlacement` the step keeps, so they always agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx

from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.errors import UnsupportedError
from graphoffload.graph import InputSpec, TrainGraph, fake_mode_of, placeholder_name
from graphoffload.memory import format_bytes
from graphoffload.ops.host_transfer import grad_sum_key
from graphoffload.passes.update_kernels import UpdateKernel

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

aten = torch.ops.aten
ops = torch.ops.graphoffload
SUM_DTYPE = torch.float32


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
        with fake_mode_of(graph.graph):
            node.meta["val"] = torch.empty(node.meta["val"].shape, dtype=SUM_DTYPE, device="cpu")
        sums[spec.target] = node
    return sums


def _refuse(name: str, reader: fx.Node, what: str) -> UnsupportedError:
    where = user_line_of_stack_trace(reader.meta.get("stack_trace"))
    return UnsupportedError(
        f"Offload(accumulate_on='host') cannot keep the running gradient sum of {name} on the host: {what} "
        f"({getattr(reader.target, '__name__', reader.target)}{f', {where}' if where else ''}). Use "
        "Offload(accumulate_on='device') for this step (clip_grad_norm_ and a GradScaler read the accumulated "
        "gradient on the device)")


def wait_for_sums(g: fx.Graph, before: fx.Node, sums: list[tuple[str, fx.Node]], hosts: list[fx.Node]
                  ) -> list[fx.Node]:
    """Right before `before`, this call's first copy into the host gradient buffers `hosts` of
    the running sums `sums` ((parameter, placeholder) pairs): wait for the CPU adds into those
    sums that an earlier accumulating call handed over (they still read the same buffers). The
    first call, or one after a synchronization, finds nothing to wait for."""
    with g.inserting_before(before):
        return [g.call_function(ops.wait_handed_over.default, ([s, h], grad_sum_key(name)))
                for (name, s), h in zip(sums, hosts)]


def accumulate_on_host(graph: TrainGraph, specs: list[InputSpec], sums: dict[str, fx.Node]) -> None:
    """The accumulating call: each `sum.add_(grad)` becomes a copy of `grad` to a host buffer
    and an add into the host sum on the worker. The call does not wait for the adds: it hands
    each over (`hand_over`, key `grad_sum_key(name)`), so they run on beside the next call's
    forward; that call waits for one right before it first touches the same sum (its copy into
    the sum's host buffer), and `synchronize()` (a checkpoint, a recompile) waits for all."""
    g = graph.graph
    for name, s in sums.items():
        adds = [u for u in s.users if u.target is aten.add_.Tensor and u.args[0] is s and len(u.args) == 2
                and not u.kwargs]
        if len(s.users) != 1 or len(adds) != 1 or adds[0].users:
            raise _refuse(name, next(iter(s.users)), "the accumulating call does more with it than add the "
                          "micro-batch's gradient")
        add = adds[0]
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
            node.meta.update(meta, phase=phase)
        g.erase_node(add)
    graph.note("offload_optimizer", f"{len(sums)} running gradient sums: their CPU adds run on after the call returns; "
               "the next call waits for each right before it first touches that sum (its copy into the sum's host "
               "buffer), synchronize() (a checkpoint, a recompile) for all", "sums_handed_over", sums=len(sums))


def drain_host_sums(k: UpdateKernel, names: list[str], sums: dict[str, fx.Node]) -> list[tuple[str, fx.Node]]:
    """The updating call, for one bucket: drop the device adds `g + sum` that made its gradients
    final (and the zeroing of the sums after the update); returns the bucket's sums, in the
    order of its gradients with their parameters' names, for `host_accumulate_(..., drain=True)`
    after their copy (which waits for the adds an accumulating call handed over: `wait_for_sums`)."""
    unit = {k.node, *k.nodes}
    out = []
    for name in names:
        s = sums[name]
        adds = [u for u in s.users if u.target is aten.add.Tensor and u.args[1] is s and not u.kwargs]
        zeros = [u for u in s.users if u.target is aten.zero_.default and not u.users]
        if len(adds) != 1 or len(s.users) != 1 + len(zeros):
            raise _refuse(name, next(u for u in s.users if u not in adds + zeros),
                          "the updating call reads the sum itself")
        final, grad = adds[0], adds[0].args[0]
        for user in list(final.users):
            readers = list(user.users) if user.target is aten.detach.default else [user]
            outside = [r for r in readers if r not in unit]
            if user not in unit and outside:
                raise _refuse(name, outside[0], "the step reads the accumulated gradient on the device besides its "
                              "update")
        final.replace_all_uses_with(grad)
        for user in grad.users:   # the detached final gradient now aliases the micro-batch's gradient
            if user.target is aten.detach.default:
                with fake_mode_of(user.graph):
                    user.meta["val"] = grad.meta["val"].detach()
        for node in [final, *zeros]:
            node.graph.erase_node(node)
        out.append((name, s))
    return out


def grad_reads(graph: TrainGraph) -> tuple[frozenset[str], str]:
    """The parameters whose gradients the step's own code reads after backward (capture's
    `grad_reads` note: clip_grad_norm_, a GradScaler's unscale_/step), and where, as a phrase.
    An accumulating variant sees `.grad` as None there, so it reads this instead of the graph."""
    notes = graph.notes_of("capture", "grad_reads")
    if not notes:
        return frozenset(), ""
    fields = notes[0].fields
    where = user_line_of_stack_trace(fields["source"]) or (fields["source"] or "").splitlines()[0]
    return frozenset(fields["params"]), f"{fields['reader']}{f', {where}' if where else ''}"


def refuse_host_sums_read_on_device(graph: TrainGraph, sums: dict[str, fx.Node]) -> None:
    """Before anything runs: a step that reads the accumulated gradient on the device after
    backward cannot keep those sums on the host (its updating call would need them there)."""
    read, where = grad_reads(graph)
    if read & set(sums):
        raise UnsupportedError(
            f"Offload(accumulate_on='host') cannot keep the running gradient sums on the host: the step reads the "
            f"gradients of {len(read & set(sums))} parameters after backward ({where}), which on the updating call "
            "are the accumulated gradients, read on the device (clip_grad_norm_'s norm, a GradScaler's inf "
            "checks). Use Offload(accumulate_on='device'), or 'auto', which keeps those sums on the device")


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
    pinned: frozenset[str] = frozenset()   # sums kept on the device because the step reads them there

    def hosted(self, m: int) -> frozenset[str]:
        return frozenset(name for _, names in (self.groups or ())[:m] for name in names)


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
               peak_with: Callable[[TrainGraph, PassContext], int]) -> frozenset[str] | None:
    """The parameters whose running sums live on the host in this compile. "device"/"host":
    none/all. "auto": the step's `SumPlacement` decides once; a variant compiled before the
    decision records its predicted peak with each number of buckets moved (`peak_with` of a
    copy of the graph, compiled under `trial_context`), and returns None when the other
    variant's peaks are still missing (a probe: the step discards its graph)."""
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
    if update:
        placement.pinned = grad_reads(graph)[0]
        placement.groups = groups(placement.pinned)
    elif placement.groups is None:
        raise UnsupportedError("Offload(accumulate_on='auto'): the accumulating variant was planned before the "
                               "updating one recorded its buckets; please report this")
    placement.peaks[update] = tuple(peak_with(graph.copy(), trial_context(ctx, placement.hosted(m)))
                                    for m in range(len(placement.groups) + 1))
    if len(placement.peaks) < 2:
        return None
    _decide(placement, ctx.config.offload.gpu_memory_budget)
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


def _decide(placement: SumPlacement, budget_text: int | str) -> None:
    need = [max(a, u) for a, u in zip(placement.peaks[False], placement.peaks[True])]
    fits = [m for m, peak in enumerate(need) if peak <= placement.budget]
    if not fits:
        least = min(range(len(need)), key=need.__getitem__)
        pinned = (f"; the sums of {len(placement.pinned)} parameters stay on the device because the step reads "
                  "their accumulated gradients there (clip_grad_norm_, a GradScaler)") if placement.pinned else ""
        raise UnsupportedError(
            f"gpu_memory_budget {budget_text} cannot be met with accumulate_on='auto': with the running gradient "
            f"sums of {least} of {len(need) - 1} movable buckets on the host the step needs at least "
            f"{format_bytes(need[least])} ({need[least]:,} bytes) on the device (accumulating call "
            f"{format_bytes(placement.peaks[False][least])}, updating call "
            f"{format_bytes(placement.peaks[True][least])}){pinned}. Raise the budget to at least that, or "
            "reduce the micro-batch")
    placement.chosen = fits[0]
    placement.host = placement.hosted(fits[0])
