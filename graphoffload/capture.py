"""Capture a whole imperative train step (forward, backward, optimizer) as one fx graph.

The user's function runs once under `make_fx` with fake tensors: no real compute, no device
memory. While it runs, the model's parameters and buffers are swapped for traced tensors
(parameters as autograd leaves, so `loss.backward()` fills their `.grad`), `optimizer.step()`
and `zero_grad()` are swapped for graphoffload's lowering (optimizer_lowering.py), and a
TorchFunctionMode routes `F.scaled_dot_product_attention` to graphoffload's attention op and
marks everything `backward()` runs as the backward phase. All swaps are undone on exit,
whatever happens.

The graph is not functionalized: the fused optimizer kernels mutate parameters and state in
place, as they do eagerly, so a step needs no second copy of them. Mutation is confined to
placeholders the signature marks mutable; see passes/README.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.overrides import TorchFunctionMode

from graphoffload import nonfinite, optimizer_lowering
from graphoffload.aliasing import written_placeholders
from graphoffload.config import CompileConfig
from graphoffload.data_parallel import ZeRO, local_chunk, shard_parameter, shard_state
from graphoffload.diagnostics import (OWN_DIRS, calling_user_line, frame_line, is_installed_package, user_frame,
                                      user_line_of_stack_trace, where_in_user_code)
from graphoffload.errors import CaptureError, GraphOffloadError, UnsupportedError, describe
from graphoffload.graph import (TENSOR_SLOT, GraphSignature, InputSpec, OutputSpec, TrainGraph, fake_mode_of,
                                placeholder_name)
from graphoffload.recompute import CheckpointRegions, is_checkpoint_code, mark_recomputed, refuse_reentrant
from graphoffload.torch_private import (GRAD_SCALER_STATE_ATTRIBUTES, STACK_TRACE_FILE_SUFFIX,
                                       DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                                       ShapeEnv, functorch_config,
                                       given_stack_trace, grad_fn_sequence_number,
                                       grad_fn_sequence_numbers_supported, grad_scaler_state, make_fx, pytree,
                                       recorded_stack_trace, rename_node, reset_grad_fn_sequence_number,
                                       set_grad_fn_sequence_number, stack_trace_recording)
from graphoffload.ops import grouped_mm as _grouped_mm
from graphoffload.ops import register_fused_optimizer_meta_kernels
from graphoffload.ops.fused_optimizer_meta import is_fused_update
from graphoffload.ops.attention import sdpa_via_attention


# --------------------------------------------------------------------------- what the step touches

@dataclass
class StepBindings:
    """Where every placeholder's tensor lives in the user's objects, for capture and runtime."""

    modules: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    params: dict[str, nn.Parameter]                       # name -> parameter
    buffers: dict[str, tuple[nn.Module, str]]             # name -> (owning module, attribute)
    state_keys: list[tuple[str, str]]                     # (param name, state key)
    lr_groups: list[tuple[int, int]]                      # (optimizer index, group index)
    param_names: dict[int, str] = field(default_factory=dict)   # id(param) -> name
    scalers: list[torch.amp.GradScaler] = field(default_factory=list)   # enabled loss scalers

    def scaler_state(self, index: int, key: str) -> Tensor:
        # GradScaler keeps these as private attributes and offers no public handle on them
        scaler = self.scalers[index]
        return grad_scaler_state(scaler, key)

    def buffer(self, name: str) -> Tensor:
        module, attr = self.buffers[name]
        return module._buffers[attr]

    @property
    def device(self) -> torch.device:
        """The device of the step's parameters (the CPU for a step without any)."""
        return next(iter(self.params.values())).device if self.params else torch.device("cpu")

    def optimizer_of(self, param_name: str) -> torch.optim.Optimizer:
        param = self.params[param_name]
        for opt in self.optimizers:
            if any(p is param for g in opt.param_groups for p in g["params"]):
                return opt
        raise KeyError(param_name)

    def state(self, param_name: str, key: str) -> Tensor:
        return self.optimizer_of(param_name).state[self.params[param_name]][key]

    def lr(self, opt_index: int, group_index: int) -> float:
        lr = self.optimizers[opt_index].param_groups[group_index]["lr"]
        return float(lr.item() if isinstance(lr, Tensor) else lr)


def _closure_objects(fn: Callable) -> list[Any]:
    try:
        cv = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return []
    return list(cv.nonlocals.values()) + list(cv.globals.values())


