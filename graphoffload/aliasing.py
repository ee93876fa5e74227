"""Which storage each node value lives in, and which nodes read and write each storage.

The graph is not functionalized (passes/README.md), so a pass that moves nodes must respect
aliasing: a view or an in-place op returns its argument's storage, and an op whose schema marks
an argument `(a!)` writes into it. Both facts come from the op schemas; memory analysis and
scheduling passes share this one implementation.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx


def _arg_values(node: fx.Node) -> Iterator[tuple[torch._C.Argument, object]]:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            yield arg, node.args[i]
        elif arg.name in node.kwargs:
            yield arg, node.kwargs[arg.name]


def _nodes_in(value: object) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, fx.Node)]
    return []


def written_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes an op writes into, per its schema (`Tensor(a!)`)."""
    if node.op != "call_function":
        return []
    return [n for arg, value in _arg_values(node)
            if arg.alias_info is not None and arg.alias_info.is_write for n in _nodes_in(value)]


# `_unsafe_view` returns a view of its input, but its schema declares a fresh tensor (so that
# autograd does not track it as a view); make_fx records one after every batched matmul
_UNDECLARED_VIEWS = {torch.ops.aten._unsafe_view.default}


def _aliased_arg(node: fx.Node, ret_index: int) -> object:
    """The argument (node or list of nodes) output `ret_index` of `node` aliases, if any."""
    if node.target in _UNDECLARED_VIEWS:
        return node.args[0]
    schema = getattr(node.target, "_schema", None)
    if schema is None or ret_index >= len(schema.returns):
        return None
    ret = schema.returns[ret_index].alias_info
    if ret is None:
        return None
    for arg, value in _arg_values(node):
        if arg.alias_info is None:
            continue
        if set(arg.alias_info.before_set) & set(ret.before_set):
            return value
        # `Tensor(a -> *) self ... -> Tensor(a)[]` (split, unbind, chunk): the list's elements alias
        # `self`, but the bindings give the element's alias set only on the argument's side, as
        # the wildcard it becomes; without this every element counted as a storage of its own
        if not ret.before_set and "*" in arg.alias_info.after_set:
            return value
    return None


@dataclass(frozen=True)
class Access:
    position: int
    node: fx.Node
    writes: bool          # creates the storage or writes into it


class StorageMap:
    """Storage ids of every node output, and every access to each storage in node order."""

    def __init__(self, graph: fx.Graph):
        self.nodes = [n for n in graph.nodes if n.op != "output"]
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.ids: dict[fx.Node, list[int | None]] = {}
        self.creator: list[fx.Node] = []
        for node in self.nodes:
            self.ids[node] = self._storages_of(node)
        self.accesses: dict[int, list[Access]] = defaultdict(list)
        for i, node in enumerate(self.nodes):
            written = {s for w in written_args(node) for s in self.of(w)}
            created = {s for s in self.ids[node] if s is not None and self.creator[s] is node}
            read = {s for inp in node.all_input_nodes for s in self.of(inp)}
            for s in read | written | created:
                self.accesses[s].append(Access(i, node, s in written or s in created))
        self.output_reads = {s for inp in graph.output_node().all_input_nodes for s in self.of(inp)}

    def _new(self, node: fx.Node) -> int:
        self.creator.append(node)
        return len(self.creator) - 1

    def _storages_of(self, node: fx.Node) -> list[int | None]:
        val = node.meta.get("val")
        if node.op in ("placeholder", "get_attr"):
            return [self._new(node) if isinstance(val, torch.Tensor) else None]
        if node.target is operator.getitem:
            src, j = node.args
            src_ids = self.ids.get(src, [])
            return [src_ids[j] if isinstance(j, int) and j < len(src_ids) else None]
        outs = val if isinstance(val, (list, tuple)) else [val]
        schema = getattr(node.target, "_schema", None)
        single_return = schema is not None and len(schema.returns) == 1
        ids: list[int | None] = []
        for j, out in enumerate(outs):
            if not isinstance(out, torch.Tensor):
                ids.append(None)
                continue
            alias = _aliased_arg(node, 0 if single_return else j)
            if isinstance(alias, (list, tuple)):
                alias = alias[j] if j < len(alias) else None
            src = self.ids.get(alias) if isinstance(alias, fx.Node) else None
            ids.append(src[0] if src and src[0] is not None else self._new(node))
        return ids

    def of(self, node: fx.Node) -> list[int]:
        """Storages a node's value(s) live in."""
        return [s for s in self.ids.get(node, []) if s is not None]


def written_placeholders(graph: fx.Graph) -> set[str]:
    """Names of the placeholders some node writes into, directly or through a view."""
    storages = StorageMap(graph)
    return {n.name for n in graph.nodes if n.op == "placeholder"
            and any(a.writes and a.node is not n for sid in storages.of(n) for a in storages.accesses[sid])}
