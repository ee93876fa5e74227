"""`Offload(activations="auto")` plans kept on disk: a restarted job (a fresh step object, the same
model) re-applies the stored activation plan and the bucket plan made on it instead of searching,
and gets the same final graph, node by node, and the same training; another budget, calibration
or model is another key and is planned; an unreadable file, or one whose decisions no longer give
the stored prediction, is ignored and planned again."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import textwrap

import pytest
import torch
from helpers import assert_training_matches, run_steps, tiny_gpt
from steps import token_batches, train_step
from test_activation_plan import FAST_COMPUTE, _batches, _model
from test_checkpointing import adamw, mlp_step

import graphoffload
from graphoffload import Offload
from graphoffload.memory import analyze_memory
from graphoffload.errors import PassError
from graphoffload.passes import host_accumulation


def _no_search(monkeypatch):
    """Make any activation search fail loudly: a reused plan must not run one."""
    from graphoffload.passes import offload_optimizer as offload_pass

    def refuse(*args, **kwargs):
        raise AssertionError("planned the activations again although the plan was cached")
    monkeypatch.setattr(offload_pass, "plan_activations", refuse)


def _compile(model, batch, step_fn=mlp_step, **offload):
    step = graphoffload.offload_compile(step_fn, offload=Offload(**{"activations": "auto", **offload}))
    model = copy.deepcopy(model)
    step.compile(model, adamw(model), batch)
    return step


def _nodes(step) -> list[tuple]:
    """The final graph node by node: what it runs, on what, and what it makes."""
    def val(v):
        return (tuple(v.shape), v.dtype, v.stride(), str(v.device)) if isinstance(v, torch.Tensor) else type(v)
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), val(n.meta.get("val")), n.meta.get("phase"),
             n.meta.get("recompute"), n.meta.get("stream")) for n in step.train_graph.graph.nodes]


def _reused(step) -> list:
    return step.train_graph.notes_of("offload_optimizer", "activations_reused")


def _entries(tmp_path) -> list:
    return sorted((tmp_path / "graphoffload" / "plans").glob("activations-*.json"))


def _train(step, model, batches, step_fn):
    model = copy.deepcopy(model)
    opt = adamw(model)
    torch.manual_seed(5)
    return model, opt, run_steps(step or step_fn, model, opt, batches)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def _mlp_budget() -> int:
    """0.7x the MLP's keep-everything peak: under FAST_COMPUTE its plan recomputes some saved
    activations and offloads others."""
    plain = _compile(_model(), _batches(1)[0], calibration=FAST_COMPUTE, device_updates="never", activations="keep")
    return int(0.7 * plain.train_graph.notes_of("offload_optimizer", "offloaded")[0].fields["device_peak_bytes"])


def test_a_restarted_job_reuses_the_activation_plan(cache, monkeypatch):
    """The MLP with dropout at 0.7x its keep-everything peak: the second compile re-applies the
    stored recomputes and offloads (no search), its graph is the first's node by node, and both
    train bit-identical to eager, dropout's replayed masks included."""
    model, batches = _model(), _batches()
    options = dict(calibration=FAST_COMPUTE, device_updates="never", gpu_memory_budget=_mlp_budget())
    first = _compile(model, batches[0], **options)
    assert not _reused(first) and len(_entries(cache)) == 1
    choices = first.train_graph.notes_of("offload_optimizer", "activations")[0].fields
    assert choices["recompute"] and choices["offload"]   # both kinds of edit are re-applied
    with monkeypatch.context() as m:
        _no_search(m)
        second = _compile(model, batches[0], **options)
    (note,) = _reused(second)
    assert note.fields["path"] == str(_entries(cache)[0])
    assert _nodes(second) == _nodes(first)
    assert second.train_graph.schedule is None and note.fields["peak_bytes"] == second.memory().peak
    assert second.train_graph.signature == first.train_graph.signature
    eager = _train(None, model, batches, mlp_step)
    for step in (first, second):
        assert_training_matches(*eager, *_train(step, model, batches, mlp_step), exact=True, offloaded=True)