def find_bindings(fn: Callable, args: tuple, kwargs: dict) -> StepBindings:
    """Find the models and optimizers among the step's arguments and closure."""
    candidates = pytree.tree_leaves((args, kwargs)) + _closure_objects(fn)
    modules: list[nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    scalers: list[torch.amp.GradScaler] = []
    for obj in candidates:
        if isinstance(obj, nn.Module) and not any(obj is m for m in modules):
            modules.append(obj)
        elif isinstance(obj, torch.optim.Optimizer) and not any(obj is o for o in optimizers):
            optimizers.append(obj)
        elif isinstance(obj, torch.amp.GradScaler) and obj.is_enabled() and not any(obj is s for s in scalers):
            scalers.append(obj)
    if not modules:
        raise CaptureError("no nn.Module found among the train step's arguments or closure; pass "
                           "the model as an argument of the decorated function")
    # a module that is a submodule of another one found is not a model of its own
    modules = [m for m in modules if not any(m is not o and any(m is s for s in o.modules()) for o in modules)]
    prefix = (lambda i: "") if len(modules) == 1 else (lambda i: f"model{i}.")
    params: dict[str, nn.Parameter] = {}
    param_names: dict[int, str] = {}
    buffers: dict[str, tuple[nn.Module, str]] = {}
    for i, model in enumerate(modules):
        for name, p in model.named_parameters():
            if id(p) not in param_names:
                params[prefix(i) + name] = p
                param_names[id(p)] = prefix(i) + name
        for mod_name, mod in model.named_modules():
            for attr, buf in mod._buffers.items():
                if buf is not None:
                    buffers[prefix(i) + (f"{mod_name}.{attr}" if mod_name else attr)] = (mod, attr)
    state_keys, lr_groups = _optimizer_bindings(optimizers, param_names)
    return StepBindings(modules, optimizers, params, buffers, state_keys, lr_groups, param_names, scalers)


def _optimizer_bindings(optimizers: list[torch.optim.Optimizer], param_names: dict[int, str]
                        ) -> tuple[list[tuple[str, str]], list[tuple[int, int]]]:
    """The (param name, state key) of every optimizer-state tensor and the (optimizer, group) of
    every learning rate."""
    state_keys: list[tuple[str, str]] = []
    lr_groups: list[tuple[int, int]] = []
    optimized: set[int] = set()
    for oi, opt in enumerate(optimizers):
        rule = optimizer_lowering.rule_for(opt)
        for gi, group in enumerate(opt.param_groups):
            lr_groups.append((oi, gi))
            for p in group["params"]:
                if id(p) not in param_names:
                    from torch.distributed.tensor import DTensor

                    if isinstance(p, DTensor):   # a ZeRO stage 3 step's shard, replaced in the model
                        raise CaptureError(
                            f"{type(opt).__name__} holds a DTensor parameter of shape {tuple(p.shape)} that belongs "
                            "to none of the step's models: was a parameter a ZeRO stage 3 step sharded replaced in "
                            "the model? Load new values into the parameters the step made (set_model_state_dict, "
                            "torch.distributed.checkpoint) instead of replacing them")
                    raise CaptureError(f"{type(opt).__name__} holds a parameter of shape {tuple(p.shape)} "
                                       "that belongs to none of the step's models; pass its module too")
                if id(p) in optimized:   # its state is looked up by parameter alone
                    raise UnsupportedError(f"parameter {param_names[id(p)]} is held by more than one of the "
                                           "step's optimizers; give each parameter to one optimizer")
                optimized.add(id(p))
                if p.requires_grad:   # as in torch.optim, frozen parameters get no state
                    state_keys.extend((param_names[id(p)], k) for k in rule.state_keys(group))
    return state_keys, lr_groups


# --------------------------------------------------------------------------- tracing helpers

@contextlib.contextmanager
def _swapped_module_tensors(bindings: StepBindings, params: dict[str, Tensor],
                            buffers: dict[str, Tensor]) -> Iterator[None]:
    """Point every module's parameters and buffers at traced tensors (tied weights stay tied)."""
    by_id = {id(p): params[name] for name, p in bindings.params.items()}
    saved: list[tuple[dict, str, Any]] = []
    try:
        for model in bindings.modules:
            for mod in model.modules():
                for attr, p in list(mod._parameters.items()):
                    if p is not None and id(p) in by_id:
                        saved.append((mod._parameters, attr, p))
                        mod._parameters[attr] = by_id[id(p)]
        for name, (mod, attr) in bindings.buffers.items():
            saved.append((mod._buffers, attr, mod._buffers[attr]))
            mod._buffers[attr] = buffers[name]
        yield
    finally:
        for store, attr, value in reversed(saved):
            store[attr] = value


@dataclass
class _StepEvents:
    order: list[str] = field(default_factory=list)
    # names of the parameters each zero_grad() clears, in the order of the "zero_grad" entries
    zeroed: list[frozenset[str]] = field(default_factory=list)
    subgroups: int = 0
    stepped: set[int] = field(default_factory=set)     # indices of the optimizers whose step() ran
    losses: list[Tensor] = field(default_factory=list)   # what each backward call differentiated
    skip_flag: Tensor | None = None   # CompileConfig.skip_nonfinite: 1 when this step's update is skipped
    # what the step's own code reads of the gradients after a backward, besides graphoffload's
    # lowered step()/zero_grad(): parameter name -> (the user's line, the reader), first read kept.
    # An accumulating variant sees every `.grad` as None there (clip_grad_norm_ then traces
    # nothing), so this is how it knows what its updating variant will read on the device
    grad_reads: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    own_code: int = 0    # > 0 while graphoffload's own step()/zero_grad() run (their reads do not count)


@contextlib.contextmanager
def _own_code(events: _StepEvents) -> Iterator[None]:
    events.own_code += 1
    try:
        yield
    finally:
        events.own_code -= 1


def _set_for_trace(stack: contextlib.ExitStack, obj: Any, attr: str, value: Any) -> None:
    """Set `obj.attr` (an instance attribute) until the trace ends, then restore it."""
    missing = object()
    before = vars(obj).get(attr, missing)
    setattr(obj, attr, value)
    stack.callback(lambda: vars(obj).pop(attr, None) if before is missing else setattr(obj, attr, before))


@contextlib.contextmanager
def _lowered_optimizers(bindings: StepBindings, leaves: dict[str, Tensor], states: dict[tuple[str, str], Tensor],
                        lrs: dict[tuple[int, int], Tensor], first_steps: list[set[str]],
                        config: CompileConfig, events: _StepEvents) -> Iterator[None]:
    """Swap each optimizer's step()/zero_grad() for graphoffload's traced lowering, and its
    param groups' parameters for the traced leaves (code in the step that walks
    `optimizer.param_groups`, such as GradScaler's inf checks, then sees the gradients)."""
    leaf_name = {id(t): name for name, t in leaves.items()}

    def make_step(oi: int, opt: torch.optim.Optimizer) -> Callable:
        def step(closure: Callable | None = None) -> None:
            if closure is not None:
                raise UnsupportedError("optimizer.step(closure) is not supported in a compiled step")
            events.order.append("step")
            events.stepped.add(oi)
            with _own_code(events):
                _lowered_step(oi, opt)

        def _lowered_step(oi: int, opt: torch.optim.Optimizer) -> None:
            # set by GradScaler.step() for optimizers that unscale inside their fused kernel
            grad_scale, found_inf = getattr(opt, "grad_scale", None), getattr(opt, "found_inf", None)
            if config.skip_nonfinite:
                if events.skip_flag is None:   # one decision for the whole step, from every gradient
                    grads = [t.grad for t in leaves.values() if t.grad is not None]
                    device = grads[0].device if grads else next(iter(leaves.values())).device
                    with torch.no_grad():
                        events.skip_flag = nonfinite.nonfinite_flag(events.losses, grads, device)
                flag = events.skip_flag
                found_inf = flag if found_inf is None else torch.maximum(found_inf, flag.to(found_inf.device))
            updates = []
            for gi, group in enumerate(opt.param_groups):
                names = [n for n in (leaf_name[id(p)] for p in group["params"]) if leaves[n].grad is not None]
                if not names:
                    continue
                updates.append(optimizer_lowering.TracedUpdate(
                    group, names, [leaves[n] for n in names], [leaves[n].grad for n in names],
                    lambda i, key, names=names: states[(names[i], key)], lrs[(oi, gi)], grad_scale, found_inf))
            with torch.no_grad():
                events.subgroups += optimizer_lowering.lower_step(
                    opt, updates, first_steps[oi], config.subgroup_numel, events.subgroups)
        return step

    def make_zero_grad(opt: torch.optim.Optimizer) -> Callable:
        def zero_grad(set_to_none: bool = True) -> None:
            events.order.append("zero_grad")
            events.zeroed.append(frozenset(leaf_name[id(p)] for g in opt.param_groups for p in g["params"]))
            with _own_code(events):
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad = None
        return zero_grad

    with contextlib.ExitStack() as stack:
        for oi, opt in enumerate(bindings.optimizers):
            _set_for_trace(stack, opt, "step", make_step(oi, opt))
            _set_for_trace(stack, opt, "zero_grad", make_zero_grad(opt))
            # the lowering's fused kernels unscale and skip on inf themselves
            _set_for_trace(stack, opt, "_step_supports_amp_scaling", True)
            for group in opt.param_groups:
                real = group["params"]
                group["params"] = [leaves[bindings.param_names[id(p)]] for p in real]
                stack.callback(group.__setitem__, "params", real)
        yield


@contextlib.contextmanager
def _recorded_module_zero_grad(bindings: StepBindings, events: _StepEvents) -> Iterator[None]:
    """`model.zero_grad()` in the step clears gradients as `optimizer.zero_grad()` does: record
    it alike, so the executor knows gradients left by an earlier call are discarded."""
    with contextlib.ExitStack() as stack:
        for module in bindings.modules:
            names = frozenset(bindings.param_names[id(p)] for p in module.parameters())

            def zero_grad(set_to_none: bool = True, module: nn.Module = module, names: frozenset = names) -> None:
                events.order.append("zero_grad")
                events.zeroed.append(names)
                with _own_code(events):
                    type(module).zero_grad(module, set_to_none)
            _set_for_trace(stack, module, "zero_grad", zero_grad)
        yield


@contextlib.contextmanager
def _swapped_scaler_state(bindings: StepBindings, traced: dict[tuple[int, str], Tensor],
                          accumulating: bool = False, events: _StepEvents | None = None,
                          leaf_names: dict[int, str] | None = None) -> Iterator[None]:
    """Point each GradScaler at traced copies of its scale and growth tracker (graph inputs it
    updates in place), and give it back its per-step bookkeeping afterwards.

    `accumulating` (the variant of `accumulation_steps=k` that only adds into the running sums):
    the scaler's `unscale_`, `step` and `update` do nothing, as `optimizer.step()` does nothing
    there. Eager accumulation calls them once a window, so the scale stays the same across the
    window's micro-batches, and the updating call unscales, checks and updates on the sums.
    A skipped `unscale_(opt)` or `step(opt)` is recorded in `events.grad_reads` for every
    parameter of `opt`: on the updating call it reads their accumulated gradients on the device.
    A skipped `step(opt)` also counts `opt` as stepped (`events.stepped`), as the `optimizer.step()`
    of a step without a scaler does on its accumulating call: what the window's update updates
    (capture's `accumulation` note, `updated`) is read from it, and ZeRO stage 3 shards exactly
    those parameters on the accumulating call (left out, they stayed whole there, bound to the
    tensors the updating call's sharding had replaced, so the window after the first read stale
    parameters)."""
    def skipped(*args: Any, method: str = "", **kwargs: Any) -> None:
        opt = args[0] if args else kwargs.get("optimizer")
        if events is not None and method == "step":
            events.stepped.update(i for i, o in enumerate(bindings.optimizers) if o is opt)
        if events is not None and leaf_names is not None and method in ("unscale_", "step") \
                and isinstance(opt, torch.optim.Optimizer):
            line = calling_user_line()
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in leaf_names:
                        events.grad_reads.setdefault(leaf_names[id(p)], (line, f"GradScaler.{method}"))
        return None

    with contextlib.ExitStack() as stack:
        for i, scaler in enumerate(bindings.scalers):
            for key in ("scale", "growth_tracker"):
                _set_for_trace(stack, scaler, GRAD_SCALER_STATE_ATTRIBUTES[key], traced[(i, key)])
            # the step's scale/step/update cycle runs on a copy of its per-optimizer bookkeeping
            _set_for_trace(stack, scaler, GRAD_SCALER_STATE_ATTRIBUTES["per_optimizer_states"],
                           copy.deepcopy(grad_scaler_state(scaler, "per_optimizer_states")))
            if accumulating:
                for method in ("unscale_", "step", "update"):
                    _set_for_trace(stack, scaler, method, functools.partial(skipped, method=method))
        yield


def _autograd_nodes(roots: list[Any]) -> Iterator[Any]:
    seen: set[int] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)


