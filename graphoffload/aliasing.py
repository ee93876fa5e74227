"""Which storage each node value lives in, and which nodes read and write each storage.

The graph is not functionalized (passes/README.md), so a pass that moves nodes must respect
aliasing: a view or an in-place op returns its argument's storage, and an op whose schema marks
an argument `(a!)` writes into it. Both facts come from the op schemas; memory analysis and
scheduling passes share this one implementation.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable
from itertools import islice
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import fx


_MISSING = object()


@dataclass(frozen=True)
class _OpFacts:
    """What an op's schema says of its arguments, read once per op rather than once per node:
    the (position, name) of each argument it writes into (`Tensor(a!)`), and per return the
    arguments it may alias, in schema order (the first one a node passes is the one aliased)."""

    writes: tuple[tuple[int, str], ...]
    aliases: tuple[tuple[tuple[int, str], ...], ...]


def _op_facts(target: object) -> _OpFacts | None:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    args = [(i, arg) for i, arg in enumerate(schema.arguments) if arg.alias_info is not None]
    writes = tuple((i, arg.name) for i, arg in args if arg.alias_info.is_write)
    aliases = []
    for ret in schema.returns:
        info = ret.alias_info
        # `Tensor(a -> *) self ... -> Tensor(a)[]` (split, unbind, chunk): the list's elements alias
        # `self`, but the bindings give the element's alias set only on the argument's side, as
        # the wildcard it becomes; without this every element counted as a storage of its own
        aliases.append(() if info is None else tuple(
            (i, arg.name) for i, arg in args
            if set(arg.alias_info.before_set) & set(info.before_set)
            or (not info.before_set and "*" in arg.alias_info.after_set)))
    return _OpFacts(writes, tuple(aliases))


def _value(node: fx.Node, position: int, name: str) -> object:
    """What a node passes for a schema argument (positionally or by name), or _MISSING."""
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(name, _MISSING)


def _nodes_in(value: object) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, fx.Node)]
    return []


def _written(node: fx.Node, facts: _OpFacts | None) -> list[fx.Node]:
    if node.op != "call_function" or facts is None:
        return []
    return [n for position, name in facts.writes for n in _nodes_in(_value(node, position, name))]


def written_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes an op writes into, per its schema (`Tensor(a!)`)."""
    return _written(node, _op_facts(node.target) if node.op == "call_function" else None)


# `_unsafe_view` returns a view of its input, but its schema declares a fresh tensor (so that
# autograd does not track it as a view); make_fx records one after every batched matmul
_UNDECLARED_VIEWS = {torch.ops.aten._unsafe_view.default}


def _aliased_arg(node: fx.Node, ret_index: int, facts: _OpFacts | None) -> object:
    """The argument (node or list of nodes) output `ret_index` of `node` aliases, if any."""
    if any(node.target is view for view in _UNDECLARED_VIEWS):   # by identity: OpOverload hashes in Python
        return node.args[0]
    if facts is None or ret_index >= len(facts.aliases):
        return None
    for position, name in facts.aliases[ret_index]:
        value = _value(node, position, name)
        if value is not _MISSING:
            return value
    return None


class Access(NamedTuple):
    """One node's access to a storage (a named tuple: a deep graph has tens of thousands)."""

    position: int
    node: fx.Node
    writes: bool          # creates the storage or writes into it


# makes an Access without the named tuple's own __new__ (a Python frame per access; a planner
# makes tens of thousands per storage map, one map per edit)
_new_access = tuple.__new__


_NOT_TENSOR = object()


class _NodeFacts(NamedTuple):
    """What a StorageMap reads from one node that does not depend on where the node is or on
    the storage numbering: valid while the node's args, kwargs, target and meta["val"] are
    the same objects (fx assigns a new tuple when a node's args change)."""

    args: object
    kwargs: object
    target: object
    val: object
    # ("leaf", is tensor) | ("item", source, index) | ("outs", per output: _NOT_TENSOR, the
    # argument node it aliases, or None for a new storage)
    layout: tuple
    written: list[fx.Node] | None   # the argument nodes it writes into; None: it writes nothing
    inputs: list[fx.Node]


class _Shared(NamedTuple):
    """What a StorageMap takes over from the last map of its graph (StorageMap._shared_prefix):
    the nodes before `start` as they were, `inserted` new leaves, then `kept` nodes as they were,
    each `inserted` positions later; `made`: the storages made before `start`, `made_kept`: in
    the last map, before the kept nodes' end; `shift`: how many the new leaves make."""

    start: int
    inserted: int
    kept: int
    made: int
    made_kept: int
    shift: int

    @property
    def resume(self) -> int:
        """The first position built anew."""
        return self.start + self.inserted + self.kept


