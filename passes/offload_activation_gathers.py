"""Stage 3's parameters in the activation planner's replays: read the backward copy.

Under ZeRO stage 3 (zero_params.py) forward reads each parameter from its forward all-gather,
whose buffer dies after forward's last read of it, and backward gathers the parameters again
(the "backward copy"). A replay that recomputes a region of forward in backward sits right
before the backward that reads its outputs, so where it would read a forward copy that is freed
by then, it can read the backward copy of the same parameter instead: the same rows, gathered
from the same chunks, none of them updated before backward's last read. Without this, every
region that reads a weight (every matmul) was no candidate under stage 3, and the plans
offloaded what checkpointing would recompute.

The backward copy must be on the device before the replay: where a replay reads a bucket
before its backward gather's wait, that wait and the unpacking of the bucket (the views that
make each whole parameter) move to right before the replay's first reader, and the bucket's
launch with them where it came later; the move is read off the graph as it is (`place`), so a
replay undone puts them back where zero placed them (`meta["gather_home"]`, the node each
preceded), whatever order the planner undoes its choices in. The bucket is then live from
the replay on rather than from its first backward read: the planner's liveness analysis of the
rewritten graph counts it, as it counts everything a choice adds. A parameter whose bucket
backward does not gather again (the last forward bucket, which backward reads from forward's
copy: live anyway) keeps its forward copy; one with no backward copy at all (backward never
reads it) still makes a region that reads its freed forward copy no candidate.
"""

from __future__ import annotations

import torch
from torch import fx

c10d = torch.ops._c10d_functional

_MOVED = "gather_moved"   # meta flag: a backward gather placed ahead of its home for a replay


def backward_copies(nodes: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each stage-3 forward copy of a parameter (zero_params' `meta["gathered"] == "forward"`)
    -> that parameter's backward copy, where backward gathers it again."""
    copies: dict[str, dict[str, fx.Node]] = {"forward": {}, "backward": {}}
    for n in nodes:
        which = n.meta.get("gathered")
        if which in copies:
            copies[which][n.meta["param"][0]] = n
    return {f: copies["backward"][name] for name, f in copies["forward"].items() if name in copies["backward"]}


def wait_of(whole: fx.Node) -> fx.Node:
    """The gather's wait a whole parameter (a `backward_copies` value) is unpacked from."""
    node = whole
    while node.target is not c10d.wait_tensor.default:
        node = node.args[0]
    return node


def _replayed(node: fx.Node) -> bool:
    return str(node.meta.get("recompute", "")).startswith("activations")


def _unpacking(wait: fx.Node) -> list[fx.Node]:
    """The wait and the views that make each whole parameter out of its buffer (phase comm)."""
    found, frontier = [wait], [wait]
    while frontier:
        node = frontier.pop()
        if node.meta.get("gathered"):
            continue
        for user in node.users:
            if user.meta.get("phase") == "comm" and user not in found:
                found.append(user)
                frontier.append(user)
    return found


def _packing(launch: fx.Node) -> list[fx.Node]:
    """The launch and what packs this rank's chunks for it (phase comm)."""
    found, frontier = [launch], [launch]
    while frontier:
        for i in frontier.pop().all_input_nodes:
            if i.meta.get("phase") == "comm" and i not in found:
                found.append(i)
                frontier.append(i)
    return found


def place(graph: fx.Graph) -> bool:
    """Put each backward gather (launch, wait, unpacking) right before the first replay that
    reads one of its parameters where that comes before its home, and back at its home where
    no replay needs it earlier any more; waits stay in launch order. Whether anything moved."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    waits = [n for n in nodes if n.target is c10d.wait_tensor.default and "gather_home" in n.meta]
    if not waits:
        return False
    waits.sort(key=lambda w: position[w.args[0]])
    targets = []
    for w in waits:
        home = by_name.get(w.meta["gather_home"])
        readers = [u for x in _unpacking(w) if x.meta.get("gathered") == "backward" for u in x.users if _replayed(u)]
        targets.append(min([t for t in [home, *readers] if t is not None], key=position.__getitem__, default=None))
    for i in range(len(targets) - 2, -1, -1):   # waits in launch order
        if targets[i] is None or (targets[i + 1] is not None and position[targets[i + 1]] < position[targets[i]]):
            targets[i] = targets[i + 1]
    items = []   # (target, order, nodes): a bucket's launch before its wait, both after the last wait
    for i, (w, target) in enumerate(zip(waits, targets)):
        if target is None:
            continue
        launch = w.args[0]
        home = by_name.get(launch.meta.get("gather_home", ""))
        launch_target = target if home is None or position[target] < position[home] else home
        items.append((launch_target, 2 * i, launch, _packing(launch)))
        items.append((target, 2 * i + 1, w, _unpacking(w)))
    moved = False
    for target, _, head, group in sorted(items, key=lambda t: (position[t[0]], t[1])):
        home = by_name.get(head.meta.get("gather_home", ""))
        if not (position[head] > position[target] or head.meta.get(_MOVED)):
            continue
        for node in sorted(group, key=position.__getitem__):
            target.prepend(node)
        if target is home:
            head.meta.pop(_MOVED, None)
        else:
            head.meta[_MOVED] = True
        moved = True
    return moved
