"""The private torch APIs graphoffload relies on, behind one boundary.

torch changes private APIs between releases; keeping each use here, with what it relies on,
makes an upgrade a visit to one module (`tests/test_layers.py` checks that no other module of
the library imports a private torch module). Supported: torch 2.11 and 2.13.

- `pytree`: `torch.utils._pytree` (tree_leaves / tree_flatten / tree_unflatten / tree_map over
  the step's arguments and outputs), the same flattening `make_fx` and `torch.func` use.
- Fake tensors: `FakeTensorMode`, `FakeTensor` and the exceptions a data-dependent op raises
  under it (`DataDependentOutputException`, `DynamicOutputShapeException`) from
  `torch._subclasses.fake_tensor`; `detect_fake_mode` from `torch._guards` finds the mode the
  values of a traced graph belong to.
- Tracing: `make_fx` and `ShapeEnv` (`torch.fx.experimental`), and `functorch_config`
  (`torch._functorch.config`), patched to forbid reading a fake tensor's data pointer while a
  fake mode for capture is made.
- `grad_fn_sequence_number` / `set_grad_fn_sequence_number` / `reset_grad_fn_sequence_number`:
  an autograd node's `_sequence_nr()` and `torch.fx.traceback.set_grad_fn_seq_nr` /
  `reset_grad_fn_seq_nr`, with which capture points each backward node at the forward node it
  differentiates (as AOTAutograd does); absent in a torch without them
  (`grad_fn_sequence_numbers_supported()`).
- `has_kernel_for_dispatch_key`: `torch._C._dispatch_has_kernel_for_dispatch_key`, so meta
  kernels are registered into `aten` only where torch has none.
- `resolve_process_group`: `torch.distributed.distributed_c10d._resolve_process_group`, the
  process group behind the name functional collectives carry in the graph.
- GradScaler's state: `_scale`, `_growth_tracker` and `_per_optimizer_states` (no public handle
  on the tensors it updates in place); `GRAD_SCALER_STATE_ATTRIBUTES` names them.
- `empty_fake`: `FakeTensor(fake_mode, meta_tensor, device)`, the constructor torch's fake
  `empty` itself ends in (positional in 2.11 and 2.13), called directly: a pass makes one host
  fake tensor per state tensor it moves (thousands on a deep model), and `torch.empty` under the
  mode cost ~60 us each through the dispatcher, the constructor ~11 us.
- `recording_created_nodes`: `GraphModule._register_create_node_hook` /
  `_unregister_create_node_hook`, which `Graph.create_node` calls for every node created in a
  graph owned by the module (what `torch.fx.passes.graph_transform_observer` uses to follow a
  pass's changes). The pass manager records provenance with it.
- `stack_trace_recording`: the `record_stack_traces` flag of the tracer behind the proxy mode
  of the make_fx trace in progress (`proxy_tensor.get_proxy_mode().tracer`), which that tracer
  reads for every node it creates, and `torch.fx.proxy._STACK_TRACE_ANCHORS` (functions whose
  frames it keeps besides `forward`); capture skips recording where no frame would be kept.
  Where torch lays them out otherwise, recording stays on (slower, same graph).
- `given_stack_trace` / `recorded_stack_trace`: the same tracer's filter (its
  `_record_forward_stack_traces_only` mode, on in make_fx: frames of functions named `forward`
  or in a `torch/__init__.py`, less `symbolic_shapes.uninteresting_files()`), its formatting
  (`StackSummary.format`, stripped) and `torch.fx.traceback`'s current node meta, whose
  `stack_trace` the tracer gives each node it creates instead of recording one: capture works
  out a traced call's trace once from the frames it walks anyway, where the tracer extracted,
  symbolised and filtered the whole stack for every node (~0.2 ms each). Where torch lays
  these out otherwise, the tracer records as before.
- `rename_node`: `Node._rename`, which renames a node through its graph's namespace (so the
  name stays unique and a later node cannot take it). Capture gives make_fx's placeholders the
  signature's names with it instead of copying the whole graph.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.traceback as _fx_traceback
import torch.utils._pytree as pytree  # noqa: F401  (re-exported; torch imports it anyway)
from torch import fx

if TYPE_CHECKING:
    import torch._functorch.config as functorch_config  # noqa: F401
    from torch._guards import detect_fake_mode  # noqa: F401
    from torch._subclasses.fake_tensor import (DataDependentOutputException,  # noqa: F401
                                               DynamicOutputShapeException, FakeTensor, FakeTensorMode)
    from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: F401

# loaded on first use: importing the tracing machinery costs about 0.4 s, which `import
# graphoffload` (the ops' fake kernels import this module) should not pay
_LAZY = {"functorch_config": ("torch._functorch.config", None),
         "detect_fake_mode": ("torch._guards", "detect_fake_mode"),
         "FakeTensor": ("torch._subclasses.fake_tensor", "FakeTensor"),
         "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode"),
         "DataDependentOutputException": ("torch._subclasses.fake_tensor", "DataDependentOutputException"),
         "DynamicOutputShapeException": ("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
         "make_fx": ("torch.fx.experimental.proxy_tensor", "make_fx"),
         "ShapeEnv": ("torch.fx.experimental.symbolic_shapes", "ShapeEnv")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    loaded = importlib.import_module(module)
    return loaded if attr is None else getattr(loaded, attr)

# GradScaler's private attributes: what each holds
GRAD_SCALER_STATE_ATTRIBUTES = {"scale": "_scale", "growth_tracker": "_growth_tracker",
                                "per_optimizer_states": "_per_optimizer_states"}


def grad_scaler_state(scaler: torch.amp.GradScaler, key: str) -> Any:
    """One of GradScaler's private fields by its key in GRAD_SCALER_STATE_ATTRIBUTES (the scale
    is None until the first `scale()`)."""
    return getattr(scaler, GRAD_SCALER_STATE_ATTRIBUTES[key])


def grad_fn_sequence_numbers_supported() -> bool:
    return hasattr(_fx_traceback, "set_grad_fn_seq_nr")


def grad_fn_sequence_number(node: Any) -> int:
    """The sequence number autograd gave a node when its forward op ran."""
    return node._sequence_nr()


def set_grad_fn_sequence_number(seq: int) -> None:
    """Stamp the ops traced from now on as computing the backward of autograd node `seq`."""
    _fx_traceback.set_grad_fn_seq_nr(seq)


def reset_grad_fn_sequence_number() -> None:
    _fx_traceback.reset_grad_fn_seq_nr()


def has_kernel_for_dispatch_key(qualified_name: str, key: str) -> bool:
    """Whether the op (e.g. "aten::_fused_adamw_") has a kernel for a dispatch key ("Meta")."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, key)