class StorageCache:
    """Node facts shared by the StorageMaps of one graph as it is edited: a planner that
    rebuilds the map after each edit of a graph of thousands of nodes reads again only the
    nodes the edit made or rewired, and takes from the last map built what comes before the
    first node an edit changed and, past new placeholders (an offload's host buffer), the nodes
    after them up to the next change (`StorageMap._shared_prefix`). Maps built with it are the
    maps built without it.

    Each node's cached facts are checked against the node (its target, args, kwargs and value,
    by identity) on every map build, unless the owner records its edits (`records_changes`):
    then only the nodes it reported (`touched`) since the last map and the nodes the cache has
    no facts of are read again. An edit that changes a node behind the record's back must say
    so (`forget`): the next map then checks every node, as a cache that records nothing does."""

    def __init__(self, records_changes: bool = False) -> None:
        self.entries: dict[fx.Node, _NodeFacts] = {}
        self.last: StorageMap | None = None   # the map built last with this cache
        # id(tensor) -> (the tensor, held so the id stays its own; its allocator bytes), for the
        # memory analysis of each map (graphoffload.memory)
        self.sizes: dict[int, tuple[object, int]] = {}
        self.records_changes = records_changes
        # the nodes made, rewired or given a new value since the last map built with this cache,
        # as reported; None: not known (no record kept, or `forget`), every node is checked
        self.changed: set[fx.Node] | None = None

    def touched(self, nodes: Iterable[fx.Node]) -> None:
        """Report nodes an edit made, or whose target, args, kwargs or value it changed: the next
        map reads their facts again (nodes moved or erased need no report)."""
        if self.changed is not None:
            self.changed.update(nodes)

    def forget(self) -> None:
        """Some node changed unreported (a pass over the whole graph): the next map checks every node."""
        self.changed = None

    def built(self) -> None:
        """A map was built with this cache: every node's facts in it are current."""
        self.changed = set() if self.records_changes else None


