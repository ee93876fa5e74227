"""Looking at a compiled step: stages, explain(), print_graph(), draw(), dump(), and what timeline()
and plot() show of activation checkpointing and offload next to the same step without them."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import run_steps, tiny_gpt, token_batches
from steps import train_step
from test_checkpointing import Mlp, adamw, mlp_batches, mlp_step
from test_offload_planner import BALANCED, SLOW_PCIE

import graphoffload
from graphoffload import Offload, timeline
from graphoffload.inspection import PHASE_COLOURS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_SOURCE = os.path.join(ROOT, "examples", "gpt.py")


def gpt_line(text: str) -> int:
    with open(GPT_SOURCE) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


@pytest.fixture(scope="module")
def step():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = graphoffload.offload_compile(train_step)
    run_steps(compiled, model, opt, token_batches(1))
    return compiled


def test_graphs_hold_captured_every_pass_and_final(step):
    names = [p.name for p in step.pass_manager.passes]
    assert list(step.graphs) == ["captured", *names, "final"]
    assert step.graphs["final"] is not step.graphs["captured"]
    assert all(isinstance(gm, torch.fx.GraphModule) for gm in step.graphs.values())


def test_explain_has_one_row_per_stage_with_its_node_count(step):
    text = step.explain(file=io.StringIO())
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:] if line.strip()
            and not line.startswith("[")}
    assert set(rows) == set(step.graphs)
    for stage, gm in step.graphs.items():
        n_ops = sum(n.op == "call_function" for n in gm.graph.nodes)
        assert int(rows[stage][1]) == n_ops, stage
    assert "[eliminate_dead_code] removed" in text


def test_print_graph_lines_carry_shape_phase_pass_and_user_source(step):
    text = step.print_graph("final", file=io.StringIO())
    lines = text.splitlines()[1:]
    assert len(lines) == len(step.graphs["final"].graph.nodes)
    qkv = f"gpt.py:{gpt_line('self.qkv(x)')}"
    forward = [ln for ln in lines if qkv in ln and "# forward | by capture" in ln]
    assert forward, f"no forward node points at {qkv}"
    assert any(re.search(r"f32\[2, 16, 96\]@cpu = aten\.(addmm|view)", ln) for ln in forward)
    backward = [ln for ln in lines if qkv in ln and "# backward | by capture" in ln]
    assert backward   # backward nodes inherit their forward node's source line
    assert any("# optimizer | by fuse_optimizer" in ln for ln in lines)
    assert all(" | by " in ln for ln in lines if not ln.startswith("return"))


def test_draw_writes_dot_that_pydot_parses_with_nodes_coloured_by_phase(step, tmp_path):
    import pydot  # in the `test` extra: missing fails rather than skips
    path = tmp_path / "final.dot"
    step.draw("final", str(path))
    (dot,) = pydot.graph_from_dot_file(str(path))
    phases = {n.name: n.meta["phase"] for n in step.graphs["final"].graph.nodes}
    drawn = {n.get_name().strip('"'): n.get("fillcolor").strip('"') for n in dot.get_nodes()
             if n.get("fillcolor")}
    assert set(drawn) == set(phases)
    for name, colour in drawn.items():
        assert colour == PHASE_COLOURS[phases[name]], name
    assert len({drawn[n] for n in drawn}) >= 4    # input, forward, backward, optimizer at least
    assert len(dot.get_edges()) == sum(len(n.all_input_nodes) for n in step.graphs["final"].graph.nodes)


def test_dump_writes_every_stage_and_the_final_module_runs_standalone(step, tmp_path):
    files = step.dump(str(tmp_path))
    assert len(files) == 2 * len(step.graphs)
    assert all(os.path.getsize(f) > 0 for f in files)
    final = [f for f in files if f.endswith("_final.py")]
    assert len(final) == 1
    proc = subprocess.run([sys.executable, final[0]], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ran stage final" in proc.stdout


def test_dumped_module_runs_with_the_tensor_constants_the_step_created(tmp_path):
    def step_with_constant(model, optimizer, x):
        loss = (model(x) * torch.tensor([1.0, 2.0])).sum()   # a get_attr constant in the graph
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    model = torch.nn.Linear(4, 2)
    compiled = graphoffload.offload_compile(step_with_constant)
    compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(3, 4))
    assert any(n.op == "get_attr" for n in compiled.graphs["final"].graph.nodes)
    final = next(f for f in compiled.dump(str(tmp_path)) if f.endswith("_final.py"))
    proc = subprocess.run([sys.executable, final], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_dumped_final_module_computes_what_the_compiled_graph_computes(step, tmp_path):
    # run before only for its exit code: the dumped code is loaded here and its outputs compared
    # with the step's own final GraphModule on the same inputs (issue 20 item 6)
    import importlib.util

    final = next(f for f in step.dump(str(tmp_path)) if f.endswith("_final.py"))
    spec = importlib.util.spec_from_file_location("dumped_final", final)
    dumped = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dumped)
    torch.manual_seed(0)
    # non-negative, so that Adam's exp_avg_sq has a square root and no NaN hides a difference
    inputs = [t.abs() if t.is_floating_point() else t for t in dumped.example_inputs()]
    outputs = []
    for module in (step.graphs["final"], dumped.GraphModule()):
        torch.manual_seed(1)
        args = [t.clone() for t in inputs]
        out = module(*args)
        # the outputs, and the inputs the graph updated in place (parameters, optimizer state)
        outputs.append([t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)] + args)
    want, got = outputs
    assert len(got) == len(want) > len(inputs)
    assert any(not torch.equal(a, t) for a, t in zip(want[-len(inputs):], inputs))   # something was updated
    for i, (g, w) in enumerate(zip(got, want)):
        assert not g.is_floating_point() or not g.isnan().any(), i
        assert torch.equal(g, w), i


# ---------------------------------------------------------------- recompute and memory, with and without the plan

def _checkpointed(offload: Offload | None = None, checkpointed: bool = True):
    """A compiled (not run) step of residual MLP blocks, each under torch.utils.checkpoint."""
    torch.manual_seed(0)
    model = Mlp(width=64, depth=4, checkpointed=checkpointed)
    step = graphoffload.offload_compile(mlp_step, offload=offload)
    step.compile(model, adamw(model), mlp_batches(1, rows=512, width=64)[0])
    return step


def test_timeline_has_recompute_spans_covering_exactly_the_recomputed_nodes(tmp_path):
    step = _checkpointed(Offload(device_updates=2, calibration=BALANCED))
    final = step.last.stages["final"]
    recomputed = {n.name: n.meta["recompute"] for n in final.graph.nodes if "recompute" in n.meta}
    assert len(set(recomputed.values())) == 4
    trace = json.loads(open(step.timeline(str(tmp_path / "t.json"))).read())["traceEvents"]
    (tid,) = [e["tid"] for e in trace if e["ph"] == "M" and e["pid"] == 1 and e["args"]["name"] == "recompute"]
    spans = [e for e in trace if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == tid]
    covered = [name for span in spans for name in span["args"]["nodes"]]
    assert sorted(covered) == sorted(recomputed)          # every recomputed node, once, nothing else
    for span in spans:
        assert {recomputed[name] for name in span["args"]["nodes"]} == {span["args"]["region"]}
        assert span["name"] == f"recompute {span['args']['region']}" and "test_checkpointing.py" in span["args"]["where"]
    # each span is one contiguous run of the final graph, at the nodes' predicted times, in backward
    order = [n.name for n in final.graph.nodes]
    times = timeline.node_times(final, step.last.stages["fuse_optimizer"], step.train_graph.schedule)
    backward = [n.name for n in final.graph.nodes if n.meta.get("phase") == "backward"]
    for span in spans:
        first, last = (order.index(span["args"]["nodes"][i]) for i in (0, -1))
        assert order[first:last + 1] == span["args"]["nodes"]
        assert span["ts"] == pytest.approx(times[order[first]] * 1e6)
        assert span["ts"] + span["dur"] == pytest.approx(times[order[last + 1]] * 1e6)
        assert times[backward[0]] <= times[order[first]]
    assert [s["ts"] for s in spans] == sorted(s["ts"] for s in spans)


def test_plot_draws_the_memory_with_and_without_recompute_and_their_peaks(tmp_path):
    step = _checkpointed()
    keep_everything = _checkpointed(checkpointed=False)
    picture = timeline.step_picture(step.last.stages, None)
    fig = timeline.schedule_figure(None, (), picture)
    top, bottom = fig.axes
    with_plan, without = bottom.lines
    # the compiled step's curve is the liveness analysis of its final graph; the one without the
    # plan peaks where the same model compiled without checkpointing does
    assert max(with_plan.get_ydata()) * 2**20 == step.memory().peak == picture.curves[0].peak
    assert max(without.get_ydata()) * 2**20 == keep_everything.memory().peak == picture.curves[1].peak
    assert step.memory().peak < keep_everything.memory().peak - 4 * 512 * 256 * 4 // 2
    assert "without recompute" in bottom.get_legend().get_texts()[1].get_text()
    # one shaded region per recompute span (matplotlib draws axvspan as a patch)
    assert len(bottom.patches) == len(picture.recompute) >= 4
    assert open(step.plot(str(tmp_path / "m.png")), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_time_axis_includes_the_wait_of_a_device_path_update_for_its_prefetch():
    # PCIe slow enough that the device-path update waits for its state long after its gradients
    step = _checkpointed(Offload(device_updates=2, calibration=SLOW_PCIE))
    schedule = step.train_graph.schedule
    final = step.last.stages["final"]
    times = timeline.node_times(final, step.last.stages["fuse_optimizer"], schedule)
    (update,) = [e for e in schedule.events if e.track == "compute" and e.bucket is not None]
    nodes = [n for n in final.graph.nodes if n.op != "output"]
    (wait,) = [i for i, n in enumerate(nodes) if n.target is torch.ops.graphoffload.wait_device.default
               and n.meta.get("bucket") == schedule.assignment.index("device")]
    after = next(n.name for n in nodes[wait + 1:] if n.name in times and n.meta.get("phase") != "optimizer"
                 and n.meta.get("pass") != "offload_optimizer")
    waited = update.start - times[nodes[wait - 1].name]
    assert waited > 10 * (update.end - update.start)      # the update mostly waits for its prefetch
    assert times[nodes[wait].name] == update.start and times[after] >= update.end
    assert [times[n.name] for n in nodes] == sorted(times[n.name] for n in nodes)
    picture = timeline.step_picture(step.last.stages, schedule)
    assert picture.curves[0].peak == step.memory().peak
    assert picture.curves[-1].label.startswith("without offload")
    assert picture.curves[-1].peak == step.memory("fuse_optimizer").peak > step.memory().peak


# ---- graphs are the same in every process: no node order follows Python's string hash seed
# (the on-disk plan cache keys on the graph's text, and users diff printed graphs)

_PRINT_GRAPHS = """
import sys, torch
sys.path[:0] = sys.argv[1:3]
import graphoffload
from helpers import tiny_gpt, token_batches
from steps import train_step
model = tiny_gpt()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
step = graphoffload.offload_compile(train_step, accumulation_steps=2,
                                    offload=graphoffload.Offload(accumulate_on="host"))