def _moved_down(things: list, lines: int, filename: str) -> list:
    """`things` (functions, classes) defined again from their code, `lines` lines further down a
    file of another name, in one scope (a moved class finds the others moved): a user's script
    edited above them, which changes their nodes' stack traces and nothing else."""
    scope = dict(things[0].__globals__ if inspect.isfunction(things[0]) else vars(inspect.getmodule(things[0])))
    source = "\n" * lines + "\n".join(textwrap.dedent(inspect.getsource(t)) for t in things)
    exec(compile(source, filename, "exec"), scope)
    return [scope[t.__name__] for t in things]


def test_a_job_restarted_from_an_edited_script_reuses_the_plan(cache, monkeypatch):
    """The key leaves stack traces out: the same model and step from moved lines (other file
    names, further down) find the first compile's plan, and the nodes the plan re-makes (replays,
    copies) take the new graph's traces, the lines an error would name, not the stored ones."""
    from test_checkpointing import Block, Mlp

    model, batch = _model(), _batches(1)[0]
    options = dict(calibration=FAST_COMPUTE, device_updates="never", gpu_memory_budget=_mlp_budget())
    first = _compile(model, batch, **options)
    _, moved_mlp = _moved_down([Block, Mlp], 25, "user_model.py")
    (moved_step,) = _moved_down([mlp_step], 40, "user_train.py")
    torch.manual_seed(0)
    moved = moved_mlp(width=32, depth=3, dropout=0.2, checkpointed=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), moved.parameters()))
    with monkeypatch.context() as m:
        _no_search(m)
        second = _compile(moved, batch, moved_step, **options)
    assert _reused(second) and len(_entries(cache)) == 1
    assert _nodes(second) == _nodes(first)

    def traces(step) -> dict[str, str]:
        return {n.name: n.meta["stack_trace"] for n in step.train_graph.graph.nodes if n.meta.get("stack_trace")}
    old, new = traces(first), traces(second)
    made = [n.name for n in second.train_graph.graph.nodes if n.meta.get("recompute") or n.meta.get("activation")]
    assert set(made) & set(new)   # some re-made nodes carry traces
    assert any("test_checkpointing.py" in t for t in old.values())
    # no trace of the second graph names the first's file: the re-made nodes' are the new graph's
    assert not [name for name, t in new.items() if "test_checkpointing.py" in t]
    for n in second.train_graph.graph.nodes:
        if n.meta.get("recompute_of") in new:
            assert n.meta.get("stack_trace") == new[n.meta["recompute_of"]]


def test_a_second_zero_stage_3_step_in_the_same_process_reuses_the_plan(cache, monkeypatch, one_process_group):
    """Each ZeRO step makes its own process group, whose name its collectives carry; the key writes
    a group as the order the graph first names it, so a second step of the same model (a new
    group) finds the first one's plan instead of searching again, and its graph is the first's
    node by node, the group's name aside."""
    model, batch = _model(), _batches(1)[0]

    def compile_zero3():
        step = graphoffload.offload_compile(mlp_step, data_parallel=graphoffload.ZeRO(stage=3), offload=Offload(
            activations="auto", calibration=FAST_COMPUTE, device_updates="never", gpu_memory_budget=1_300_000))
        mine = copy.deepcopy(model)
        step.compile(mine, adamw(mine), batch)
        return step
    first = compile_zero3()
    assert not _reused(first) and len(_entries(cache)) == 1
    assert first.train_graph.notes_of("zero", "params")[0].fields["sharded"]
    with monkeypatch.context() as m:
        _no_search(m)
        second = compile_zero3()
    assert _reused(second) and len(_entries(cache)) == 1
    def group_of(step):
        (name,) = {n.args[-1] for n in step.train_graph.graph.nodes
                   if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default}
        return name
    assert group_of(first) != group_of(second)   # the two steps' own groups: the key must not see their names
    assert [tuple(str(x).replace(group_of(second), "G") for x in t) for t in _nodes(second)] == \
        [tuple(str(x).replace(group_of(first), "G") for x in t) for t in _nodes(first)]


