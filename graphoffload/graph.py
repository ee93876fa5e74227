"""The IR every pass reads and writes: a `TrainGraph` is an fx.GraphModule plus its signature.

Graph conventions (see passes/README.md for the full list of invariants):
  * ATen-level ops, traced with make_fx over the whole step; the only mutations are in-place
    updates of placeholders the signature lists as mutable (parameters, buffers, optimizer
    state) by the model's own in-place ops and by optimizer update nodes.
  * every node carries ``meta["val"]`` (a FakeTensor or a tuple/list of them, or None),
    ``meta["phase"]`` (one of PHASES), ``meta["pass"]`` (which pass created it: "capture" for
    captured nodes), ``meta["stack_trace"]`` where the user's source is known, ``meta["param"]``
    (a tuple of parameter names) on gradient, state and update nodes, and ``meta["grad_of"]``
    (the name of the forward node) on backward nodes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import fx

from graphoffload.errors import PassError
from graphoffload.ops.host_transfer import VALUE_RULES

PHASES = ("input", "forward", "backward", "optimizer", "comm", "transfer", "output")
Phase = Literal["input", "forward", "backward", "optimizer", "comm", "transfer", "output"]

TENSOR_SLOT = object()   # marks where a graph output goes in the step's return value

InputKind = Literal["param", "buffer", "state", "lr", "scaler", "batch", "host_scratch", "grad_sum"]
OutputKind = Literal["user", "grad", "buffer", "skipped"]


@dataclass(frozen=True)
class InputSpec:
    """One placeholder: what it holds and where the runtime finds it.

    ``target`` is the parameter or buffer name for params/buffers, ``(param name, state key)``
    for optimizer state, ``(optimizer index, group index)`` for a learning rate, ``(scaler
    index, "scale" | "growth_tracker")`` for a GradScaler's state, the index
    among the flattened tensor arguments of the step for batch inputs, and ``(param name,
    purpose)`` for host scratch buffers the runtime allocates once (e.g. a gradient's pinned
    landing buffer), and the parameter name for ``grad_sum``, a gradient's running sum over an
    accumulation window (``accumulation_steps``), a buffer the step keeps between calls (on the
    device; in fp32 host memory with ``Offload(accumulate_on="host")``). ``host`` marks tensors kept in (pinned) host memory rather than on the
    model's device; the runtime moves them there once and memory analysis does not count them.
    """

    kind: InputKind
    name: str
    target: Any
    mutable: bool = False
    host: bool = False


@dataclass(frozen=True)
class OutputSpec:
    """One graph output: the step's own return value (``user``, index into its flattened
    tensors), a gradient left on ``param.grad`` (``grad``), a buffer the model rebound to
    a new tensor (``buffer``), or the flag that this call's update was skipped because its loss
    or gradient norm was not finite (``skipped``, with ``CompileConfig.skip_nonfinite``)."""

    kind: OutputKind
    target: Any


@dataclass(frozen=True)
class GraphSignature:
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]

    def input(self, name: str) -> InputSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise PassError(f"placeholder {name!r} has no entry in the graph signature: a pass added or "
                        "renamed a placeholder without recording it (use TrainGraph.add_host_input); "
                        "please report this with the model that triggers it")

    def names(self, kind: InputKind) -> list[str]:
        return [s.name for s in self.inputs if s.kind == kind]

    def param_placeholders(self) -> dict[str, str]:
        """Parameter name -> placeholder name."""
        return {s.target: s.name for s in self.inputs if s.kind == "param"}


class Note(str):
    """One thing a pass reports about what it did: the line `explain()` shows, with its facts as
    fields. Tools and tests read `kind` and `fields` (`graph.notes_of(pass, kind)`), not the
    prose, which may be reworded; a Note is still the str it reads as."""

    kind: str
    fields: Mapping[str, Any]

    def __new__(cls, text: str, kind: str = "", **fields: Any) -> Note:
        note = super().__new__(cls, text)
        note.kind = kind
        note.fields = MappingProxyType(dict(fields))
        return note

    def __reduce__(self):   # copies and pickles keep the fields
        return (_make_note, (str(self), self.kind, dict(self.fields)))


def _make_note(text: str, kind: str, fields: dict[str, Any]) -> Note:
    return Note(text, kind, **fields)


@dataclass
class TrainGraph:
    """A captured (and possibly transformed) train step."""

    gm: fx.GraphModule
    signature: GraphSignature
    notes: dict[str, list[Note]] = field(default_factory=dict)
    schedule: Any = None      # the offload planner's predicted timeline, when one was made

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def placeholders(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.graph.nodes if n.op == "placeholder"}

    def phase_counts(self) -> Counter:
        return Counter(n.meta.get("phase", "?") for n in self.graph.nodes
                       if n.op == "call_function")

    def copy(self) -> TrainGraph:
        """A structurally independent copy (node meta dicts are copied, values shared)."""
        return self.deferred_copy()()

    def deferred_copy(self) -> Callable[[], TrainGraph]:
        """A copy of the graph as it is now, whose GraphModule is built when first asked for.

        What each node is now (its op, target, arguments, name and a copy of its meta), the notes
        and the tensor constants the graph reads are taken now; building the fx graph from them
        and generating the module's Python code wait. A node's arguments are immutable in fx (a
        pass that edits them sets new ones), so they are shared, not copied. The pass manager
        keeps a snapshot of every stage this way, and a compile reads only the last."""
        nodes = [(n, n.op, n.target, n.args, n.kwargs, n.name, n.type, dict(n.meta)) for n in self.graph.nodes]
        constants = {n.target: _attribute(self.gm, n.target) for n in self.graph.nodes if n.op == "get_attr"}
        signature, notes, schedule = self.signature, {k: list(v) for k, v in self.notes.items()}, self.schedule

        def build() -> TrainGraph:
            graph = fx.Graph()
            copied: dict[fx.Node, fx.Node] = {}
            for node, op, target, args, kwargs, name, type_, meta in nodes:
                if op == "output":   # as graph_copy + graph.output() make it
                    new = graph.output(fx.map_arg(args[0], copied.__getitem__))
                else:
                    new = graph.create_node(op, target, fx.map_arg(args, copied.__getitem__),
                                            fx.map_arg(kwargs, copied.__getitem__), name, type_)
                new.meta = dict(meta)
                copied[node] = new
            return TrainGraph(fx.GraphModule(constants, graph), signature, notes, schedule)
        return build

    def with_signature(self, **changes: Any) -> TrainGraph:
        return TrainGraph(self.gm, replace(self.signature, **changes), self.notes, self.schedule)

    def without_inputs(self, names: Collection[str]) -> TrainGraph:
        """This graph less the inputs (placeholders and specs) named `names`, which nothing reads."""
        placeholders = self.placeholders()
        for name in names:
            self.graph.erase_node(placeholders[name])
        return self.with_signature(inputs=tuple(s for s in self.signature.inputs if s.name not in names))

    def add_host_input(self, specs: list[InputSpec], spec: InputSpec, shape: torch.Size,
                       dtype: torch.dtype, param: str) -> fx.Node:
        """A new placeholder for a host tensor, after the last one; `spec` is appended to
        `specs`, which the pass installs with `with_signature(inputs=...)` when done."""
        # placeholders lead the graph (fake_mode_of relies on it too), so the last one is the
        # placeholder followed by another op; a pass adds one per parameter, so first try the
        # newest placeholder (usually the last, as each new one goes last) before walking them
        found = self.graph.find_nodes(op="placeholder", sort=False)
        last = found[-1] if found else None
        if last is not None and last.next.op == "placeholder":
            for n in self.graph.nodes:
                if n.op != "placeholder":
                    break
                last = n
        with self.graph.inserting_after(last):
            node = self.graph.placeholder(spec.name)
        node.meta["val"] = host_fake(self.graph, shape, dtype)
        node.meta.update({"phase": "input", "param": (param,)})
        specs.append(replace(spec, name=node.name))   # the name fx gave it (see placeholder_name)
        return node

    def note(self, pass_name: str, line: str, kind: str = "", **fields: Any) -> Note:
        """Record what `pass_name` did: `line` for `explain()`, `kind` and `fields` for tools."""
        note = Note(line, kind, **fields)
        self.notes.setdefault(pass_name, []).append(note)
        return note

    def notes_of(self, pass_name: str, kind: str) -> list[Note]:
        """The notes of one kind a pass recorded (e.g. `notes_of("offload_optimizer", "plan")`)."""
        return [n for n in self.notes.get(pass_name, []) if getattr(n, "kind", "") == kind]


def _attribute(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


class Stages(Mapping):
    """The graph after each stage of a compile (`"captured"`, each pass's name, `"final"`), in
    order. A stage is recorded as a deferred copy (`TrainGraph.deferred_copy`) and built the
    first time it is read, so keeping a snapshot per pass costs a compile little."""

    def __init__(self) -> None:
        self._built: dict[str, TrainGraph] = {}
        self._pending: dict[str, Callable[[], TrainGraph]] = {}
        self._order: list[str] = []
        self._same_as: dict[str, str] = {}

    def record(self, name: str, graph: TrainGraph) -> None:
        """Snapshot `graph` as stage `name`."""
        self._order.append(name)
        self._pending[name] = graph.deferred_copy()

    def alias(self, name: str, existing: str) -> None:
        """Stage `name` is the same graph object as stage `existing` (`"final"`)."""
        self._order.append(name)
        self._same_as[name] = existing

    def __getitem__(self, name: str) -> TrainGraph:
        name = self._same_as.get(name, name)
        if name not in self._built:
            if name not in self._pending:
                raise KeyError(name)
            self._built[name] = self._pending.pop(name)()
        return self._built[name]

    def __iter__(self):
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


def placeholder_name(prefix: str, name: str) -> str:
    """The name to ask fx for when a placeholder holds something of the parameter, buffer or
    state called `name`. fx may still change it (it snake-cases capitals, `LayerNorm` ->
    `layer_norm`, and numbers clashes), so whoever creates a placeholder records the name the
    node got in the signature, and the user's name lives in the spec's `target`: nothing looks a
    parameter up by re-deriving it from a node name."""
    return f"{prefix}_" + "".join(c if c.isalnum() else "_" for c in name)


def host_fake(graph: fx.Graph, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous host tensor's value on the graph's fake tensors: what `torch.empty(shape,
    dtype=dtype, device="cpu")` gives under `fake_mode_of(graph)`, made by the constructor the
    fake `empty` ends in (`torch_private.empty_fake`): passes make one per moved state tensor."""
    from graphoffload.torch_private import empty_fake

    return empty_fake(fake_mode_of(graph), shape, dtype, torch.device("cpu"))


def fake_mode_of(graph: fx.Graph):
    """The FakeTensorMode the graph's placeholder values were traced under.

    Passes ask for it once per node they create (hundreds of times on a deep model), so it
    reads only the leading placeholders and takes the mode of the first fake tensor among
    them; scanning every node and checking every value each time made compiles quadratic.
    A graph whose placeholders carry no fake tensor falls back to torch's full detection."""
    from graphoffload.torch_private import FakeTensor, detect_fake_mode

    for node in graph.nodes:
        if node.op != "placeholder":
            break
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode
    return detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])


