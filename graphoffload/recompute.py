"""Activation checkpointing as the user wrote it: `torch.utils.checkpoint` inside a captured step.

Non-reentrant checkpointing (`checkpoint(fn, *args, use_reentrant=False)`, and Hugging Face's
`gradient_checkpointing_enable()`, which uses it) frees a block's activations after its forward
and re-runs the block when backward first needs one of them. Under `make_fx` that re-run is
traced like any other code backward runs, so the captured graph already recomputes in backward
what the user asked, and liveness analysis sees the forward activations die early. Capture
only has to make the re-run trace as the forward did and say what it is:

* the step's TorchFunctionMode must also be active while backward runs (the recompute calls
  `F.scaled_dot_product_attention` again, which must become graphoffload's attention op as in
  forward, or the recomputed saved tensors differ from the forward's and checkpoint refuses);
* every op traced inside a checkpointed forward or its recompute is tagged with the region, so
  recomputed nodes carry ``meta["recompute"]`` (the region's name) and ``meta["recompute_of"]``
  (the forward node they repeat) and `explain()` lists the regions;
* random ops: eager checkpointing stashes the generator state at the region's entry and replays
  it for the recompute, so dropout draws the same masks twice. Tracing runs that stash on the
  real generator, which the graph never sees; capture therefore puts it in the graph: the state
  is read right before the region's first random op in forward (`graphoffload.rng_state`), set
  right before the recompute's first one and put back after its last
  (`graphoffload.swap_rng_state`), exactly as eager leaves the generator.

The reentrant form (`use_reentrant=True`) runs a second backward inside the first; it is
refused with a message saying to pass `use_reentrant=False`.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from graphoffload.errors import CaptureError, UnsupportedError
from graphoffload.ops.rng import draws_random_numbers, rng_state, swap_rng_state  # noqa: F401  (declares the ops)

_CHECKPOINT_FILE = torch_checkpoint.__file__
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CHECKPOINT_CODE = inspect.unwrap(torch_checkpoint.checkpoint).__code__


def is_checkpoint_code(code: CodeType) -> bool:
    """Whether `code` is torch.utils.checkpoint's: the innermost such frame on the stack when an op
    is traced is the region it belongs to (capture's stack walk finds it, `CheckpointRegions.tag`
    names it)."""
    return code.co_filename == _CHECKPOINT_FILE


@dataclass
class CheckpointRegions:
    """Tags what traces inside checkpointed code: forward regions ("fwd", i) in the order they
    run, recomputes ("re", j) in the order backward triggers them. Lives for one capture."""

    module_names: dict[int, str]                        # id(module) -> qualified name
    names: dict[int, str] = field(default_factory=dict)  # forward region index -> name
    in_backward: bool = False
    _frame: FrameType | None = None                     # the frame the current tag belongs to
    _tag: tuple[str, int] | None = None
    _count: dict[str, int] = field(default_factory=lambda: {"fwd": 0, "re": 0})

    @classmethod
    def of_modules(cls, modules: list[nn.Module]) -> CheckpointRegions:
        prefix = (lambda i: "") if len(modules) == 1 else (lambda i: f"model{i}.")
        names: dict[int, str] = {}
        for i, model in enumerate(modules):
            for name, mod in model.named_modules():
                names.setdefault(id(mod), (prefix(i) + name) or type(model).__name__)
        return cls(names)

    def tag(self, frame: FrameType | None) -> dict[str, Any]:
        """The annotation for an op traced now, `frame` the innermost frame on the stack whose
        code `is_checkpoint_code`: {} outside checkpointed code (`frame` None)."""
        if frame is None:
            return {}
        if self.in_backward == (frame.f_code is _CHECKPOINT_CODE):
            # the checkpoint() call itself while backward runs (a checkpoint inside a hook),
            # or checkpoint's machinery in forward: not a region we know how to pair
            return {}
        if frame is not self._frame:
            kind = "re" if self.in_backward else "fwd"
            self._frame, self._tag = frame, (kind, self._count[kind])
            self._count[kind] += 1
            if kind == "fwd":
                self.names[self._tag[1]] = self._region_name(frame)
        return {"checkpoint": self._tag}

    def release(self) -> None:
        self._frame = None

    def _region_name(self, frame: FrameType) -> str:
        """The checkpointed module's qualified name, else the function and its caller's line."""
        fn, args = frame.f_locals.get("function"), frame.f_locals.get("args") or ()
        while isinstance(fn, functools.partial):
            args = (*fn.args, *args)
            fn = fn.func
        owner = getattr(fn, "__self__", None) or fn
        if not isinstance(owner, nn.Module) and args and isinstance(args[0], nn.Module):
            owner = args[0]   # an unbound forward (Hugging Face checkpoints `Layer.forward`)
        if isinstance(owner, nn.Module) and id(owner) in self.module_names:
            return f"{self.module_names[id(owner)]} ({type(owner).__name__})"
        caller = frame.f_back
        while caller is not None and caller.f_code.co_filename.startswith(_TORCH_DIR):
            caller = caller.f_back
        where = f" at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}" if caller else ""
        return f"{getattr(fn, '__qualname__', type(fn).__name__)}{where}"


def refuse_reentrant(node: Any, where: str | None) -> None:
    """`node` is an autograd node backward will run: a reentrant checkpoint's is refused."""
    if type(node).__name__ == "CheckpointFunctionBackward":
        raise UnsupportedError(
            f"the train step uses torch.utils.checkpoint with use_reentrant=True"
            f"{f' (backward called at {where})' if where else ''}: its backward runs a second backward "
            "inside the first, which cannot be captured as one graph. Pass use_reentrant=False: "
            "`torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`, or for Hugging Face "
            "models `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})`.")