def test_the_bucket_plan_made_on_the_activations_is_reused_too(cache, monkeypatch):
    """The tiny GPT under the bucket planner (a calibration given): what is stored is the kept
    run's bucket paths and prefetch points with its activation edits, and the reused compile
    predicts the same step and peak and trains as the first did."""
    model, batches = tiny_gpt(dropout=0.1, seq_len=32), token_batches(2, seq=32, batch=4)
    plain = _compile(model, batches[0], train_step, calibration=FAST_COMPUTE, activations="keep")
    budget = int(0.6 * plain.memory().peak)
    first = _compile(model, batches[0], train_step, calibration=FAST_COMPUTE, gpu_memory_budget=budget)
    (entry,) = _entries(cache)
    stored = json.loads(entry.read_text())["decisions"]
    replanned = first.train_graph.notes_of("offload_optimizer", "state_replanned")
    assert replanned and stored["assignment"] is not None   # a re-planned run, not the first, was kept
    with monkeypatch.context() as m:
        _no_search(m)
        second = _compile(model, batches[0], train_step, calibration=FAST_COMPUTE, gpu_memory_budget=budget)
    assert _reused(second) and _nodes(second) == _nodes(first)
    a, b = first.train_graph.schedule, second.train_graph.schedule
    assert b.step_seconds == a.step_seconds == stored["step_seconds"] and b.assignment == a.assignment
    assert second.memory().peak == first.memory().peak <= budget
    runs = [_train(s, model, batches, train_step) for s in (first, second)]
    assert_training_matches(*runs[0], *runs[1], exact=True, offloaded=True)


def test_another_budget_calibration_or_model_is_planned(cache, monkeypatch):
    model, batch = _model(), _batches(1)[0]
    budget = _mlp_budget()
    options = dict(calibration=FAST_COMPUTE, device_updates="never", gpu_memory_budget=budget)
    _compile(model, batch, **options)
    _no_search(monkeypatch)
    _compile(model, batch, **options)   # the same: reused
    for changed, other in ((dict(options, gpu_memory_budget=budget - 4096), model),
                           (dict(options, calibration=dataclasses.replace(FAST_COMPUTE, device_flops=1e12)), model),
                           (options, _wider())):
        with pytest.raises(PassError, match="planned the activations again"):
            _compile(other, batch, **changed)


def _wider():
    from test_checkpointing import Mlp

    torch.manual_seed(0)
    return Mlp(width=32, depth=4, dropout=0.2, checkpointed=False)