@contextlib.contextmanager
def _backward_provenance(outputs: Any, mode: _StepMode | None = None, where: str | None = None) -> Iterator[None]:
    """While backward runs, stamp each op it traces with the sequence number of the autograd
    node being differentiated, so capture can point backward nodes at their forward node.
    `mode` is made active again inside every autograd node backward runs: the engine runs them
    under the modes active when backward was called, and a mode is inactive inside its own
    handler, where backward is called. (A checkpointed block's recompute needs it.)"""
    roots = [t.grad_fn for t in pytree.tree_leaves(outputs) if isinstance(t, Tensor)]
    handles = []
    numbered = grad_fn_sequence_numbers_supported()
    line = user_line_of_stack_trace(where) if mode is not None else None
    # one pre-hook and one hook per autograd node (a deep model has thousands, each hook a Python
    # call in backward): the mode goes on before the node's number is set, off before it is reset
    for node in _autograd_nodes(roots) if mode is not None or numbered else ():
        if mode is not None:
            refuse_reentrant(node, line)
        seq = grad_fn_sequence_number(node) if numbered else None

        def before(_grads: Any, seq: int | None = seq) -> None:
            if mode is not None:
                mode.__enter__()
            if seq is not None:
                set_grad_fn_sequence_number(seq)

        def after(_grad_inputs: Any, _grad_outputs: Any, seq: int | None = seq) -> None:
            if mode is not None:
                mode.__exit__(None, None, None)
            if seq is not None:
                reset_grad_fn_sequence_number()
        handles.append(node.register_prehook(before))
        handles.append(node.register_hook(after))
    try:
        with fx_traceback.annotate({"phase": "backward"}):
            yield
    finally:
        for h in handles:
            h.remove()


_GRAD_GETTER = Tensor.grad.__get__   # what a TorchFunctionMode sees when code reads `tensor.grad`

# Tensor metadata reads: they trace no op, so the mode passes them straight through, without
# looking up the user's line or the checkpoint region (most of the calls the mode sees are
# these: shapes, devices, `.grad` and strides read by torch's own Python code and the lowering)
_METADATA_READS = frozenset(
    [getattr(Tensor, name).__get__ for name in ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn",
                                                "grad", "ndim", "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse",
                                                "is_quantized", "is_nested", "itemsize", "nbytes", "_base")]
    + [Tensor.size, Tensor.stride, Tensor.numel, Tensor.dim, Tensor.storage_offset, Tensor.element_size,
       Tensor.is_floating_point, Tensor.is_complex, Tensor.get_device, torch.sym_max, torch.sym_min, torch.device,
       # a tensor's device as torch's Python fake-tensor code reads it inside backward's autograd
       # nodes (about a third of the calls the mode sees there): it returns a device, traces no op
       torch.ops.prim.device.default])


_TORCH_INIT = os.path.join(os.path.dirname(torch.__file__), "__init__.py")


@dataclass(frozen=True)
class _StackFacts:
    """What capture's mode reads off the Python stack for a traced call, found in one walk.

    `kept`: a frame make_fx keeps in a node's recorded stack trace is on the stack (a function
    named `forward`, or torch/__init__.py: its filter); backward runs without one, so its nodes
    get no recorded trace (capture gives them their forward node's) and recording them, half
    the trace's nodes, only cost time. `frames`: the frames that filter looks at (filename, line,
    function name; innermost first), from which the mode works out the call's recorded stack
    trace once (torch_private.recorded_stack_trace) instead of the tracer per node.
    `source`: the user's line (calling_user_line's format).
    `checkpoint`: the innermost frame of torch.utils.checkpoint (the region, recompute.py).

    While backward runs, every op torch's Python code traces inside an autograd node (detach,
    view, t, mm: thousands per step) sits on top of the same stack below the `backward()` call,
    so the facts of that part are found once per backward (`below`) and a walk stops there.
    (No frame is kept in the facts: a frame holding facts that hold it would keep its locals,
    gradients among them, alive past the call, and autograd copies a gradient it cannot steal.)"""

    kept: bool
    frames: tuple[tuple[str, int, str], ...]
    source: str | None
    checkpoint: FrameType | None

    @classmethod
    def of(cls, frame: FrameType | None, below: tuple[FrameType, _StackFacts] | None) -> _StackFacts:
        """The facts from `frame` down; `below`: a frame further down and the facts from it down,
        where the walk stops if it gets there."""
        kept, user, checkpoint = False, None, None
        frames: list[tuple[str, int, str]] = []
        stop, base = below if below is not None else (None, None)
        while frame is not None:
            if frame is stop:
                return cls(kept or base.kept, (*frames, *base.frames),
                           frame_line(user) if user is not None else base.source,
                           checkpoint if checkpoint is not None else base.checkpoint)
            code = frame.f_code
            name, filename = code.co_name, code.co_filename
            if name == "forward" or filename.endswith(STACK_TRACE_FILE_SUFFIX):   # the tracer's filter
                frames.append((filename, frame.f_lineno, name))
                if not kept and (name == "forward" or filename == _TORCH_INIT):
                    kept = True
            if user is None and not filename.startswith(OWN_DIRS):
                user = frame
            if checkpoint is None and is_checkpoint_code(code):
                checkpoint = frame
            frame = frame.f_back
        return cls(kept, tuple(frames), frame_line(user), checkpoint)