class StorageMap:
    """Storage ids of every node output, and every access to each storage in node order.

    Built after every pass (verification) and by most passes, so it is kept lean: schema facts
    are looked up once per op (by the op object's id: an OpOverload hashes in Python), and
    `accesses=False` builds the storage ids alone, for callers that ask which storages nodes
    write (`written_placeholders`); `cache`: node facts kept from the maps of earlier versions
    of the same graph (StorageCache)."""

    def __init__(self, graph: fx.Graph, accesses: bool = True, cache: StorageCache | None = None):
        self.nodes = [n for n in graph.nodes if n.op != "output"]
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.ids: dict[fx.Node, list[int | None]] = {}
        self.creator: list[fx.Node] = []
        self.cache = cache
        # per op (by id: the graph keeps its targets alive): a graph repeats a few ops many times
        self._facts: dict[int, _OpFacts | None] = {}
        entries = {} if cache is None else cache.entries
        self._node_facts = self._all_facts(entries, None if cache is None else cache.changed)
        if cache is not None:
            cache.built()
        self.accesses: dict[int, list[Access]] = defaultdict(list)
        last = cache.last if cache is not None and accesses else None
        shared = _Shared(0, 0, 0, 0, 0, 0) if last is None or last.graph is not graph else self._shared_prefix(last)
        resume = shared.resume
        ids, storages_of = self.ids, self._storages_of
        for node, facts in zip(self.nodes[resume:], self._node_facts[resume:]):
            ids[node] = storages_of(node, facts.layout)
        if accesses:
            if resume:
                self._record_accesses_after(last, shared)
            else:
                self._record_accesses(0, self.accesses)
        self.output_reads = {s for inp in graph.output_node().all_input_nodes for s in self.of(inp)}
        self.graph = graph
        if cache is not None and accesses:
            cache.last = self

    def _all_facts(self, entries: dict[fx.Node, _NodeFacts], changed: set[fx.Node] | None) -> list[_NodeFacts]:
        """Every node's facts, the cached entry where it is still valid (_NodeFacts): a planner
        rebuilds the map after each edit, and most nodes are as they were. `changed`: the only
        nodes whose cached facts may be stale (StorageCache.touched), or None: check each one."""
        get, make = entries.get, self._facts_of_node
        if changed is not None:
            # one lookup per node in C; the check (about 0.6 us a node: fx's args and kwargs are
            # Python properties) only where an edit reported a change or nothing is cached
            found = list(map(get, self.nodes))
            position, nodes = self.position, self.nodes
            redo = {position[n] for n in changed if n in position}
            at = -1
            try:
                while True:
                    at = found.index(None, at + 1)
                    redo.add(at)
            except ValueError:
                pass
            for at in redo:
                found[at] = make(nodes[at], entries)
            return found
        found = []
        for node in self.nodes:
            entry = get(node)
            if entry is None or entry.args is not node.args or entry.kwargs is not node.kwargs \
                    or entry.target is not node.target or entry.val is not node.meta.get("val"):
                entry = make(node, entries)
            found.append(entry)
        return found

    def _facts_of_node(self, node: fx.Node, entries: dict[fx.Node, _NodeFacts]) -> _NodeFacts:
        val = node.meta.get("val")
        found = entries.get(node)
        if found is not None and found.args is node.args and found.kwargs is node.kwargs \
                and found.target is node.target and found.val is val:
            return found
        facts = self._facts_of(node.target) if node.op == "call_function" else None
        found = entries[node] = _NodeFacts(
            node.args, node.kwargs, node.target, val, self._layout(node, val),
            _written(node, facts) if facts is not None and facts.writes else None, node.all_input_nodes)
        return found

    def _shared_prefix(self, last: StorageMap) -> _Shared:
        """Take over from `last` (an earlier map of this graph) the storage ids of the nodes
        before the first node that differs from its (in place or facts), and the storages they
        create: a node's ids and accesses depend only on its facts and on the ids of the nodes
        before it, so those are what a build from the start would give.

        Where the first difference is new leaves (an activation offload's host buffer: a
        placeholder after the last one) and the nodes after them are `last`'s as they were, those
        nodes are taken over too, each position `inserted` later and each storage made from
        there on numbered `shift` later (the leaves' own storages come first), up to the next
        difference: a new placeholder would otherwise end the shared prefix at the graph's start."""
        old_nodes, old_facts, nodes, facts = last.nodes, last._node_facts, self.nodes, self._node_facts
        start, end = 0, min(len(nodes), len(old_nodes))
        while start < end and nodes[start] is old_nodes[start] and facts[start] is old_facts[start]:
            start += 1
        key = last.position.__getitem__
        made = bisect_left(last.creator, start, key=key)
        if start:
            self.ids.update(islice(last.ids.items(), start))   # in node order, as they were made
            self.creator.extend(last.creator[:made])
        inserted, old_position = 0, last.position
        while start + inserted < len(nodes) and facts[start + inserted].layout[0] == "leaf" \
                and nodes[start + inserted] not in old_position:
            inserted += 1
        kept, at = 0, start + inserted
        if inserted:
            end = min(len(nodes) - at, len(old_nodes) - start)
            while kept < end and nodes[at + kept] is old_nodes[start + kept] \
                    and facts[at + kept] is old_facts[start + kept]:
                kept += 1
        if not kept:
            return _Shared(start, 0, 0, made, made, 0)
        ids, storages_of = self.ids, self._storages_of
        for node, found in zip(nodes[start:at], facts[start:at]):
            ids[node] = storages_of(node, found.layout)
        shift = len(self.creator) - made
        made_kept = bisect_left(last.creator, start + kept, key=key, lo=made)
        self.creator.extend(last.creator[made:made_kept])
        old_ids = last.ids
        for node in old_nodes[start:start + kept]:
            ids[node] = [s if s is None or s < made else s + shift for s in old_ids[node]]
        return _Shared(start, inserted, kept, made, made_kept, shift)

    def _record_accesses_after(self, last: StorageMap, shared: _Shared) -> None:
        """The accesses of the nodes from `shared.resume` on, after `last`'s accesses of the nodes
        before it (_shared_prefix), those of the kept nodes `shared.inserted` positions later:
        each storage's list is `last`'s up to there (the same list where nothing is added to it
        or moved; `last` is left as it was) and then the new ones; the storages in the order they
        were made, as a build from the start lists them."""
        tail: dict[int, list[Access]] = defaultdict(list)
        self._record_accesses(shared.resume, tail)
        accesses, position, access = self.accesses, operator.itemgetter(0), _new_access
        start, inserted, made, made_kept, shift = shared.start, shared.inserted, shared.made, shared.made_kept, shared.shift
        cut = start + shared.kept   # `last`'s accesses from here on are recorded again
        leaves = self.nodes[start:start + inserted]
        for s, old in last.accesses.items():
            if s >= made_kept:
                continue   # made from `cut` on: numbered anew
            if s >= made and leaves:   # (`last` lists them in the order first accessed: those made before `start` first)
                self._add_leaves(leaves, tail)
                leaves = []
            new = s if s < made else s + shift
            if old[-1][0] >= start:
                i = bisect_left(old, start, key=position) if s < made else 0
                j = bisect_left(old, cut, key=position, lo=i)
                if j > i and inserted:   # the kept nodes' accesses, moved
                    old = old[:i] + [access(Access, (p + inserted, n, w)) for p, n, w in old[i:j]]
                else:
                    old = old[:j]
            added = tail.pop(new, None)
            accesses[new] = old + added if added else old
        if leaves:
            self._add_leaves(leaves, tail)
        accesses.update(tail)

    def _add_leaves(self, leaves: list[fx.Node], tail: dict[int, list[Access]]) -> None:
        """The accesses of new leaves (_shared_prefix): each makes its storage and reads nothing;
        then `tail`'s (recorded from the first position built anew) of those storages."""
        position, access = self.position, _new_access
        for node in leaves:
            for s in self.ids[node]:
                if s is not None:
                    self.accesses[s] = [access(Access, (position[node], node, True))] + tail.pop(s, [])

    def _record_accesses(self, start: int, accesses: dict[int, list[Access]]) -> None:
        # a planner rebuilds the map after every edit of a graph of thousands of nodes, so the
        # common node (writes nothing) takes the short path, in plain loops: each storage's list
        # gets one access per node, whatever order the node's storages are visited in
        ids, creator = self.ids, self.creator
        get, access = ids.get, _new_access
        for i, node, facts in zip(range(start, len(self.nodes)), self.nodes[start:], self._node_facts[start:]):
            if facts.written is None:
                marked: dict[int, bool] = {}   # storage -> created by this node
                for inp in facts.inputs:
                    for s in get(inp, ()):
                        if s is not None:
                            marked[s] = False
                for s in ids[node]:
                    if s is not None and creator[s] is node:
                        marked[s] = True
                for s, made in marked.items():
                    accesses[s].append(access(Access, (i, node, made)))
                continue
            written = {s for w in facts.written for s in get(w, ()) if s is not None}
            created = {s for s in ids[node] if s is not None and creator[s] is node}
            read = {s for inp in facts.inputs for s in get(inp, ()) if s is not None}
            for s in read | written | created:
                accesses[s].append(Access(i, node, s in written or s in created))

    def _facts_of(self, target: object) -> _OpFacts | None:
        key = id(target)
        try:
            return self._facts[key]
        except KeyError:
            facts = self._facts[key] = _op_facts(target)
            return facts

    def _new(self, node: fx.Node) -> int:
        self.creator.append(node)
        return len(self.creator) - 1

    def _layout(self, node: fx.Node, val: object) -> tuple:
        """Where each of the node's outputs lives, without the storage numbers (_NodeFacts)."""
        if node.op in ("placeholder", "get_attr"):
            return ("leaf", isinstance(val, torch.Tensor))
        if node.target is operator.getitem:
            src, j = node.args
            return ("item", src, j)
        outs = val if isinstance(val, (list, tuple)) else [val]
        facts = self._facts_of(node.target)
        single_return = facts is not None and len(facts.aliases) == 1
        layout: list[object] = []
        for j, out in enumerate(outs):
            if not isinstance(out, torch.Tensor):
                layout.append(_NOT_TENSOR)
                continue
            alias = _aliased_arg(node, 0 if single_return else j, facts)
            if isinstance(alias, (list, tuple)):
                alias = alias[j] if j < len(alias) else None
            layout.append(alias if isinstance(alias, fx.Node) else None)
        return ("outs", tuple(layout))

    def _storages_of(self, node: fx.Node, layout: tuple) -> list[int | None]:
        kind = layout[0]
        if kind == "leaf":
            return [self._new(node) if layout[1] else None]
        if kind == "item":
            _, src, j = layout
            src_ids = self.ids.get(src, [])
            return [src_ids[j] if isinstance(j, int) and j < len(src_ids) else None]
        ids: list[int | None] = []
        for alias in layout[1]:
            if alias is _NOT_TENSOR:
                ids.append(None)
                continue
            src = self.ids.get(alias) if alias is not None else None
            ids.append(src[0] if src and src[0] is not None else self._new(node))
        return ids

    def written_by(self, node: fx.Node) -> list[fx.Node]:
        """The argument nodes `node` writes into (written_args, as read when the map was built)."""
        return self._node_facts[self.position[node]].written or []

    def of(self, node: fx.Node) -> list[int]:
        """Storages a node's value(s) live in."""
        return [s for s in self.ids.get(node, []) if s is not None]


def written_placeholders(graph: fx.Graph, cache: StorageCache | None = None) -> set[str]:
    """Names of the placeholders some node writes into, directly or through a view. `cache`:
    node facts kept from earlier calls on versions of the same graph (the verification after
    each pass of one compile reads again only the nodes a pass made or rewired); the answer is
    the one without it."""
    storages = StorageMap(graph, accesses=False, cache=cache)   # only writes matter: no access lists
    owner = {sid: n for n in storages.nodes if n.op == "placeholder" for sid in storages.of(n)}
    written: set[str] = set()
    for node, facts in zip(storages.nodes, storages._node_facts):
        for target in facts.written or ():
            for sid in storages.of(target):
                placeholder = owner.get(sid)
                if placeholder is not None and placeholder is not node:
                    written.add(placeholder.name)
    return written