def test_an_unreadable_or_stale_entry_is_planned_again(cache, caplog):
    model, batch = _model(), _batches(1)[0]
    options = dict(calibration=FAST_COMPUTE, device_updates="never", gpu_memory_budget=_mlp_budget())
    first = _compile(model, batch, **options)
    (entry,) = _entries(cache)
    good = entry.read_text()
    entry.write_text(good[: len(good) // 2])   # a torn write from another tool
    again = _compile(model, batch, **options)
    assert not _reused(again) and _nodes(again) == _nodes(first) and "unreadable" in caplog.text
    assert entry.read_text() == good   # planned and stored again
    data = json.loads(good)
    data["decisions"]["peak_bytes"] += 1   # decisions that no longer give the stored prediction
    entry.write_text(json.dumps(data))
    caplog.clear()
    again = _compile(model, batch, **options)
    assert not _reused(again) and _nodes(again) == _nodes(first)
    assert "not reusing the cached activation plan" in caplog.text and "predicts a peak" in caplog.text
    data = json.loads(good)
    data["decisions"]["edits"]["order"].insert(1, "a_node_this_graph_lacks")   # edits that do not fit
    entry.write_text(json.dumps(data))
    caplog.clear()
    again = _compile(model, batch, **options)
    assert not _reused(again) and _nodes(again) == _nodes(first) and "does not fit" in caplog.text
    assert _reused(_compile(model, batch, **options))   # stored afresh each time
    _compile(model, batch, **dict(options, plan_cache=False))   # plan_cache=False neither reads nor writes
    assert len(_entries(cache)) == 1


def _variant_nodes(step) -> dict[bool, list[tuple]]:
    """Each compiled variant's final graph node by node, by whether it updates."""
    return {key[0]: _nodes(type("V", (), {"train_graph": v.graph})) for key, v in step._variants.items()}


def _variant_reused(step) -> dict[bool, list]:
    return {key[0]: v.graph.notes_of("offload_optimizer", "activations_reused") for key, v in step._variants.items()}


@pytest.mark.parametrize("accumulate_on", ["device", "auto"])
def test_a_restarted_accumulating_step_reuses_both_variants_plans(cache, monkeypatch, caplog, accumulate_on):
    """accumulation_steps=2 on the tiny GPT under 0.7x the accumulating call's keep-everything
    peak: the first step plans and stores both variants' plans (the accumulating call's
    activations, the updating call's activations and buckets); a fresh step over the same model
    re-applies both (no search), each final graph the first's node by node, and trains
    bit-identical to the first. With accumulate_on="auto" the placement's probe of the other
    variant (compiled before the placement is decided) neither reads nor stores a plan."""
    model, batches = tiny_gpt(dropout=0.1, seq_len=32), token_batches(4, seq=32, batch=4)

    def make(**offload):
        return graphoffload.offload_compile(train_step, accumulation_steps=2, offload=Offload(
            calibration=FAST_COMPUTE, device_updates="never", **offload))

    def keep_peak(where):
        keep = make(activations="keep", accumulate_on=where)
        _train(keep, model, batches, train_step)
        return max(analyze_memory(v.graph).peak for v in keep._variants.values())
    if accumulate_on == "device":   # the activations recomputed or offloaded
        budget = int(0.7 * keep_peak("device"))
    else:   # the sums moved to the host (the placement keeps the activations: what it must fit)
        budget = (keep_peak("device") + keep_peak("host")) // 2
    options = dict(activations="auto", gpu_memory_budget=budget, accumulate_on=accumulate_on)
    first = make(**options)
    predicted, real = [], host_accumulation.predicted_peaks   # each variant's peaks predicted once (not again for the key)
    with monkeypatch.context() as m:
        m.setattr(host_accumulation, "predicted_peaks", lambda graph, ctx, placement, update, trial: (
            predicted.append(update), real(graph, ctx, placement, update, trial))[1])
        runs = [_train(first, model, batches, train_step)]
    assert sorted(predicted) == ([False, True] if accumulate_on == "auto" else [])
    assert set(_variant_reused(first)) == {False, True} and not any(_variant_reused(first).values())
    assert len(_entries(cache)) == 2   # one plan per variant, none from a probe
    if accumulate_on == "auto":
        (placed,) = first.train_graph.notes_of("offload_optimizer", "grad_sum_placement")
        assert placed.fields["moved"] == placed.fields["movable"] > 0
    with monkeypatch.context() as m:
        _no_search(m)
        second = make(**options)
        runs.append(_train(second, model, batches, train_step))
    # keyed without the placement, the restarted probe re-applied the updating call's plan to its
    # graph, stopped before the sums' rewrite, and warned that the peak came out otherwise
    assert "not reusing the cached activation plan" not in caplog.text
    reused = _variant_reused(second)
    assert set(reused) == {False, True} and all(len(notes) == 1 for notes in reused.values())
    assert {str(n[0].fields["path"]) for n in reused.values()} == {str(e) for e in _entries(cache)}
    assert _variant_nodes(second) == _variant_nodes(first)
    assert_training_matches(*runs[0], *runs[1], exact=True, offloaded=True)