# --------------------------------------------------------------------------- after tracing

@dataclass(frozen=True)
class RecomputedRegion:
    name: str
    forward: tuple[str, ...]       # forward nodes of the region
    recomputed: tuple[str, ...]    # their recomputed copies in backward
    random: int                    # random ops replayed from the forward's generator state


def mark_recomputed(gm: fx.GraphModule, names: dict[int, str]) -> list[RecomputedRegion]:
    """Turn the capture-time tags into node meta (see the module docstring), pair every
    recomputed node with the forward node it repeats, and put the generator state of the
    region's random ops into the graph. Returns the recomputed regions in forward order."""
    fwd: dict[int, list[fx.Node]] = {}
    re: dict[int, list[fx.Node]] = {}
    policies: dict[fx.Node, CheckpointPolicy] = {}
    for node in gm.graph.nodes:
        tag = node.meta.pop("checkpoint", None)
        # selective checkpointing writes its policy here while a tracer runs (and leaves it for
        # every later node): read it inside regions, and free the key for graphoffload's own use
        policy = node.meta.pop("recompute", None)
        node.meta.pop("ac_graph_id", None)
        if tag is None or node.op != "call_function":
            continue
        kind, index = tag
        (fwd if kind == "fwd" else re).setdefault(index, []).append(node)
        if kind == "fwd" and isinstance(policy, CheckpointPolicy):
            policies[node] = policy
    selective = {i for i, nodes in fwd.items() if any(n in policies for n in nodes)}
    regions: list[tuple[int, list[fx.Node], list[fx.Node]]] = []
    unmatched = set(fwd) - selective
    for nodes in re.values():
        if all(n.target in _ALIASES for n in nodes):
            continue   # a selective region's "recompute" under a tracer: the cached values, detached
        index = _pair(nodes, fwd, unmatched)
        unmatched.discard(index)
        regions.append((index, fwd[index], nodes))
    out = []
    for index, forward, recomputed in sorted(regions, key=lambda r: r[0]):
        name = names.get(index, f"region {index}")
        for r in recomputed:
            r.meta["recompute"] = name
            r.meta.pop("grad_of", None)   # its autograd sequence number is the recompute's own
        random = _replay_random(gm.graph, [f for f in forward if draws_random_numbers(f)],
                                [r for r in recomputed if draws_random_numbers(r)])
        out.append(RecomputedRegion(name, tuple(f.name for f in forward),
                                    tuple(r.name for r in recomputed), random))
    for index in sorted(selective):
        name = names.get(index, f"region {index}")
        made = _recompute_selected(gm.graph, fwd[index], policies, name)
        if made:
            out.append(RecomputedRegion(name, tuple(f.name for f in fwd[index]), tuple(m.name for m in made), 0))
    return out