class _StepMode(TorchFunctionMode):
    """Routes SDPA to graphoffload's attention op (and fp32/fp16 grouped matmuls to its grouped_mm,
    graphoffload/ops/grouped_mm.py) and tags backward; everything else passes."""

    def __init__(self, events: _StepEvents, regions: CheckpointRegions,
                 sums: _AccumulatingGrads | None = None, leaf_names: dict[int, str] | None = None):
        super().__init__()
        self.events = events
        self.regions = regions
        self.sums = sums
        self.leaf_names = leaf_names or {}   # id(traced parameter) -> its name
        self.traces_paused = False   # backward without a frame a stack trace keeps (see _backward)
        self.stack_traces: dict[tuple[tuple[str, int, str], ...], str | None] = {}   # _given_stack_trace's
        # the running backward() call's mode handler frame and the stack's facts from it down
        self.below: tuple[FrameType, _StackFacts] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            reads_metadata = func in _METADATA_READS
        except TypeError:   # an unhashable callable
            reads_metadata = False
        if reads_metadata:
            if func == _GRAD_GETTER:
                self._grad_read(args[0])
            return func(*args, **kwargs)
        stack = _StackFacts.of(sys._getframe(), self.below)
        if self.traces_paused and stack.kept:   # a checkpoint's recompute, say
            with self._stack_traces(True):
                return self._traced(func, args, kwargs, stack)
        return self._traced(func, args, kwargs, stack)

    def _traced(self, func, args, kwargs, stack: _StackFacts):
        # make_fx records stack traces only inside modules' forward(); this covers the rest of
        # the step (loss, clipping, optimizer.step()) with the user's calling line
        source = stack.source
        with fx_traceback.annotate({"source": source, **self.regions.tag(stack.checkpoint)}):
            if func is Tensor.backward or func is torch.autograd.backward:
                self._backward_called(source)
                self.events.losses += nonfinite.backward_roots(args, kwargs, "tensors")
                if self.sums is not None:
                    with self._backward(sys._getframe(1), stack):
                        return self.sums.backward(func, args, kwargs, self, source)
                with _backward_provenance(args[0] if args else kwargs.get("tensors"), self, source), \
                        self._backward(sys._getframe(1), stack):
                    return func(*args, **kwargs)
            if func is torch.autograd.grad:
                if self.sums is not None:
                    raise UnsupportedError(
                        f"the train step calls torch.autograd.grad{f' at {source.splitlines()[0]}' if source else ''}, "
                        "which does not accumulate into .grad: with accumulation_steps, call loss.backward()")
                self._backward_called(source)
                self.events.losses += nonfinite.backward_roots(args, kwargs, "outputs")
                with _backward_provenance(args[0] if args else kwargs.get("outputs"), self, source), \
                        self._backward(sys._getframe(1), stack):
                    return func(*args, **kwargs)
            with self._given_stack_trace(stack):
                if func is F.scaled_dot_product_attention:
                    return sdpa_via_attention(*args, **kwargs)
                if func is getattr(torch, "_grouped_mm", None) and _grouped_mm.routes(*args, **kwargs):
                    return _grouped_mm.grouped_mm(*args[:3], **{k: v for k, v in kwargs.items() if k == "offs"})
                return func(*args, **kwargs)

    def _given_stack_trace(self, stack: _StackFacts) -> contextlib.AbstractContextManager:
        """The nodes of a traced call get the stack trace make_fx's tracer would record for each,
        worked out once per distinct stack (the call's frames are on the stack for every node it
        creates; frames inside the call, torch's own, are not ones the tracer's filter keeps)."""
        if self.traces_paused:   # nothing is recorded here
            return contextlib.nullcontext()
        try:
            text = self.stack_traces[stack.frames]
        except KeyError:
            text = self.stack_traces[stack.frames] = recorded_stack_trace(stack.frames)
        return given_stack_trace(text)

    def _grad_read(self, tensor: Any) -> None:
        """The step's own code reads a parameter's `.grad` after a backward (clip_grad_norm_,
        a gradient's norm for logging): recorded (StepEvents.grad_reads), with the user's line
        looked up only then (the mode sees many `.grad` reads of torch's own code)."""
        name = self.leaf_names.get(id(tensor))
        if name is not None and "backward" in self.events.order and not self.events.own_code \
                and name not in self.events.grad_reads:
            self.events.grad_reads[name] = (calling_user_line(), "reads .grad")

    def _backward_called(self, source: str | None) -> None:
        """Several backward calls accumulate into `.grad` (micro-batches); one after an
        optimizer step would start a second update in the same graph, which is refused."""
        if "step" in self.events.order:
            where = f" at {source.splitlines()[0]}" if source else ""
            raise UnsupportedError(
                f"the train step calls backward after optimizer.step(){where}: a compiled step performs "
                "one update. For gradient accumulation, call backward once per micro-batch and step() "
                "once after the last (or use offload_compile(..., accumulation_steps=k)); for several "
                "updates, call the compiled step once per update")
        self.events.order.append("backward")

    @contextlib.contextmanager
    def _backward(self, handler: FrameType, stack: _StackFacts) -> Iterator[None]:
        """While a backward() call runs: `handler` the mode's frame that called it, `stack` the
        facts from there down."""
        self.regions.in_backward = True
        below = self.below
        self.below = (handler, stack)
        try:
            # make_fx would record a stack trace per node and keep none of it; a torch function
            # called under a kept frame (a checkpointed block's recompute) records again
            with self._stack_traces(stack.kept):
                yield
        finally:
            self.below = below
            self.regions.in_backward = False
            self.regions.release()

    @contextlib.contextmanager
    def _stack_traces(self, recorded: bool) -> Iterator[None]:
        paused = self.traces_paused
        with stack_trace_recording(recorded) as switched:
            self.traces_paused = switched and not recorded
            try:
                yield
            finally:
                self.traces_paused = paused


@dataclass(frozen=True)
class Accumulation:
    """What a trace of a step compiled with `accumulation_steps=k` does with its gradients:
    add them, scaled by 1/k, into the persistent running sums (`sums(name, param)` gives the
    step's buffer of a parameter), and, in the update variant (`update=True`), update from the
    sums and leave them zeroed for the next window."""

    steps: int
    update: bool
    sums: Callable[..., Tensor]   # (name, param, on_host=False, shape=None) -> the buffer
    discard: Callable[[set[str]], None] = lambda names: None   # frees sums no graph reads


