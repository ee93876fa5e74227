"""verify_train_graph: check the invariants of passes/README.md after a pass.

Run by the PassManager after capture and after every pass; an error names the pass that left
the graph broken, the node, and what is wrong with it. One compile verifies the same graph after
each pass, and a pass changes a few of its thousands of nodes: the manager runs one `Verifier`
per compile, which keeps one `StorageCache` across its verifications, so the check of writes into
placeholders reads again only the nodes a pass made or rewired (the answer is the one without it).
"""

from __future__ import annotations

import time

import torch
from torch import fx

from graphoffload.aliasing import StorageCache, written_placeholders
from graphoffload.errors import PassError
from graphoffload.graph import PHASES, TrainGraph
from graphoffload.passes.update_kernels import kernel_rule

# the host variants of the update kernels: (per-parameter list arguments, the step counters'),
# laid out as the fused kernels' are, one argument later (the ticket comes first)
_HOST_UPDATE_LISTS = {
    torch.ops.graphoffload.host_adam_.default: ((1, 2, 3, 4, 5, 6), 6),
    torch.ops.graphoffload.host_sgd_.default: ((1, 2, 3), None),
}
_LIST_NAMES = ("parameter", "gradient", "state", "state", "state", "step counter")


def verify_train_graph(graph: TrainGraph, pass_name: str, storage_cache: StorageCache | None = None) -> None:
    """Raise PassError naming `pass_name` if `graph` breaks an invariant of passes/README.md.
    `storage_cache`: node facts kept from the verifications of earlier versions of this graph
    (one compile's PassManager.run keeps one); the checks and their answers are the same."""
    def fail(what: str) -> None:
        raise PassError(f"after pass {pass_name!r}: {what}")

    try:
        graph.graph.lint()
    except Exception as exc:  # noqa: BLE001 - fx raises plain RuntimeErrors
        fail(f"the fx graph does not lint: {exc}")
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    names = [s.name for s in graph.signature.inputs]
    if [n.name for n in placeholders] != names:
        fail(f"placeholders {[n.name for n in placeholders]} do not match the signature's inputs {names}")
    outputs = graph.graph.output_node().args[0]
    if not isinstance(outputs, (tuple, list)):
        fail(f"the output node returns {type(outputs).__name__}, expected a tuple with one value per "
             "signature output")
    if len(outputs) != len(graph.signature.outputs):
        fail(f"the graph returns {len(outputs)} values but its signature lists {len(graph.signature.outputs)}")
    for node in graph.graph.nodes:
        if node.op == "output":
            continue
        if node.op not in ("placeholder", "get_attr", "call_function"):
            fail(f"node {node.name} has op {node.op!r}; only placeholder, get_attr (constants) and "
                 "call_function nodes are allowed")
        if "val" not in node.meta:
            fail(f"node {node.name} ({node.target}) has no meta['val']")
        if node.meta.get("phase") not in PHASES:
            fail(f"node {node.name} has phase {node.meta.get('phase')!r}, expected one of {PHASES}")
        if "pass" not in node.meta:
            fail(f"node {node.name} does not record the pass that created it")
        problem = update_operand_problem(node)
        if problem:
            fail(f"update node {node.name} ({node.target}): {problem}. An update kernel reads its lists "
                 "element by element: every list must pair each parameter with operands of its shape, "
                 "dtype and device (a kernel given anything else reads out of bounds)")
    mutable = {spec.name for spec in graph.signature.inputs if spec.mutable}
    for name in written_placeholders(graph.graph, storage_cache) - mutable:
        fail(f"placeholder {name} is written to (directly or through a view) but its signature entry is "
             "not marked mutable")


class Verifier:
    """verify_train_graph for one run of the passes (PassManager.run): one StorageCache across
    its verifications (each reads again only the nodes the pass before it made or rewired), and
    their seconds (wall and the process's CPU, which the manager logs once the passes end)."""

    def __init__(self) -> None:
        self.storage_cache = StorageCache()
        self.count, self.seconds, self.cpu_seconds = 0, 0.0, 0.0

    def __call__(self, graph: TrainGraph, pass_name: str) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            verify_train_graph(graph, pass_name, self.storage_cache)
        finally:
            self.count += 1
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.process_time() - cpu


def _describe(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)} on {v.device}"
    return type(v).__name__


def update_operand_problem(node: fx.Node) -> str | None:
    """What is wrong with the operand lists of an update kernel (fused, or its host variant),
    or None: every list as long as the parameters', each element of its parameter's shape,
    dtype and device (step counters: one-element tensors on the parameters' device or the host;
    a host update's gradients may be narrower, it widens them)."""
    rule = kernel_rule(node)
    if rule is not None:
        positions, steps, host = rule.list_positions, rule.steps_position, False
    elif node.op == "call_function" and node.target in _HOST_UPDATE_LISTS:
        (positions, steps), host = _HOST_UPDATE_LISTS[node.target], True
    else:
        return None
    lists = [node.args[p] if p < len(node.args) else None for p in positions]
    params = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in (lists[0] or [])]
    for i, (pos, operands) in enumerate(zip(positions, lists)):
        if i == 0 or not operands:
            continue   # optional lists (max_exp_avg_sqs without amsgrad, momentum without it) are empty
        what = "step counter" if pos == steps else _LIST_NAMES[min(i, 2)]
        if len(operands) != len(params):
            return f"argument {pos} holds {len(operands)} {what}s for {len(params)} parameters"
        for j, (operand, param) in enumerate(zip(operands, params)):
            val = operand.meta.get("val") if isinstance(operand, fx.Node) else operand
            name = operand.name if isinstance(operand, fx.Node) else repr(operand)
            if not isinstance(val, torch.Tensor) or not isinstance(param, torch.Tensor):
                return f"{what} {j} ({name}) is {_describe(val)}, not a tensor"
            if pos == steps:
                if val.numel() != 1 or val.device not in (param.device, torch.device("cpu")):
                    return (f"step counter {j} ({name}) is {_describe(val)}; expected one element, on "
                            f"{param.device} or the host")
                continue
            narrower_grad = host and what == "gradient" and val.is_floating_point()
            if val.shape != param.shape or val.device != param.device or (
                    val.dtype != param.dtype and not narrower_grad):
                return f"{what} {j} ({name}) is {_describe(val)} but its parameter is {_describe(param)}"
    return None