_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
_RECOMPUTE_POLICIES = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def _recompute_selected(graph: fx.Graph, forward: list[fx.Node], policies: dict[fx.Node, CheckpointPolicy],
                        name: str) -> list[fx.Node]:
    """Selective checkpointing (`create_selective_checkpoint_contexts`): under a tracer, torch
    keeps every value of the region and only records each op's policy, leaving the choice to
    the compiler. Honour it: the region's ops whose policy says recompute (and the views and
    detaches of their values) are copied into backward right before their first backward use,
    so their forward values die with the forward. Random and in-place ops are always saved
    (exact either way). Returns the copies."""
    region = set(forward)
    recompute: set[fx.Node] = set()
    for n in forward:   # graph order: a node's inputs are decided before it
        if draws_random_numbers(n) or getattr(getattr(n.target, "_schema", None), "is_mutable", False):
            continue
        inside = [a for a in n.all_input_nodes if a in region]
        if n in policies:
            if policies[n] in _RECOMPUTE_POLICIES:
                recompute.add(n)
        elif inside and all(a in recompute for a in inside):
            recompute.add(n)   # getitems, views and detaches of recomputed values
    copies: dict[fx.Node, fx.Node] = {}

    def copy_of(n: fx.Node, before: fx.Node) -> fx.Node:
        if n not in recompute:
            return n
        if n not in copies:
            for a in n.all_input_nodes:
                copy_of(a, before)
            with graph.inserting_before(before):
                c = graph.node_copy(n, lambda a: copies.get(a, a))
            c.meta = {k: v for k, v in n.meta.items() if k != "grad_of"}
            c.meta.update({"phase": "backward", "recompute": name, "recompute_of": n.name})
            copies[n] = c
        return copies[n]

    for node in list(graph.nodes):
        if node.meta.get("phase") != "backward" or node in copies.values():
            continue
        for a in node.all_input_nodes:
            if a in recompute:
                node.replace_input_with(a, copy_of(a, node))
    return list(copies.values())


def _pair(recomputed: list[fx.Node], fwd: dict[int, list[fx.Node]], candidates: set[int]) -> int:
    """The forward region `recomputed` repeats: the same ops, in the same order, on the same
    inputs (parameters and the region's own inputs) once recomputed values are mapped back.
    The recompute may skip ops nothing needs (early stop) but never reorders them; it starts
    from detached aliases of the region's inputs, which map to the inputs themselves."""
    best: tuple[int, int, dict[fx.Node, fx.Node]] | None = None
    for index in sorted(candidates):
        forward = fwd[index]
        mapping: dict[fx.Node, fx.Node] = {}
        paired: dict[fx.Node, fx.Node] = {}
        i = 0
        for r in recomputed:
            j = next((j for j in range(i, len(forward)) if _same_op(r, forward[j], mapping)), None)
            if j is None:
                if r.target is torch.ops.aten.detach.default:
                    mapping[r] = mapping.get(r.args[0], r.args[0])
                continue
            mapping[r] = paired[r] = forward[j]
            i = j + 1
        if best is None or len(paired) > best[1]:
            best = (index, len(paired), paired)
    if best is None or best[1] == 0:
        from graphoffload.diagnostics import user_line_of_stack_trace

        where = user_line_of_stack_trace(recomputed[0].meta.get("stack_trace"))
        raise CaptureError(
            f"a torch.utils.checkpoint region recomputed in backward{f' (at {where})' if where else ''} does not "
            "repeat any checkpointed forward region: the checkpointed function must run the same ops on the "
            "same inputs when backward re-runs it. Make it deterministic in its ops (no Python state that "
            "changes between forward and backward), or do not checkpoint it.")
    for r, f in best[2].items():
        r.meta["recompute_of"] = f.name
    return best[0]


def _same_op(r: fx.Node, f: fx.Node, mapping: dict[fx.Node, fx.Node]) -> bool:
    if r.target != f.target:
        return False
    args, kwargs = fx.map_arg((r.args, r.kwargs), lambda n: mapping.get(n, n))
    return args == f.args and kwargs == f.kwargs


def _replay_random(graph: fx.Graph, forward: list[fx.Node], recomputed: list[fx.Node]) -> int:
    if not recomputed:
        return 0
    first, begin, last = forward[0], recomputed[0], recomputed[-1]
    get, swap = torch.ops.graphoffload.rng_state.default, torch.ops.graphoffload.swap_rng_state.default
    with graph.inserting_before(first):
        state = graph.call_function(get, (_device_of(first),))
    _stamp(state, first)
    with graph.inserting_before(begin):
        before = graph.call_function(swap, (state, _device_of(begin)))
    _stamp(before, begin)
    with graph.inserting_after(last):
        after = graph.call_function(swap, (before, _device_of(last)))
    _stamp(after, last)
    return len(recomputed)


def _device_of(node: fx.Node) -> torch.device:
    """The device whose generator a random op draws from: that of what it returns."""
    from graphoffload.graph import tensor_vals

    return tensor_vals(node)[0].device


def _stamp(node: fx.Node, beside: fx.Node) -> None:
    from graphoffload.graph import fake_value

    node.meta["val"] = fake_value(node)
    node.meta.update({"pass": "capture", "phase": beside.meta["phase"]})
    if beside.meta.get("stack_trace"):
        node.meta["stack_trace"] = beside.meta["stack_trace"]
    if "recompute" in beside.meta:
        node.meta["recompute"] = beside.meta["recompute"]