def resolve_process_group(group_name: str) -> Any:
    """The process group a functional collective names in the graph."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def empty_fake(fake_mode: Any, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Any:
    """The FakeTensor `torch.empty(shape, dtype=dtype, device=device)` gives under `fake_mode`
    (contiguous, not requiring grad), made without the dispatcher: fake `empty` allocates the
    meta tensor and wraps it with this same constructor."""
    from torch._subclasses import fake_tensor

    elem = torch.empty(shape, dtype=dtype, device="meta")
    if type(elem) is not torch.Tensor:   # called under a mode that made it (a fake mode, say): ask it
        with fake_mode:
            return torch.empty(shape, dtype=dtype, device=device)
    return fake_tensor.FakeTensor(fake_mode, elem, torch.device(device))


@contextlib.contextmanager
def stack_trace_recording(enabled: bool) -> Iterator[bool]:
    """Switch the stack-trace recording of the make_fx trace in progress on or off until the
    block ends (then restore it); yields whether it could. It stays on while functions are
    registered as stack-trace anchors (their frames would be kept outside `forward` too)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    tracer = getattr(get_proxy_mode(), "tracer", None)
    if tracer is None or not isinstance(getattr(tracer, "record_stack_traces", None), bool) or \
            (not enabled and getattr(fx.proxy, "_STACK_TRACE_ANCHORS", None)):
        yield False
        return
    before = tracer.record_stack_traces
    tracer.record_stack_traces = enabled
    try:
        yield True
    finally:
        tracer.record_stack_traces = before


# make_fx's stack-trace filter keeps frames of functions named `forward` and of files ending so
STACK_TRACE_FILE_SUFFIX = "torch/__init__.py"


def recorded_stack_trace(frames: Sequence[tuple[str, int, str]]) -> str | None:
    """The stack trace make_fx's tracer records for a node created under `frames` (filename,
    line, function name; innermost first): those of them its filter keeps, formatted as it
    formats them. Only frames of functions named `forward` or in a `torch/__init__.py` need be
    given (the filter drops every other); None where it keeps none (the node gets no trace)."""
    from torch.fx.experimental.symbolic_shapes import uninteresting_files

    ignored = uninteresting_files()
    kept = [traceback.FrameSummary(filename, line, name) for filename, line, name in reversed(frames)
            if (name == "forward" or filename.endswith(STACK_TRACE_FILE_SUFFIX)) and filename not in ignored]
    if not kept:
        return None
    return "".join(traceback.StackSummary.from_list(kept).format()).strip() or None


@contextlib.contextmanager
def given_stack_trace(text: str | None) -> Iterator[bool]:
    """Until the block ends, the make_fx trace in progress gives each node it creates the stack
    trace `text` (`recorded_stack_trace` of the frames it would see), or none (None), instead of
    recording one from the Python stack; yields whether it does. Not where its tracer records
    no traces now, filters otherwise than make_fx's does (then its nodes get what it records),
    or keeps the frames of registered anchor functions (frames inside the call could be kept)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    tracer = getattr(get_proxy_mode(), "tracer", None)
    if tracer is None or getattr(tracer, "record_stack_traces", None) is not True or \
            getattr(tracer, "_record_forward_stack_traces_only", None) is not True or \
            getattr(fx.proxy, "_STACK_TRACE_ANCHORS", None) or not _fx_traceback.has_preserved_node_meta():
        yield False
        return
    if text is None:
        tracer.record_stack_traces = False
        try:
            yield True
        finally:
            tracer.record_stack_traces = True
        return
    meta = _fx_traceback.get_current_meta()
    before = meta.get("stack_trace")
    meta["stack_trace"] = text
    try:
        yield True
    finally:
        if before is None:
            meta.pop("stack_trace", None)
        else:
            meta["stack_trace"] = before


def rename_node(node: fx.Node, name: str) -> str:
    """Rename `node` to `name` (or the unique name fx derives from it); returns the name given."""
    node._rename(name)
    return node.name


@contextlib.contextmanager
def recording_created_nodes(gm: fx.GraphModule) -> Iterator[list[fx.Node]]:
    """Yield a list that collects every node created in `gm`'s graph while the block runs."""
    created: list[fx.Node] = []
    hook = created.append
    gm._register_create_node_hook(hook)
    try:
        yield created
    finally:
        gm._unregister_create_node_hook(hook)