class _AccumulatingGrads:
    """Binds the running sums (placeholders) to the traced parameters around each backward.

    Accumulate variant: before backward each parameter's `.grad` is its sum, so autograd adds
    the micro-batch's gradient into it in place, inside backward, as eager accumulation does;
    after backward `.grad` is None again, so the rest of the step (clipping, `step()`,
    `zero_grad()`) sees no gradient and does nothing, as on a call that does not update.
    Update variant: a one-shot hook adds the sum to the gradient as autograd produces it
    (`g + sum` equals eager's `sum += g` bit for bit), so the gradient is final inside backward
    and fusion can run its update there; the sum itself is only read, never handed to an
    asynchronous copy, and is zeroed at the end of the step.
    """

    def __init__(self, accumulation: Accumulation, params: dict[str, Tensor], sums: dict[str, Tensor]):
        self.k = accumulation.steps
        self.update = accumulation.update
        self.params = params
        self.sums = sums
        self.hooked: set[str] = set()
        self.read: set[str] = set()      # sums a backward touched

    def _scaled(self, t: Tensor, gradient: Tensor | None) -> Tensor:
        # eager's `(loss / k).backward()` hands `ones / k` to the loss's grad_fn: the same op
        return (torch.ones_like(t) if gradient is None else gradient) / self.k

    def backward(self, func: Callable, args: tuple, kwargs: dict, mode: _StepMode, source: str | None) -> Any:
        kwargs = dict(kwargs)
        if func is Tensor.backward:
            args = list(args)
            if len(args) > 1:
                args[1] = self._scaled(args[0], args[1])
            else:
                kwargs["gradient"] = self._scaled(args[0], kwargs.get("gradient"))
            roots = args[0]
        else:   # torch.autograd.backward(tensors, grad_tensors=None, ...)
            args = list(args)
            tensors = args[0] if args else kwargs["tensors"]
            tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
            grads = args[1] if len(args) > 1 else kwargs.get("grad_tensors")
            grads = [None] * len(tensors) if grads is None else [grads] if isinstance(grads, Tensor) else list(grads)
            scaled = [self._scaled(t, g) for t, g in zip(tensors, grads)]
            if len(args) > 1:
                args[1] = scaled
            else:
                kwargs["grad_tensors"] = scaled
            roots = tensors
        handles = self._bind()
        try:
            with _backward_provenance(roots, mode, source):
                return func(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            self._unbind()

    def _bind(self) -> list[Any]:
        handles = []
        for name, sum_ in self.sums.items():
            leaf = self.params[name]
            if not self.update:
                if leaf.grad is None:
                    leaf.grad = sum_
            elif name not in self.hooked and leaf.grad is None:
                def add_sum(g: Tensor, name: str = name, sum_: Tensor = sum_) -> Tensor:
                    self.hooked.add(name)
                    self.read.add(name)
                    return g + sum_
                handles.append(leaf.register_hook(add_sum))
        return handles

    def _unbind(self) -> None:
        if self.update:
            return
        for name, sum_ in self.sums.items():
            leaf = self.params[name]
            if leaf.grad is not None:
                if leaf.grad is not sum_:     # autograd accumulated out of place
                    sum_.copy_(leaf.grad)
                self.read.add(name)
                leaf.grad = None

    def finish(self) -> None:
        """After the step: an update leaves the sums zeroed for the next window (a gradient the
        step leaves on `.grad` is a copy, not the buffer)."""
        if not self.update:
            return
        with torch.no_grad():
            # in the sums' (parameter) order, not the set's: the order of these `zero_` nodes in
            # the graph must not follow the string hash seed (plans are cached by the graph's text)
            for name in (n for n in self.sums if n in self.read):
                leaf = self.params[name]
                if leaf.grad is self.sums[name]:
                    leaf.grad = leaf.grad.clone()
                self.sums[name].zero_()


# --------------------------------------------------------------------------- errors

def _translate_trace_error(exc: Exception) -> GraphOffloadError:
    name = type(exc).__name__
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)) or \
            "GuardOnDataDependent" in name or "data-dependent" in str(exc).lower():
        tb = traceback.extract_tb(exc.__traceback__)
        library = user_frame(tb)
        if library is not None and is_installed_package(library.filename) and "expert" in (library.line or "") + library.name:
            # transformers' experts_implementation="eager" loops over the experts its router picked
            own = next((f for f in reversed(tb) if not f.filename.startswith(OWN_DIRS)
                        and not f.filename.startswith("<") and not is_installed_package(f.filename)), None)
            at = f" at {own.filename}:{own.lineno} ({own.name}): {(own.line or '').strip()}" if own else ""
            return CaptureError(
                f"the train step routes tokens to experts by their values{at}: the mixture-of-experts layer "
                f"loops over the experts its router picked ({os.path.basename(library.filename)}:{library.lineno}: "
                f"{(library.line or '').strip()}), which cannot be captured in one graph. Build the model with "
                "a grouped experts implementation: experts_implementation=\"grouped_mm\" (transformers' "
                "default) or \"batched_mm\", in its config or in from_pretrained(). "
                f"({describe(exc)})")
        return CaptureError(
            f"the train step depends on tensor values{where_in_user_code(exc)}. `.item()`, `bool(tensor)`, "
            "`if tensor > ...` and ops whose output shape depends on values cannot be captured in "
            "one graph: move them outside the compiled step or express them with tensor ops "
            f"(torch.where, masking). ({describe(exc)})")
    # an op with no meta kernel raises NotImplementedError; a custom_op with no register_fake, RuntimeError
    if (isinstance(exc, NotImplementedError) and ("fake impl" in str(exc) or "Meta" in str(exc))) or \
            (isinstance(exc, RuntimeError) and "no fake impl" in str(exc)):
        match = re.search(r"\w+::[\w.]+", str(exc))
        op = match.group(0) if match else str(exc).split(":")[0]
        return UnsupportedError(
            f"op {op} cannot be captured{where_in_user_code(exc)}: it has no fake (meta) kernel, so graphoffload "
            "cannot trace it without running it. Replace it, or register a fake kernel with "
            "torch.library.register_fake.")
    return CaptureError(f"capturing the train step failed{where_in_user_code(exc)}: {name}: {exc}")


# --------------------------------------------------------------------------- capture