def fake_value(node: fx.Node, fake_mode: Any = None) -> Any:
    """`node`'s value on the graph's fake tensors: its target run on its inputs' `meta["val"]`,
    under `fake_mode` (the graph's, `fake_mode_of`, when not given). What a pass stores as
    `meta["val"]` of a node it makes (as Inductor fills it when a node is made)."""
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    # graphoffload's host ops give their value by their fake kernel called directly, without
    # the dispatcher (`ops.host_transfer.VALUE_RULES`); any other op runs as it would in a trace
    run = VALUE_RULES.get(node.target, node.target)
    with fake_mode or fake_mode_of(node.graph):
        return run(*args, **kwargs)


def fill_missing_meta(graph: TrainGraph, pass_name: str, nodes: Iterable[fx.Node] | None = None) -> None:
    """Stamp nodes a pass created: `pass`, `val` (the op run on fake tensors) and `phase`
    (the latest phase among its inputs). Passes call it before analysing what they built.
    `nodes`: only these (in graph order), when the pass knows which it made and the others
    are stamped already (a planner stamping each of thousands of edits of one graph)."""
    fake_mode = None
    order = {p: i for i, p in enumerate(PHASES)}
    for node in graph.graph.nodes if nodes is None else nodes:
        node.meta.setdefault("pass", pass_name)
        if node.op != "call_function":
            continue
        if "val" not in node.meta:
            fake_mode = fake_mode or fake_mode_of(graph.graph)
            try:
                node.meta["val"] = fake_value(node, fake_mode)
            except Exception as exc:  # noqa: BLE001 - reported with the pass's name
                raise PassError(f"pass {pass_name!r} created node {node.name} ({node.target}) whose "
                                f"value cannot be inferred: {exc}") from exc
        if "phase" not in node.meta:
            phases = [n.meta.get("phase", "forward") for n in node.all_input_nodes] or ["forward"]
            node.meta["phase"] = max(phases, key=lambda p: order.get(p, 0))
            if node.meta["phase"] == "input":
                node.meta["phase"] = "forward"


