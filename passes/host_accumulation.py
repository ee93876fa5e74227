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
(`clip_grad_norm_`'s norm, a GradScaler's inf checks): that is refused, naming the reader.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.errors import UnsupportedError
from graphoffload.graph import InputSpec, TrainGraph, fake_mode_of, placeholder_name
from graphoffload.passes.update_kernels import UpdateKernel

aten = torch.ops.aten
ops = torch.ops.graphoffload
SUM_DTYPE = torch.float32


def move_sums_to_host(graph: TrainGraph, specs: list[InputSpec]) -> dict[str, fx.Node]:
    """Mark every running-sum placeholder as an fp32 host tensor (in `specs` and its meta
    val); returns parameter name -> placeholder."""
    placeholders = graph.placeholders()
    sums = {}
    for i, spec in enumerate(specs):
        if spec.kind != "grad_sum":
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


def accumulate_on_host(graph: TrainGraph, specs: list[InputSpec], sums: dict[str, fx.Node]) -> None:
    """The accumulating call: each `sum.add_(grad)` becomes a copy of `grad` to a host buffer
    and an add into the host sum on the worker. The step drains the worker before it returns,
    so the next call (or a checkpoint) sees the sums complete."""
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
            ticket.meta.update(meta, phase="transfer")
            with g.inserting_after(ticket):
                added = g.call_function(ops.host_accumulate_.default, (ticket, [s], [host], False))
            added.meta.update(meta, phase="optimizer")
        g.erase_node(add)


def drain_host_sums(k: UpdateKernel, names: list[str], sums: dict[str, fx.Node]) -> list[fx.Node]:
    """The updating call, for one bucket: drop the device adds `g + sum` that made its gradients
    final (and the zeroing of the sums after the update); returns the bucket's sums, in the
    order of its gradients, for `host_accumulate_(..., drain=True)` after their copy."""
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
        out.append(s)
    return out