for call, batch in enumerate(token_batches(2)):   # the accumulating variant, then the updating one
    step(model, opt, batch)
    for stage, gm in step.graphs.items():
        for node in gm.graph.nodes:
            print(call, stage, node.format_node())
"""


def _printed_graphs(hash_seed: str, tmp_path) -> subprocess.Popen:
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.Popen([sys.executable, "-c", _PRINT_GRAPHS, here, os.path.join(ROOT, "examples")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def test_graphs_are_identical_across_processes_with_different_hash_seeds(tmp_path):
    procs = [_printed_graphs(seed, tmp_path) for seed in ("1", "2")]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    first, second = (out.splitlines() for out, _ in outs)
    stages = {tuple(line.split(" ", 2)[:2]) for line in first}
    assert {call for call, _ in stages} == {"0", "1"} and len(stages) > 4    # both variants, every stage
    assert sum("aten.zero_" in line for line in first) > 0                    # the nodes whose order moved
    diff = [(a, b) for a, b in zip(first, second) if a != b]
    assert len(first) == len(second) and not diff, diff[:5]


def test_updating_call_zeroes_host_accumulated_sums_in_parameter_order():
    """In process: the `zero_` nodes that clear the running sums after the update follow the
    parameters' order, not a set's (which, over strings, changes with the hash seed)."""
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = graphoffload.offload_compile(train_step, accumulation_steps=2,
                                        offload=Offload(accumulate_on="host"))
    run_steps(step, model, opt, token_batches(2))
    zeroed = [n.args[0].name for n in step.graphs["captured"].graph.nodes if n.target is torch.ops.aten.zero_.default]
    expected = ["g_" + name.replace(".", "_") for name, _ in model.named_parameters()]
    assert zeroed == expected
