"""What the activation planner changed in a graph, by node name, so a restarted job can redo it.

`Offload(activations="auto")` spends most of a compile searching (offload_activations.py); its
outcome, though, is a handful of edits to the graph: nodes added (a region's replayed forward
nodes, an offload's copy out, prefetch and wait, their host placeholders), backward readers
rewired to them, a few meta fields (a transfer's stream) and the notes the planner wrote. This
module records those edits against a snapshot of the graph taken before the planner ran
(`snapshot`, `record`) as plain JSON (node references by name, targets by their qualified name,
dtypes and devices by their name), and re-applies them to the same graph (`apply`), node by
node, at the same positions and under the same names, so offload_plan_cache can keep a plan on
disk and offload_optimizer can skip the search. It knows nothing of the planner's internals:
any edit that adds nodes, moves them, rewires arguments or sets meta is recorded the same way.

`record` refuses (`NotRecordable`) what it cannot write down faithfully (an erased node, a
constant it cannot name); `apply` refuses (`EditsMismatch`) a graph the edits do not fit (a node
missing, a name fx would not give, a value of another shape than recorded), before the caller
trusts it. `structure` is the text of a graph the key of such a plan is made from.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, fields as dataclass_fields
from typing import Any

import torch
from torch import fx

from graphoffload.graph import InputSpec, TrainGraph, fake_mode_of, fill_missing_meta


class NotRecordable(ValueError):
    """The planner's edits include something this module cannot write down (the plan is not cached)."""


class EditsMismatch(ValueError):
    """Recorded edits do not fit the graph they are applied to (the caller plans afresh)."""


class _Unencodable(TypeError):
    pass


def _val(val: Any) -> list | None:
    """A value by what planning reads of it: shape, dtype, stride, device (None: not a tensor)."""
    if not isinstance(val, torch.Tensor):
        return None
    return [list(val.shape), str(val.dtype), list(val.stride()), str(val.device)]


def _callable_name(target: Callable) -> str:
    """`module.qualname` of a plain function (operator.getitem), which `_resolve` gives back."""
    name = f"{target.__module__}:{target.__qualname__}"
    try:
        named = _resolve_callable(name)
    except (EditsMismatch, AttributeError):
        named = None
    if named is not target:
        raise _Unencodable(f"cannot name the target {target!r}")
    return name


def _resolve_callable(name: str) -> Any:
    """The function `_callable_name` named, from a module this process has already imported: a
    cache file never makes it import anything (the module of every target a graph holds was
    imported when the graph was made)."""
    module, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module)
    if found is None:
        raise EditsMismatch(f"the edits name {name}, whose module is not imported in this process")
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _resolve_op(name: str) -> Any:
    namespace, *op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), ".".join(op)), overload)


def _target(target: Any) -> dict:
    if isinstance(target, str):
        return {"str": target}
    try:   # an op overload prints as namespace.op.overload, which torch.ops gives back
        if _resolve_op(str(target)) is target:
            return {"op": str(target)}
    except (AttributeError, ValueError, RuntimeError):
        pass
    if callable(target):
        return {"fn": _callable_name(target)}
    raise _Unencodable(f"cannot name the target {target!r}")


def _decode_target(data: dict) -> Any:
    if "str" in data:
        return data["str"]
    if "op" in data:
        return _resolve_op(data["op"])
    return _resolve_callable(data["fn"])


def encode(x: Any, lenient: bool = False) -> Any:
    """`x` (an argument, a meta value or a note's field) as JSON: nodes by name, tuples, dicts,
    dtypes, devices, layouts, memory formats, slices tagged. `lenient` (a key's text, never
    decoded): a tensor by `_val`, anything else by its type's name."""
    if isinstance(x, fx.Node):
        return {"node": x.name}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (tuple, list)):
        items = [encode(v, lenient) for v in x]
        return items if isinstance(x, list) else {"tuple": items}
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return {"dict": {k: encode(v, lenient) for k, v in x.items()}}
    for kind in (torch.dtype, torch.layout, torch.memory_format):
        if isinstance(x, kind):
            return {kind.__name__: str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, slice):
        return {"slice": [encode(x.start, lenient), encode(x.stop, lenient), encode(x.step, lenient)]}
    if x is Ellipsis:
        return {"ellipsis": True}
    if lenient:
        return {"tensor": _val(x)} if isinstance(x, torch.Tensor) else {"type": type(x).__qualname__}
    raise _Unencodable(f"cannot write down {type(x).__qualname__} {x!r:.80}")