@dataclass
class Capture:
    """A captured step: its graph, and how to bind and unbind it to the user's objects.

    The graph's module code is not generated here: the pass manager generates it once, after
    the last pass (call `graph.gm.recompile()` to run a captured graph directly)."""

    graph: TrainGraph
    bindings: StepBindings
    out_spec: Any                      # pytree spec of the step's return value
    out_constants: list[Any]           # its non-tensor leaves (TENSOR_SLOT where a tensor goes)
    zeroed_before_backward: frozenset[str]   # parameters whose .grad a zero_grad() clears before backward
    zeroed: frozenset[str]                   # ... or at any point of the step
    stepped_optimizers: list[int]      # optimizers whose step() the graph performs
    batch_positions: list[int]         # positions of tensor leaves among the (args, kwargs) leaves
    created_state: list[tuple[torch.optim.Optimizer, list[Tensor]]] = field(default_factory=list)
    accumulation: Accumulation | None = None   # accumulation_steps: where the running sums live

    def discard_created_state(self) -> None:
        """Drop the optimizer state this capture created (when compiling fails after it):
        left behind, it would make the next step skip SGD's first-step momentum initialisation."""
        _discard_state(self.created_state)

    def create_deferred_state(self, graph: TrainGraph, zero: ZeRO, offloaded: bool = False) -> None:
        """Create the optimizer state the final `graph` reads, which capture deferred (ZeRO:
        `config.data_parallel`), as DTensors holding this rank's dim-0 chunk of each parameter
        (`data_parallel.shard_state`), so a rank never allocates state for the others' chunks;
        full state it holds already (from a full state_dict loaded before) is narrowed to its
        chunk. `offloaded` (offload=): new state is made in host memory, as capture makes
        offloaded state. Recorded as created, like capture's own."""
        bindings = self.bindings
        where = optimizer_lowering.StatePlacement(torch.device("cpu"), False) \
            if offloaded and bindings.device.type != "meta" else None
        read = {s.target[0] for s in graph.signature.inputs if s.kind == "state"}
        world, rank = zero.world_size, zero.rank
        mesh = zero.device_mesh(bindings.device.type) if read else None
        for i in self.stepped_optimizers:
            opt = bindings.optimizers[i]
            params = [p for g in opt.param_groups for p in g["params"]]
            mine = [p for p in params if bindings.param_names[id(p)] in read]
            fresh = [p for p in mine if not opt.state.get(p)]
            optimizer_lowering.prepare_state(opt, where, only=mine, like=lambda p: local_chunk(p.detach(), world, rank))
            for p in mine:
                shard_state(opt.state[p], p, bindings.param_names[id(p)], mesh, world, rank)
            self.created_state.append((opt, fresh))

    def shard_parameters(self, graph: TrainGraph, zero: ZeRO) -> dict[str, nn.Parameter]:
        """ZeRO stage 3: replace every parameter the final `graph` holds as this rank's rows (the
        `zero` pass's `params` note) by an `nn.Parameter` holding a `Shard(0)` DTensor of them
        (`data_parallel.shard_parameter`), in the model (tied parameters stay tied), in the
        optimizers' param groups and as the key of their state, and in these bindings, so the
        step binds the DTensors' local rows from now on and the whole parameters can be freed.
        Returns the new parameters by name (those sharded before are kept, and returned too)."""
        notes = graph.notes_of("zero", "params")
        if not notes:
            return {}
        from torch.distributed.tensor import DTensor

        bindings = self.bindings
        mesh = zero.device_mesh(bindings.device.type)
        new: dict[str, nn.Parameter] = {}
        for name in notes[0].fields["sharded"]:
            old = bindings.params[name]
            if isinstance(old, DTensor):
                new[name] = old
                continue
            param = new[name] = shard_parameter(old, mesh, zero.world_size, zero.rank)
            for model in bindings.modules:
                for mod in model.modules():
                    for attr, p in list(mod._parameters.items()):
                        if p is old:
                            setattr(mod, attr, param)
            for opt in bindings.optimizers:
                for group in opt.param_groups:
                    group["params"] = [param if p is old else p for p in group["params"]]
                if old in opt.state:
                    opt.state[param] = opt.state.pop(old)
            bindings.params[name] = param
            del bindings.param_names[id(old)]
            bindings.param_names[id(param)] = name
            self.created_state = [(opt, [param if p is old else p for p in ps]) for opt, ps in self.created_state]
        return new


def _discard_state(created: list[tuple[torch.optim.Optimizer, list[Tensor]]]) -> None:
    for opt, params in created:
        for p in params:
            opt.state.pop(p, None)


def capture_step(fn: Callable, args: tuple, kwargs: dict, config: CompileConfig,
                 accumulation: Accumulation | None = None) -> Capture:
    """Trace `fn` into a Capture. If tracing fails, the optimizer state it created is dropped
    again: left behind, it would make the next step (compiled or eager) skip SGD's first-step
    momentum initialisation."""
    bindings = find_bindings(fn, args, kwargs)
    fresh = [(opt, [p for g in opt.param_groups for p in g["params"] if not opt.state.get(p)])
             for opt in bindings.optimizers]
    register_fused_optimizer_meta_kernels()   # tracing the update on fake tensors needs them
    try:
        capture = _capture_step(fn, args, kwargs, config, bindings, accumulation)
    except BaseException:
        _discard_state(fresh)
        raise
    capture.created_state = _drop_unread_state(capture, fresh, config.data_parallel is not None)
    if accumulation is not None:
        _drop_unused_grad_sums(capture, accumulation, config.offload is not None
                               and config.offload.accumulate_on == "host")
    return capture


def _drop_unused_grad_sums(capture: Capture, accumulation: Accumulation, on_host: bool) -> None:
    """A parameter that gets no gradient needs no running sum: drop its placeholder and buffer."""
    capture.accumulation = accumulation
    graph = capture.graph
    placeholders = graph.placeholders()
    unused = {s.name for s in graph.signature.inputs if s.kind == "grad_sum" and not placeholders[s.name].users}
    if unused:
        accumulation.discard({s.target for s in graph.signature.inputs if s.name in unused})
        capture.graph = graph.without_inputs(unused)
    sums = [placeholders[s.name].meta["val"] for s in capture.graph.signature.inputs if s.kind == "grad_sum"]
    nbytes = sum(v.numel() * (4 if on_host else v.element_size()) for v in sums)   # host sums are fp32
    # what the window's update will update: every parameter of an optimizer the step steps that
    # gets a gradient (has a running sum). An accumulating variant has no update in its graph, so
    # this is how a pass that must treat both variants' parameters alike (ZeRO stage 3 shards
    # them) knows them there
    bindings = capture.bindings
    stepped = {bindings.param_names[id(p)] for i in capture.stepped_optimizers
               for group in bindings.optimizers[i].param_groups for p in group["params"]}
    updated = tuple(s.target for s in capture.graph.signature.inputs if s.kind == "grad_sum" and s.target in stepped)
    capture.graph.note("capture", f"accumulation_steps={accumulation.steps}: this variant "
                       f"{'adds the last micro-batch of a window and updates' if accumulation.update else 'adds a micro-batch'}; "
                       f"{len(sums)} running gradient sums, {nbytes:,} bytes "
                       + ("in host memory (fp32), kept between calls" if on_host else "on the device, kept between calls"),
                       "accumulation", steps=accumulation.steps, update=accumulation.update, sums=len(sums),
                       sum_bytes=nbytes, updated=updated)


def _drop_unread_state(capture: Capture, fresh: list[tuple[torch.optim.Optimizer, list[Tensor]]],
                       deferred: bool = False) -> list[tuple[torch.optim.Optimizer, list[Tensor]]]:
    """Optimizer state is created before tracing, for every parameter that may get a gradient.
    torch.optim creates it only for parameters that had one when `step()` ran: drop what this
    step never reads again (an unused layer's state would otherwise show in `state_dict()` and
    be offloaded for nothing). Returns `fresh` less what was dropped.

    `deferred` (ZeRO): the state was traced whole, and only the `zero` pass gives what an update
    reads this rank's chunk's shape; a placeholder nothing reads (every state placeholder of an
    accumulating call, which does not update) is dropped from the graph too, whether or not the
    state exists, so the step never binds a rank's DTensor chunk to a whole-parameter input."""
    bindings, graph = capture.bindings, capture.graph
    placeholders = graph.placeholders()
    read = {s.target[0] for s in graph.signature.inputs
            if s.kind == "state" and placeholders[s.name].users}
    kept: list[tuple[torch.optim.Optimizer, list[Tensor]]] = []
    dropped: set[str] = set()
    for opt, params in fresh:
        unread = [p for p in params if p in opt.state and bindings.param_names[id(p)] not in read]
        _discard_state([(opt, unread)])
        dropped.update(bindings.param_names[id(p)] for p in unread)
        kept.append((opt, [p for p in params if bindings.param_names[id(p)] not in dropped]))
    if deferred:
        dropped.update(s.target[0] for s in graph.signature.inputs if s.kind == "state" and s.target[0] not in read)
    if dropped:
        capture.graph = graph.without_inputs({s.name for s in graph.signature.inputs
                                              if s.kind == "state" and s.target[0] in dropped})
    return kept