@dataclass(frozen=True)
class NodeInputs:
    """What a node computed from before a pass: its op, its arguments and its value (the objects
    themselves, so a check after the pass is an identity test for the nodes nobody touched)."""

    target: Any
    args: tuple
    kwargs: dict
    val: Any


def snapshot_inputs(graph: TrainGraph) -> dict[fx.Node, NodeInputs]:
    """Each op node's inputs and value, taken before a pass so `refresh_vals` can tell which
    nodes the pass edited without updating their ``meta["val"]``."""
    return {n: NodeInputs(n.target, n.args, n.kwargs, n.meta.get("val"))
            for n in graph.graph.nodes if n.op == "call_function"}


def _same_meta(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and (a.layout != torch.strided or a.stride() == b.stride()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - symbolic or odd values: treat as changed
        return False


def _same_arguments(a: Any, b: Any) -> bool:
    # fx makes a new tuple whenever a node's arguments are set, so identity settles the usual case
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. a tensor constant among the arguments: call it edited
        return False


def refresh_vals(graph: TrainGraph, pass_name: str, before: Mapping[fx.Node, NodeInputs]) -> list[fx.Node]:
    """Recompute ``meta["val"]`` where a pass changed what a node computes but left its value
    as it was (as Inductor's FakeTensorUpdater does after its passes): a node whose op or
    arguments the pass edited, or one an input of which now has another value. A value the pass
    set itself is trusted; a recomputed value equal in shape, dtype, device and strides keeps the
    old object (aliasing analyses compare storages). Returns the nodes whose value changed.

    One pass over the graph in order, so a changed size flows to every user downstream."""
    changed: set[fx.Node] = set()
    fake_mode = None
    for node in graph.graph.nodes:
        if node.op != "call_function" or "val" not in node.meta:
            continue
        old = before.get(node)
        if old is None:
            continue   # created by the pass: it set the value, or fill_missing_meta does
        if node.meta["val"] is not old.val:
            if not _same_meta(node.meta["val"], old.val):
                changed.add(node)   # the pass updated it: its users may need the new value
            continue
        edited = (old.target is not node.target or not _same_arguments(old.args, node.args)
                  or not _same_arguments(old.kwargs, node.kwargs))
        if not edited and not any(i in changed for i in node.all_input_nodes):
            continue
        fake_mode = fake_mode or fake_mode_of(graph.graph)
        try:
            val = fake_value(node, fake_mode)
        except Exception as exc:  # noqa: BLE001 - reported with the pass's name
            raise PassError(f"pass {pass_name!r} changed the inputs of node {node.name} ({node.target}), whose "
                            f"value cannot be inferred any more: {exc}") from exc
        if not _same_meta(val, node.meta["val"]):
            node.meta["val"] = val
            changed.add(node)
    return sorted(changed, key=lambda n: n.name)


def tensor_vals(node: fx.Node) -> list[torch.Tensor]:
    """The tensors a node produces, from ``meta["val"]``."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def describe_val(val: Any) -> str:
    """`f32[4, 8]@cpu`-style description of a node value."""
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).replace("torch.", "")
        short = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
                 "int64": "i64", "int32": "i32", "bool": "b8"}.get(dtype, dtype)
        return f"{short}{list(val.shape)}@{val.device.type}"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(describe_val(v) for v in val) + ")"
    return "" if val is None else type(val).__name__