def decode(x: Any, nodes: dict[str, fx.Node]) -> Any:
    """`encode`'s inverse, node names looked up in `nodes`."""
    if isinstance(x, list):
        return [decode(v, nodes) for v in x]
    if not isinstance(x, dict):
        return x
    (tag, v), = x.items()
    if tag == "node":
        if v not in nodes:
            raise EditsMismatch(f"the edits read node {v}, which the graph does not have")
        return nodes[v]
    if tag == "tuple":
        return tuple(decode(i, nodes) for i in v)
    if tag == "dict":
        return {k: decode(i, nodes) for k, i in v.items()}
    if tag in ("dtype", "layout", "memory_format"):
        return getattr(torch, v)
    if tag == "device":
        return torch.device(v)
    if tag == "slice":
        return slice(*(decode(i, nodes) for i in v))
    if tag == "ellipsis":
        return Ellipsis
    if tag == "stack_trace_of":   # `record`'s trace by the node it was copied from
        if v not in nodes:
            raise EditsMismatch(f"the edits take a stack trace from node {v}, which the graph does not have")
        return nodes[v].meta.get("stack_trace")
    raise EditsMismatch(f"unknown tag {tag!r} in recorded edits")


# meta that says when, through what or from where a node was traced (torch's autograd sequence
# number, which counts on across compiles in one process; the nodes it came from; the user's
# lines), not what it computes: a restarted job whose script moved a line finds the plan
_PROVENANCE = frozenset({"seq_nr", "from_node", "stack_trace"})


