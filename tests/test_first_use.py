"""What a new user trips over first: plot() on a CPU-only step, explain() naming the real cause
of an update that waits past backward, verification of a custom pass's update operands, errors
while the graph runs naming the user's line, and draw() without graphviz."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_gpt, token_batches, train_step
from steps import clipped_step
from test_grad_scaler import scaled_step
from test_offload_planner import BALANCED

import graphoffload
from graphoffload import CompileConfig, Offload, timeline
from graphoffload.memory import analyze_memory
from graphoffload.passes.verify import update_operand_problem

PNG = b"\x89PNG\r\n\x1a\n"


def _ran(step_fn=train_step, steps: int = 1, **compile_kwargs):
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(step_fn, **compile_kwargs)
    for b in token_batches(steps):
        step(model, opt, b)
    return step


def test_plot_without_a_planned_schedule_draws_the_measured_run(tmp_path):
    step = _ran(offload=Offload(device_updates="never"))
    assert step.train_graph.schedule is None
    assert open(step.plot(str(tmp_path / "s.png")), "rb").read(8) == PNG
    measured = step.last.executor.offload_runtime.measured_spans()
    live = analyze_memory(step.train_graph).live
    fig = timeline.schedule_figure(None, measured, timeline.step_picture(step.last.stages, None))
    top, bottom = fig.axes
    # one bar per measured span, on its track: the CPU update, the copies and the step itself
    bars = top.patches
    assert len(bars) == len(measured)
    rows = {round(b.get_y() + b.get_height() / 2) for b in bars}
    assert {timeline.TRACKS.index(t) for t in ("compute", "d2h", "cpu", "h2d")} <= rows
    # the memory panel is the liveness analysis of the final graph, node by node
    curve = bottom.lines[0]
    assert list(curve.get_ydata()) == pytest.approx([b / 2**20 for b in live])


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_plot_memory_spans_the_tracks_time_axis_and_the_legend_covers_no_bar(tmp_path):
    step = _ran(offload=Offload(device_updates="auto", calibration=BALANCED))
    schedule = step.train_graph.schedule
    fig = timeline.schedule_figure(schedule, picture=timeline.step_picture(step.last.stages, schedule))
    top, bottom = fig.axes
    last_event_ms = max(e.end for e in schedule.events) * 1e3
    assert max(bottom.lines[0].get_xdata()) == pytest.approx(last_event_ms)
    assert top.get_xlim()[1] == pytest.approx(last_event_ms)
    renderer = fig.canvas.get_renderer()
    legend = top.get_legend().get_window_extent(renderer)
    for bar in top.patches:
        assert not _boxes_overlap(legend, bar.get_window_extent(renderer))
    assert open(step.plot(str(tmp_path / "s.png")), "rb").read(8) == PNG


def _wait_notes(step) -> list[str]:
    return [line for line in step.train_graph.notes["offload_optimizer"] if "wait past backward" in line]


def test_explain_names_the_real_cause_of_updates_waiting_past_backward():
    # the tiny GPT ties its output layer to the token embedding, whose gradient backward
    # finishes last: the bucket holding it waits for the end of backward, nothing else
    plain = _wait_notes(_ran(offload=Offload(device_updates="never")))
    assert plain and all("tok.weight" in line and "end of backward" in line for line in plain)
    assert not any("clip" in line or "GradScaler" in line for line in plain)

    unfused = _wait_notes(_ran(offload=Offload(device_updates="never"),
                               config=CompileConfig(disable_passes=("fuse_optimizer",))))
    assert unfused and all("fuse_optimizer is disabled" in line for line in unfused)

    clipped = _wait_notes(_ran(clipped_step, offload=Offload(device_updates="never")))
    assert clipped and all("clip_grad_norm_" in line for line in clipped)
    assert any("steps.py" in line and "clip_grad_norm_(model.parameters()" in line for line in clipped)

    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    step = graphoffload.offload_compile(scaled_step, offload=Offload(device_updates="never"))
    step(model, opt, scaler, token_batches(1)[0])
    scaled = _wait_notes(step)
    assert scaled and all("GradScaler" in line and "clip" not in line for line in scaled)


def _zero_dim_first_gradient(graph, ctx):
    """A broken custom pass: feeds a 0-d tensor as the first gradient of the fused update."""
    aten = torch.ops.aten
    for update in [n for n in graph.graph.nodes
                   if getattr(n.target, "overloadpacket", None) in (aten._fused_adamw_, aten._fused_adam_)]:
        grads = list(update.args[1])
        with graph.graph.inserting_before(update):
            grads[0] = graph.graph.call_function(aten.sum.default, (grads[0],))
        update.update_arg(1, grads)
        return graph
    return graph


def _drop_a_moment(graph, ctx):
    """A broken custom pass: one exp_avg too few in the fused update."""
    aten = torch.ops.aten
    for update in [n for n in graph.graph.nodes if getattr(n.target, "overloadpacket", None) is aten._fused_adamw_]:
        if len(update.args[0]) > 1:
            update.update_arg(2, list(update.args[2])[:-1])
            return graph
    return graph


@pytest.mark.parametrize("broken_pass, says", [(_zero_dim_first_gradient, "gradient 0"),
                                               (_drop_a_moment, "states for")])
def test_verify_rejects_update_operands_that_do_not_match_their_parameters(broken_pass, says):
    model = tiny_gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(train_step, passes=[broken_pass])
    with pytest.raises(graphoffload.PassError) as info:
        step(model, opt, token_batches(1)[0])
    message = str(info.value)
    assert f"after pass {broken_pass.__name__!r}" in message and says in message, message
    # rejected at compile time: nothing ran, nothing was written
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_verify_accepts_the_update_operands_every_builtin_path_emits():
    # the CPU path's host updates take narrower gradients and host step counters: still valid
    for offload in (None, Offload(device_updates="never"), Offload(device_updates=2, calibration=BALANCED)):
        graph = _ran(offload=offload, config=CompileConfig(verify=True)).train_graph
        updates = [n for n in graph.graph.nodes if n.op == "call_function" and "adam" in str(n.target)]
        assert updates and all(update_operand_problem(n) is None for n in updates)


def test_an_error_while_the_graph_runs_names_the_users_source_line():
    model = tiny_gpt()   # a position table of 16 rows
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(train_step)
    # make_fx traces on fake tensors, which do not check indices: the replay finds it
    with pytest.raises(graphoffload.StepRunError) as info:
        step(model, opt, token_batches(1, seq=20)[0])
    message = str(info.value)
    assert "IndexError" in message and "gpt.py:" in message and "self.pos(pos)" in message, message
    assert "16 rows" in message
    assert isinstance(info.value.__cause__, IndexError)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # the step still works on a good batch afterwards
    assert torch.isfinite(step(model, opt, token_batches(1)[0]))


def test_draw_says_when_graphviz_is_missing(tmp_path, monkeypatch):
    step = _ran()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))   # no `dot` anywhere
    with pytest.warns(UserWarning, match="wrote only the DOT file"):
        written = step.draw("final", str(tmp_path / "g.dot"))
    assert written.endswith(".dot") and open(written).read().startswith('digraph "final"')


def _nonzero_step(model, optimizer, batch):
    logits = model(batch["input_ids"]).flatten(0, 1)
    keep = torch.nonzero(batch["labels"].flatten() % 2 == 0).squeeze(1)   # a value-dependent shape
    loss = torch.nn.functional.cross_entropy(logits[keep], batch["labels"].flatten()[keep])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_torch_nonzero_in_the_step_trains_like_eager():
    eager = tiny_gpt()
    compiled = tiny_gpt()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(_nonzero_step)
    batches = token_batches(3)
    counts = {int((b["labels"] % 2 == 0).sum()) for b in batches}
    assert len(counts) > 1   # the selected rows differ between batches
    for b in batches:
        assert torch.equal(_nonzero_step(eager, opt_e, b), step(compiled, opt_c, b))
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), name
