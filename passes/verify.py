"""verify_train_graph: check the invariants of passes/README.md after a pass.

Run by the PassManager after capture and after every pass; an error names the pass that left
the graph broken, the node, and what is wrong with it.
"""

from __future__ import annotations

from graphoffload.aliasing import written_placeholders
from graphoffload.errors import PassError
from graphoffload.graph import PHASES, TrainGraph


def verify_train_graph(graph: TrainGraph, pass_name: str) -> None:
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
    mutable = {spec.name for spec in graph.signature.inputs if spec.mutable}
    for name in written_placeholders(graph.graph) - mutable:
        fail(f"placeholder {name} is written to (directly or through a view) but its signature entry is "
             "not marked mutable")