def _capture_step(fn: Callable, args: tuple, kwargs: dict, config: CompileConfig, bindings: StepBindings,
                  accumulation: Accumulation | None = None) -> Capture:
    # offloaded state is made on the host and traced as if it were on the device (as
    # torch.optim keeps it): the offload pass then moves those inputs to the host
    offloaded = config.offload is not None and bindings.device.type != "meta"   # a meta model plans, never runs
    # (not pinned here: the host state moves it into its pinned arena, one allocation for all)
    where = optimizer_lowering.StatePlacement(torch.device("cpu"), False) if offloaded else None
    # with ZeRO, state is made after the passes, for this rank's own parameters only
    # (`Capture.create_deferred_state`): traced as fake tensors shaped as torch.optim keeps it
    deferred = config.data_parallel is not None
    first_steps = [{bindings.param_names[id(p)] for p in (optimizer_lowering.first_step_params(opt) if deferred
                                                   else optimizer_lowering.prepare_state(opt, where))}
                   for opt in bindings.optimizers]
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    batch_positions = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
    param_names = list(bindings.params)
    buffer_names = list(bindings.buffers)
    lr_before = [bindings.lr(oi, gi) for oi, gi in bindings.lr_groups]
    device = bindings.device
    for scaler in bindings.scalers:
        # the scale is created lazily by the first scale(): create it now, outside the trace
        if grad_scaler_state(scaler, "scale") is None:
            scaler.scale(torch.zeros((), device=device))
    scaler_keys = [(i, key) for i in range(len(bindings.scalers)) for key in ("scale", "growth_tracker")]

    fake_mode = _fake_mode() if offloaded or deferred else None
    real_inputs: list[Tensor] = (
        [_traced_param(p, fake_mode) for p in bindings.params.values()]
        + [bindings.buffer(n) for n in buffer_names]
        + [_traced_state(bindings, pn, k, fake_mode) for pn, k in bindings.state_keys]
        + [torch.tensor(lr, dtype=torch.float64) for lr in lr_before]
        + [bindings.scaler_state(i, key) for i, key in scaler_keys]
        + [leaves[i].detach() for i in batch_positions])
    sum_names = [n for n, p in bindings.params.items() if p.requires_grad] if accumulation is not None else []
    real_inputs += [_traced_sum(accumulation, n, bindings.params[n], fake_mode) for n in sum_names]
    n_p, n_b, n_s, n_lr = len(param_names), len(buffer_names), len(bindings.state_keys), len(bindings.lr_groups)
    n_sc = len(scaler_keys)
    events = _StepEvents()
    regions = CheckpointRegions.of_modules(bindings.modules)
    result: dict[str, Any] = {}

    def traced(*flat: Tensor) -> list[Tensor]:
        params = dict(zip(param_names, flat[:n_p]))
        buffers = dict(zip(buffer_names, flat[n_p:n_p + n_b]))
        states = dict(zip(bindings.state_keys, flat[n_p + n_b:n_p + n_b + n_s]))
        lrs = dict(zip(bindings.lr_groups, flat[n_p + n_b + n_s:n_p + n_b + n_s + n_lr]))
        scaler_state = dict(zip(scaler_keys, flat[n_p + n_b + n_s + n_lr:n_p + n_b + n_s + n_lr + n_sc]))
        step_leaves = list(leaves)
        for pos, t in zip(batch_positions, flat[n_p + n_b + n_s + n_lr + n_sc:]):
            step_leaves[pos] = t
        sums = _AccumulatingGrads(accumulation, params, dict(zip(sum_names, flat[len(flat) - len(sum_names):]))) \
            if accumulation is not None else None
        step_args, step_kwargs = pytree.tree_unflatten(step_leaves, in_spec)
        leaf_names = {id(t): n for n, t in params.items()}
        # module parameters are named before _swapped_module_tensors puts the traced ones in
        with _recorded_module_zero_grad(bindings, events), _swapped_module_tensors(bindings, params, buffers), \
                _lowered_optimizers(bindings, params, states, lrs, first_steps, config, events), \
                _swapped_scaler_state(bindings, scaler_state, accumulation is not None and not accumulation.update,
                                      events, leaf_names), \
                _StepMode(events, regions, sums, leaf_names):
            out = fn(*step_args, **step_kwargs)
            if sums is not None:
                with _own_code(events):
                    sums.finish()
            rebound = {n: bindings.buffer(n) for n in buffer_names}
        out_leaves, out_spec = pytree.tree_flatten(out)
        result["out_spec"] = out_spec
        result["constants"] = [TENSOR_SLOT if isinstance(x, Tensor) else x for x in out_leaves]
        outputs = [x.detach() for x in out_leaves if isinstance(x, Tensor)]
        specs = [OutputSpec("user", i) for i in range(len(outputs))]
        for name in param_names:
            if params[name].grad is not None:
                outputs.append(params[name].grad)
                specs.append(OutputSpec("grad", name))
        for name in buffer_names:
            if rebound[name] is not buffers[name]:
                outputs.append(rebound[name].detach())
                specs.append(OutputSpec("buffer", name))
        if events.skip_flag is not None:
            outputs.append(events.skip_flag)
            specs.append(OutputSpec("skipped", None))
        result["specs"] = specs
        return outputs

    try:
        with fx_traceback.preserve_node_meta(), torch.autograd.set_multithreading_enabled(False):
            gm = make_fx(traced, tracing_mode="fake", record_stack_traces=True)(*real_inputs)
    except GraphOffloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - every tracing failure becomes a graphoffload error
        raise _translate_trace_error(exc) from exc
    finally:
        _restore_lrs(bindings, lr_before)

    if "backward" not in events.order:
        raise CaptureError("the train step never calls loss.backward(): graphoffload compiles "
                           "training steps (forward, backward, optimizer.step())")

    input_specs = (
        [InputSpec("param", placeholder_name("p", n), n) for n in param_names]
        + [InputSpec("buffer", placeholder_name("b", n), n) for n in buffer_names]
        + [InputSpec("state", placeholder_name(f"s_{k}", pn), (pn, k)) for pn, k in bindings.state_keys]
        + [InputSpec("lr", f"lr_{oi}_{gi}", (oi, gi)) for oi, gi in bindings.lr_groups]
        + [InputSpec("scaler", f"scaler_{i}_{key}", (i, key)) for i, key in scaler_keys]
        + [InputSpec("batch", f"batch_{j}", j) for j in range(len(batch_positions))]
        + [InputSpec("grad_sum", placeholder_name("g", n), n) for n in sum_names])
    graph = _rename_placeholders(gm, [s.name for s in input_specs])
    # the signature records the names fx gave the placeholders (see placeholder_name)
    input_specs = [dataclasses.replace(s, name=n.name)
                   for s, n in zip(input_specs, (n for n in graph.graph.nodes if n.op == "placeholder"))]
    _annotate(graph, input_specs)
    recomputed = mark_recomputed(graph, regions.names)
    _reject_scalar_reads(graph)
    mutated = written_placeholders(graph.graph)
    input_specs = [InputSpec(s.kind, s.name, s.target, s.name in mutated) for s in input_specs]
    signature = GraphSignature(tuple(input_specs), tuple(result["specs"]))
    train_graph = TrainGraph(graph, signature)
    train_graph.note("capture", f"{len(param_names)} parameters, {len(buffer_names)} buffers, "
                     f"{len(bindings.state_keys)} optimizer-state tensors, {events.subgroups} update subgroups; "
                     f"step calls: {' -> '.join(events.order)}")
    if events.grad_reads:
        line, reader = next(iter(events.grad_reads.values()))
        train_graph.note("capture", f"the step's code reads the gradients of {len(events.grad_reads)} parameters "
                         f"after backward ({reader}{', ' + line.splitlines()[0] if line else ''})", "grad_reads",
                         params=tuple(events.grad_reads), source=line, reader=reader)
    for region in recomputed:
        train_graph.note("capture", f"recomputed in backward (activation checkpointing): {region.name}, "
                         f"{len(region.recomputed)} nodes" + (f", {region.random} random ops replayed" if region.random else ""))
    first_backward = events.order.index("backward")
    return Capture(train_graph, bindings, result["out_spec"], result["constants"],
                   zeroed_before_backward=_zeroed(events, events.order[:first_backward]),
                   zeroed=_zeroed(events, events.order),
                   stepped_optimizers=sorted(events.stepped), batch_positions=batch_positions)


