"""Looking at compiled steps: explain tables, readable graph listings, DOT drawings, dumps.

Every listing says which pass made each node and where in the user's code it came from, so a
reader can follow a node from source line through capture to the pass that moved it.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from torch import fx

from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.graph import PHASES, TrainGraph, describe_val
from graphoffload.memory import analyze_memory, format_bytes

PHASE_COLOURS = {"input": "#e0e0e0", "forward": "#9ecae1", "backward": "#fdae6b", "optimizer": "#a1d99b",
                 "comm": "#bcbddc", "transfer": "#fa9fb5", "output": "#e0e0e0"}


def _emit(text: str, file: Any) -> str:
    if file is not None:
        print(text, file=file)
    return text


def explain_rows(stages: Mapping[str, TrainGraph]) -> list[dict[str, Any]]:
    rows, previous = [], None
    for name, g in stages.items():
        names = {n.name for n in g.graph.nodes}
        counts = g.phase_counts()
        rows.append({
            "stage": name,
            "nodes": sum(counts.values()),
            **{p: counts.get(p, 0) for p in PHASES if p not in ("input", "output")},
            "added": len(names - previous) if previous is not None else 0,
            "removed": len(previous - names) if previous is not None else 0,
            "peak": analyze_memory(g).peak,
        })
        previous = names
    return rows


def explain(stages: Mapping[str, TrainGraph], timings: dict[str, float], file: Any = None) -> str:
    rows = explain_rows(stages)
    phases = [p for p in PHASES if p not in ("input", "output")]
    header = ["stage", "nodes", *phases, "added", "removed", "predicted peak", "pass time"]
    table = [[r["stage"], r["nodes"], *[r[p] for p in phases], f"+{r['added']}", f"-{r['removed']}",
              format_bytes(r["peak"]), f"{timings[r['stage']] * 1e3:.1f} ms" if r["stage"] in timings else ""]
             for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    lines = ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in [header, *table]]
    notes = stages.get("final", next(iter(stages.values()))).notes
    for pass_name, pass_notes in notes.items():
        lines.extend(f"[{pass_name}] {line}" for line in pass_notes)
    text = "\n".join(lines)
    if file is None and _rich_available():
        _print_rich(header, table, notes)
    else:
        _emit(text, file if file is not None else sys.stdout)
    return text


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _print_rich(header: list[str], table: list[list[Any]], notes: dict[str, list[str]]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="graphoffload: stages of the compiled step")
    for h in header:
        t.add_column(h, justify="left" if h == "stage" else "right")
    for row in table:
        t.add_row(*[str(x) for x in row])
    console = Console(width=max(Console().width, 140))
    console.print(t)
    for pass_name, pass_notes in notes.items():
        for line in pass_notes:
            console.print(f"[bold]{escape(pass_name)}[/bold]: {escape(line)}", highlight=False)


def _format_arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_format_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    return repr(a)


def _target_name(node: fx.Node) -> str:
    t = node.target
    if hasattr(t, "_schema") and hasattr(t, "namespace"):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}" + (
            f".{t._overloadname}" if t._overloadname != "default" else "")
    return getattr(t, "__name__", str(t))


def format_node(node: fx.Node) -> str:
    meta = node.meta
    tags = [meta.get("phase", "?"), f"by {meta.get('pass', '?')}"]
    if meta.get("param"):
        p = meta["param"]
        tags.append("param " + (p[0] if len(p) == 1 else f"{p[0]} +{len(p) - 1}"))
    if "subgroup" in meta:
        tags.append(f"subgroup {meta['subgroup']}")
    if meta.get("grad_of"):
        tags.append(f"grad of {meta['grad_of']}")
    if meta.get("activation"):
        tags.append(f"activation {meta['activation']} to host and back")
    if meta.get("recompute"):
        tags.append(f"recompute of {meta.get('recompute_of', '?')} in {meta['recompute']}")
    where = user_line_of_stack_trace(meta.get("stack_trace"))
    if where:
        tags.append(where)
    val = describe_val(meta.get("val"))
    if node.op == "placeholder":
        code = f"{node.name}: {val}"
    elif node.op == "output":
        return f"return {_format_arg(node.args[0])}"
    else:
        args = [_format_arg(a) for a in node.args] + [f"{k}={_format_arg(v)}" for k, v in node.kwargs.items()]
        code = f"{node.name}: {val} = {_target_name(node)}({', '.join(args)})"
    return f"{code}    # {' | '.join(tags)}"


def format_graph(graph: TrainGraph, stage: str, file: Any = None) -> str:
    lines = [f"# graphoffload stage {stage!r}: {len(graph.graph.nodes)} nodes"]
    lines += [format_node(n) for n in graph.graph.nodes]
    text = "\n".join(lines)
    return _emit(text, file if file is not None else sys.stdout)


def to_dot(graph: TrainGraph, stage: str) -> str:
    out = io.StringIO()
    out.write(f'digraph "{stage}" {{\n  rankdir=TB;\n  node [shape=box, style=filled, fontsize=10];\n')
    out.write(f'  label="graphoffload stage {stage}"; labelloc=t;\n')
    for node in graph.graph.nodes:
        colour = PHASE_COLOURS.get(node.meta.get("phase", ""), "#ffffff")
        label = f"{node.name}\\n{_target_name(node) if node.op == 'call_function' else node.op}" \
                f"\\n{describe_val(node.meta.get('val'))}\\n[{node.meta.get('pass', '?')}]"
        out.write(f'  "{node.name}" [label="{label}", fillcolor="{colour}"];\n')
        for inp in node.all_input_nodes:
            out.write(f'  "{inp.name}" -> "{node.name}";\n')
    out.write("}\n")
    return out.getvalue()


def draw(graph: TrainGraph, stage: str, path: str) -> str:
    """Write DOT to `path`; also `path` with .svg when graphviz is installed. Returns the path
    of the richest file written, and warns when that is only the DOT file."""
    with open(path, "w") as f:
        f.write(to_dot(graph, stage))
    dot = shutil.which("dot")
    if dot is None:
        warnings.warn(f"graphviz's `dot` is not on PATH: wrote only the DOT file {path}, no SVG. Install "
                      "graphviz (e.g. `apt install graphviz` or `brew install graphviz`) and draw again, or open "
                      "the .dot file in any graphviz viewer", stacklevel=3)
        return path
    svg = os.path.splitext(path)[0] + ".svg"
    subprocess.run([dot, "-Tsvg", path, "-o", svg], check=True, capture_output=True)
    return svg


_RUNNABLE_HEADER = '''# Written by graphoffload: stage {stage!r}, made by pass {made_by!r}.
# Re-run it: `python {fname}` runs the graph once on random inputs of the recorded shapes.
import torch
import graphoffload.runtime  # declares torch.ops.graphoffload.* and registers their kernels
from torch import device  # noqa: F401  (used by the generated code)
inf, nan = float("inf"), float("nan")

'''

_RUNNABLE_FOOTER = '''

INPUTS = {inputs!r}
CONSTANTS = {constants!r}   # tensors the step created (get_attr), by attribute name


def example_tensor(shape, dtype, dev):
    dt = getattr(torch, dtype)
    if dt.is_floating_point:
        return torch.randn(shape, dtype=dt, device=dev) * 0.02
    if dt == torch.bool:
        return torch.ones(shape, dtype=dt, device=dev)
    return torch.zeros(shape, dtype=dt, device=dev)


def example_inputs():
    return [example_tensor(*spec) for spec in INPUTS]


if __name__ == "__main__":
    from graphoffload.runtime.host_offload import OffloadRuntime   # streams/worker of offload ops

    inputs = example_inputs()
    module = GraphModule()
    for name, spec in CONSTANTS.items():
        setattr(module, name, example_tensor(*spec))
    with torch.no_grad(), OffloadRuntime(inputs[0].device if inputs else "cpu").active():
        result = module(*inputs)
    print("ran stage {stage}:", [tuple(r.shape) for r in result if isinstance(r, torch.Tensor)])
'''


def runnable_source(graph: TrainGraph, stage: str, fname: str) -> str:
    body = graph.gm.print_readable(print_output=False)
    inputs = [_tensor_spec(n.meta["val"]) for n in graph.graph.nodes if n.op == "placeholder"]
    constants = {n.target: _tensor_spec(n.meta["val"]) for n in graph.graph.nodes if n.op == "get_attr"}
    made_by = {n.meta.get("pass") for n in graph.graph.nodes} - {"capture", None}
    return (_RUNNABLE_HEADER.format(stage=stage, made_by=", ".join(sorted(made_by)) or "capture", fname=fname)
            + body + _RUNNABLE_FOOTER.format(inputs=inputs, constants=constants, stage=stage))


def _tensor_spec(v: Any) -> tuple[tuple[int, ...], str, str]:
    return tuple(v.shape), str(v.dtype).replace("torch.", ""), v.device.type


def dump(stages: Mapping[str, TrainGraph], directory: str) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    written = []
    for i, (stage, graph) in enumerate(stages.items()):
        base = os.path.join(directory, f"{i:02d}_{stage}")
        with open(base + ".txt", "w") as f:
            format_graph(graph, stage, file=f)
        with open(base + ".py", "w") as f:
            f.write(runnable_source(graph, stage, os.path.basename(base + ".py")))
        written += [base + ".txt", base + ".py"]
    return written