def _group_positions(node: fx.Node) -> tuple[int, ...]:
    """The positions of a functional collective's `group_name` arguments (a process group's name,
    which each group made in a process gets anew: the step's own groups, `OverGroup.step_group`)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or getattr(node.target, "namespace", None) != "_c10d_functional":
        return ()
    return tuple(i for i, a in enumerate(schema.arguments) if a.name == "group_name" and i < len(node.args))


def structure(graph: TrainGraph) -> str:
    """The graph as text, for a cache key: every node's name, op, target, arguments and meta
    (values by shape, dtype and stride; tracing provenance, stack traces included, left out:
    `record` writes a trace as the node it was copied from), and the signature. A
    collective's process group is written as the order in which the graph first names it, not
    by its name, which differs between two steps over the same ranks (each makes its own group),
    so a second compile of the same model in one process, or a restarted job, finds the plan."""
    lines = [repr(graph.signature)]
    groups: dict[str, int] = {}
    for n in graph.graph.nodes:
        meta = {k: (_val(v) if k == "val" else encode(v, lenient=True)) for k, v in sorted(n.meta.items())
                if k not in _PROVENANCE}
        try:
            target = _target(n.target)
        except _Unencodable:
            target = {"repr": str(n.target)}
        args = list(n.args)
        for i in _group_positions(n):
            args[i] = {"group": groups.setdefault(str(args[i]), len(groups))}
        lines.append(repr((n.name, n.op, target, encode(tuple(args), True), encode(n.kwargs, True), meta)))
    return "\n".join(lines)


@dataclass(frozen=True)
class Snapshot:
    """The graph before the planner ran: each node's arguments (lenient text, to see which the
    planner rewired) and meta (a shallow copy), the inputs and how many notes each pass had."""

    nodes: dict[str, tuple[Any, dict]]
    inputs: tuple[InputSpec, ...]
    notes: dict[str, int]


def snapshot(graph: TrainGraph) -> Snapshot:
    return Snapshot({n.name: (encode((n.args, n.kwargs), True), dict(n.meta)) for n in graph.graph.nodes},
                    graph.signature.inputs, {k: len(v) for k, v in graph.notes.items()})


def _spec(spec: InputSpec) -> dict:
    return {f.name: encode(getattr(spec, f.name)) for f in dataclass_fields(InputSpec)}


def record(before: Snapshot, after: TrainGraph) -> dict:
    """The edits that made `after` from the graph `before` was taken of, as JSON."""
    try:
        return _record(before, after)
    except _Unencodable as exc:
        raise NotRecordable(str(exc)) from exc


def _record(before: Snapshot, after: TrainGraph) -> dict:
    order = [n.name for n in after.graph.nodes]
    erased = before.nodes.keys() - set(order)
    if erased:
        raise NotRecordable(f"the planner erased {sorted(erased)[:3]}")
    if after.signature.inputs[:len(before.inputs)] != before.inputs:
        raise NotRecordable("the planner changed the existing inputs")
    new, args, meta = {}, {}, {}
    # the key leaves stack traces out (`structure`), so a made node's trace, copied from a node of
    # the graph before, is written as that node: applied to a graph traced from moved lines, it
    # takes that graph's trace (a trace no node had is written as it is)
    traces: dict[str, str] = {}
    for name, (_, was_meta) in before.nodes.items():
        trace = was_meta.get("stack_trace")
        if isinstance(trace, str):
            traces.setdefault(trace, name)

    def encode_meta(key: str, value: Any) -> Any:
        if key == "stack_trace" and isinstance(value, str) and value in traces:
            return {"stack_trace_of": traces[value]}
        return encode(value)

    for n in after.graph.nodes:
        if _group_positions(n) and (n.name not in before.nodes
                                    or encode((n.args, n.kwargs), True) != before.nodes[n.name][0]):
            # the key leaves process groups' names out (`structure`); edits naming one would not fit another process
            raise NotRecordable(f"the planner made or rewired collective {n.name}, which names this process's group")
        if n.name not in before.nodes:
            new[n.name] = {"op": n.op, "target": _target(n.target), "args": encode(n.args),
                           "kwargs": encode(n.kwargs), "val": _val(n.meta.get("val")),
                           "meta": {k: encode_meta(k, v) for k, v in n.meta.items() if k != "val"}}
            continue
        was_args, was_meta = before.nodes[n.name]
        if encode((n.args, n.kwargs), True) != was_args:
            args[n.name] = [encode(n.args), encode(n.kwargs)]
        if n.meta.get("val") is not was_meta.get("val"):
            raise NotRecordable(f"the planner changed the value of {n.name}")
        changed = {k: encode_meta(k, v) for k, v in n.meta.items() if k != "val" and (k not in was_meta or (
            was_meta[k] is not v and was_meta[k] != v))}
        dropped = [k for k in was_meta if k not in n.meta]
        if changed or dropped:
            meta[n.name] = {"set": changed, "drop": dropped}
    notes = {p: [[str(note), getattr(note, "kind", ""), encode(dict(getattr(note, "fields", {})))]
                 for note in made[before.notes.get(p, 0):]] for p, made in after.notes.items()}
    return {"order": order, "new": new, "args": args, "meta": meta,
            "inputs": [_spec(s) for s in after.signature.inputs[len(before.inputs):]],
            "inputs_before": len(before.inputs), "notes": {p: n for p, n in notes.items() if n}}


def apply(graph: TrainGraph, edits: dict, pass_name: str) -> TrainGraph:
    """`graph` with `edits` (`record`'s) made again, in place; EditsMismatch where they do not fit
    (the graph is then left part-edited: apply to a copy)."""
    g = graph.graph
    nodes = {n.name: n for n in g.nodes}
    order, new = edits["order"], edits["new"]
    if set(nodes) != {name for name in order if name not in new} or len(graph.signature.inputs) != edits["inputs_before"]:
        raise EditsMismatch("the graph's nodes or inputs are not those the edits were recorded on")
    prev = None
    for name in order:
        if name not in new:
            prev = nodes[name]
            continue
        made = new[name]
        with g.inserting_after(prev) if prev is not None else g.inserting_before(next(iter(g.nodes))):
            node = g.create_node(made["op"], _decode_target(made["target"]), decode(made["args"], nodes),
                                 decode(made["kwargs"], nodes), name=name)
        if node.name != name:
            raise EditsMismatch(f"fx named a re-made node {node.name}, not {name}")
        node.meta = {k: decode(v, nodes) for k, v in made["meta"].items()}
        nodes[name] = prev = node
    prev = None
    for name in order:   # nodes the planner moved (stage 3's backward gathers ahead of a replay)
        node = nodes.get(name)
        if node is not None and prev is not None and node.prev is not prev and name not in new:
            prev.append(node)
        prev = node
    if [n.name for n in g.nodes] != order:
        raise EditsMismatch("the re-made nodes did not land where they were recorded")
    for name, (args, kwargs) in edits["args"].items():
        nodes[name].args, nodes[name].kwargs = decode(args, nodes), decode(kwargs, nodes)
    for name, change in edits["meta"].items():
        nodes[name].meta.update({k: decode(v, nodes) for k, v in change["set"].items()})
        for k in change["drop"]:
            nodes[name].meta.pop(k, None)
    for name, made in new.items():   # values: a replayed node's is its original's, a placeholder's made
        node, val = nodes[name], made["val"]
        original = nodes.get(node.meta.get("recompute_of", ""))
        if original is not None and "val" in original.meta:
            node.meta["val"] = original.meta["val"]
        elif node.op == "placeholder" and val is not None:
            with fake_mode_of(g):
                node.meta["val"] = torch.empty_strided(val[0], val[2], dtype=getattr(torch, val[1].removeprefix("torch.")),
                                                       device=val[3])
    fill_missing_meta(graph, pass_name)
    for name, made in new.items():
        if _val(nodes[name].meta.get("val")) != made["val"]:
            raise EditsMismatch(f"re-made node {name} has value {_val(nodes[name].meta.get('val'))}, recorded "
                                f"{made['val']}")
    specs = [InputSpec(**{k: decode(v, nodes) for k, v in spec.items()}) for spec in edits["inputs"]]
    graph = graph.with_signature(inputs=(*graph.signature.inputs, *specs))
    for p, notes in edits["notes"].items():
        for text, kind, fields in notes:
            graph.note(p, text, kind, **decode(fields, nodes))
    return graph