def _fake_mode() -> FakeTensorMode:
    """A fake mode as make_fx would make for tracing_mode="fake": it finds this one among the
    inputs and converts the other inputs into it."""
    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        return FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)


def _traced_param(param: nn.Parameter, fake_mode: FakeTensorMode | None) -> Tensor:
    """A parameter as the trace sees it: the parameter itself (detached), or, for a DTensor a
    ZeRO stage 3 step sharded, a fake tensor of the whole parameter's shape (the `zero` pass
    makes its placeholder this rank's rows again)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and fake_mode is not None:
        with fake_mode:
            return torch.empty(param.shape, dtype=param.dtype, device=param.device).requires_grad_(param.requires_grad)
    return param.detach().requires_grad_(param.requires_grad)


def _traced_state(bindings: StepBindings, param_name: str, key: str, fake_mode: FakeTensorMode | None) -> Tensor:
    if fake_mode is None:
        return bindings.state(param_name, key)
    with fake_mode:
        return optimizer_lowering.state_like(bindings.params[param_name], key)


def _traced_sum(accumulation: Accumulation, name: str, param: Tensor, fake_mode: FakeTensorMode | None) -> Tensor:
    # with offload a running sum may live on the host (Offload.accumulate_on): it is traced as
    # if it were on the device, like offloaded state, and the offload pass moves it
    if fake_mode is None:
        return accumulation.sums(name, param)
    with fake_mode:
        return torch.zeros(param.shape, dtype=param.dtype, device=param.device)


def _zeroed(events: _StepEvents, order: list[str]) -> frozenset[str]:
    calls = order.count("zero_grad")
    return frozenset().union(*events.zeroed[:calls])


def _restore_lrs(bindings: StepBindings, lr_before: list[float]) -> None:
    """Put back every learning rate the step changed at trace time (all of them, before raising)."""
    changed = False
    for (oi, gi), lr in zip(bindings.lr_groups, lr_before):
        if bindings.lr(oi, gi) != lr:
            changed = True
            group = bindings.optimizers[oi].param_groups[gi]
            if isinstance(group["lr"], Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
    if changed:
        raise CaptureError(
            "the learning rate changed while the step was traced: call scheduler.step() "
            "outside the compiled step (it would run only once, at trace time)")


def _reject_scalar_reads(gm: fx.GraphModule) -> None:
    """make_fx turns `.item()` into an unbacked symbolic scalar instead of failing, so the
    Python code that used it ran once on a placeholder value: refuse the graph."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._local_scalar_dense.default:
            where = user_line_of_stack_trace(node.meta.get("stack_trace"))
            raise CaptureError(
                f"the train step reads a tensor's value into Python{f' at {where}' if where else ''}. "
                "`.item()`, `float(tensor)`, `.tolist()` and `if tensor > ...` cannot be captured in one "
                "graph: move them outside the compiled step (e.g. call `.item()` on the returned loss) "
                "or express them with tensor ops (torch.where, masking).")


def _rename_placeholders(gm: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """Give make_fx's placeholders (`arg0_1`, ...) the signature's names, in place: a copy of
    the graph and a second code generation would cost a deep model's compile a few tenths of a
    second. The module's Python code is left as traced; the pass manager generates it once,
    after the last pass."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        node.target = name   # the argument's name in the generated code, as graph.placeholder(name) sets it
        rename_node(node, name)
    return gm


def _annotate(gm: fx.GraphModule, input_specs: list[InputSpec]) -> None:
    """Turn what tracing recorded into the node meta passes/README.md fixes."""
    spec_of = {s.name: s for s in input_specs}
    fake_mode = fake_mode_of(gm.graph)
    forward_by_seq: dict[int, fx.Node] = {}
    after_backward = False
    for node in gm.graph.nodes:
        custom = node.meta.pop("custom", None) or {}
        node.meta["pass"] = "capture"
        if node.op == "placeholder":
            node.meta["phase"] = "input"
            spec = spec_of.get(node.name)
            if spec is None:
                raise CaptureError(f"internal error: placeholder {node.name} (of "
                                   f"{node.meta.get('param', ('?',))[0]}) is missing from the graph "
                                   "signature; please report this with the model that triggers it")
            if spec.kind == "param":
                node.meta["param"] = (spec.target,)
            elif spec.kind == "state":
                node.meta["param"] = (spec.target[0],)
            continue
        if node.op == "output":
            node.meta["phase"] = "output"
            continue
        if node.op == "get_attr":   # a tensor constant the step created
            node.meta["phase"] = "input"
            node.meta["val"] = fake_mode.from_tensor(getattr(gm, node.target))
            continue
        if "phase" in custom:
            node.meta["phase"] = custom["phase"]
        elif after_backward and any(i.meta.get("phase") in ("backward", "optimizer") for i in node.all_input_nodes):
            node.meta["phase"] = "optimizer"   # gradient post-processing, e.g. clip_grad_norm_
        else:
            node.meta["phase"] = "forward"
        after_backward = after_backward or node.meta["phase"] == "backward"
        node.meta.setdefault("val", None)   # ops that return nothing (in-place updates)
        for key in ("param", "subgroup", "checkpoint"):
            if key in custom:
                node.meta[key] = custom[key]
        if not node.meta.get("stack_trace") and custom.get("source"):
            node.meta["stack_trace"] = custom["source"]
        seq = node.meta.get("seq_nr")
        if node.meta["phase"] == "forward" and seq is not None:
            forward_by_seq[seq] = node
        elif node.meta["phase"] == "backward" and seq in forward_by_seq:
            fwd = forward_by_seq[seq]
            node.meta["grad_of"] = fwd.name
            if fwd.meta.get("stack_trace"):
                node.meta["stack_trace"] = fwd.meta["stack_trace"]
    # gradients: the tensors the fused update kernels consume, named by the parameter they update
    placeholder_param = {n: n.meta["param"][0] for n in gm.graph.nodes
                         if n.op == "placeholder" and spec_of[n.name].kind == "param"}
    for node in gm.graph.nodes:
        if node.meta.get("phase") == "optimizer" and is_fused_update(node):
            for p, g in zip(node.args[0], node.args[1]):
                if isinstance(g, fx.Node) and p in placeholder_param:
                    g.meta["param"] = (placeholder_param[p],)

