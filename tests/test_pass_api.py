"""User passes: where they run, how their nodes are stamped, how broken or mis-declared
passes are reported, and the example pass (gradients rounded to bf16) against eager."""

from __future__ import annotations

import operator

import pytest
import torch
from custom_pass import cast_grads_to_bf16
from helpers import assert_training_matches, assert_unchanged, run_steps, snapshot, tiny_gpt, token_batches
from steps import train_step

import graphoffload
from graphoffload import CompileConfig, Pass, PassError

aten = torch.ops.aten


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)


def compile_and_run(passes=(), config=None, steps=1):
    model = tiny_gpt()
    opt = adamw(model)
    step = graphoffload.offload_compile(train_step, passes=passes, config=config)
    losses = run_steps(step, model, opt, token_batches(steps))
    return step, model, opt, losses


def scale_loss_output(graph, ctx):
    """Adds one node: the returned loss times one (changes nothing numerically)."""
    out = graph.graph.output_node()
    loss = out.args[0][0]
    with graph.graph.inserting_before(out):
        same = graph.graph.call_function(aten.mul.Tensor, (loss, 1.0))
    out.update_arg(0, (same, *out.args[0][1:]))
    return graph


def test_user_passes_run_after_builtins_in_order_and_stamp_their_nodes():
    seen_stages = []

    def first(graph, ctx):
        seen_stages.append("first")
        return graph

    def second(graph, ctx):
        seen_stages.append("second")
        return scale_loss_output(graph, ctx)

    step, *_ = compile_and_run(passes=[first, second])
    assert seen_stages == ["first", "second"]
    assert list(step.graphs) == ["captured", "fuse_optimizer", "eliminate_dead_code", "first", "second", "final"]
    added = [n for n in step.graphs["final"].graph.nodes if n.meta.get("pass") == "second"]
    assert len(added) == 1 and added[0].target is aten.mul.Tensor
    assert added[0].meta["val"].shape == ()            # inferred by the manager
    assert added[0].meta["phase"] == "forward"
    assert all(n.meta["pass"] != "first" for n in step.graphs["final"].graph.nodes)


def test_requires_naming_a_disabled_or_absent_pass_is_a_pass_error():
    def needs_dce(graph, ctx):
        return graph
    needs_dce.requires = ("eliminate_dead_code",)
    with pytest.raises(PassError, match="needs_dce.*eliminate_dead_code"):
        graphoffload.offload_compile(train_step, passes=[needs_dce],
                                     config=CompileConfig(disable_passes=("eliminate_dead_code",)))
    with pytest.raises(PassError, match="no_such_pass"):
        graphoffload.offload_compile(train_step, passes=[Pass(needs_dce, "needs", requires=("no_such_pass",))])
    compile_and_run(passes=[needs_dce])   # satisfied: runs


def erase_a_used_node(graph, ctx):
    node = next(n for n in graph.graph.nodes if n.op == "call_function" and n.users)
    graph.graph.erase_node(node)
    return graph


def move_a_node_before_its_input(graph, ctx):
    node = next(n for n in graph.graph.nodes if n.op == "call_function" and n.all_input_nodes
                and all(i.op == "call_function" for i in n.all_input_nodes))
    node.all_input_nodes[0].prepend(node)
    return graph


def returns_none(graph, ctx):
    graph.graph.erase_node  # noqa: B018 - forgot to return the graph


def drops_a_placeholder_from_the_signature(graph, ctx):
    return graph.with_signature(inputs=graph.signature.inputs[1:])


def writes_into_the_batch_through_a_view(graph, ctx):
    batch = next(n for n in graph.graph.nodes if n.op == "placeholder" and n.name.startswith("batch"))
    with graph.graph.inserting_after(batch):
        view = graph.graph.call_function(torch.ops.aten.view.default, (batch, [-1]))
    with graph.graph.inserting_after(view):
        graph.graph.call_function(torch.ops.aten.zero_.default, (view,))
    return graph


def returns_a_single_value_from_the_graph(graph, ctx):
    out = graph.graph.output_node()
    out.args = (out.args[0][0],)
    return graph


@pytest.mark.parametrize("bad_pass", [erase_a_used_node, move_a_node_before_its_input, returns_none,
                                      drops_a_placeholder_from_the_signature,
                                      writes_into_the_batch_through_a_view, returns_a_single_value_from_the_graph])
def test_a_pass_that_breaks_the_graph_is_a_pass_error_naming_it(bad_pass):
    model = tiny_gpt()
    opt = adamw(model)
    before = snapshot(model, opt)
    step = graphoffload.offload_compile(train_step, passes=[bad_pass])
    with pytest.raises(PassError, match=bad_pass.__name__):
        step(model, opt, token_batches(1)[0])
    # parameters untouched; the zeroed optimizer state capture created before the pass ran
    # is not rolled back (yet), so only the model is compared
    assert_unchanged(model, None, before)


def test_disabled_builtin_pass_is_skipped_and_unknown_names_are_errors():
    step, model, opt, losses = compile_and_run(config=CompileConfig(disable_passes=("eliminate_dead_code",)), steps=2)
    assert "eliminate_dead_code" not in step.graphs
    assert list(step.graphs) == ["captured", "fuse_optimizer", "final"]
    full, *_ = compile_and_run(steps=1)
    # dead-code elimination really removes nodes when it runs
    assert len(full.graphs["final"].graph.nodes) < len(step.graphs["final"].graph.nodes)
    with pytest.raises(PassError, match="no_such_pass"):
        graphoffload.offload_compile(train_step, config=CompileConfig(disable_passes=("no_such_pass",)))


def round_grads_then_step(model, optimizer, batch):
    """The eager reference of cast_grads_to_bf16: round .grad just before the update."""
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.copy_(p.grad.to(torch.bfloat16).float())
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-into-backward", "after-backward"])
def test_cast_grads_to_bf16_pass_matches_eager_training_on_rounded_grads(fuse):
    config = CompileConfig(disable_passes=() if fuse else ("fuse_optimizer",))
    step, compiled, opt_c, losses_c = compile_and_run(passes=[cast_grads_to_bf16], config=config, steps=5)
    eager = tiny_gpt()
    opt_e = adamw(eager)
    losses_e = run_steps(round_grads_then_step, eager, opt_e, token_batches(5))
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    # and the rounding matters: plain training ends elsewhere
    plain = tiny_gpt()
    run_steps(train_step, plain, adamw(plain), token_batches(5))
    assert not torch.equal(plain.head.weight, compiled.head.weight)
    n_params = len(list(compiled.parameters()))
    stamped = [n for n in step.graphs["final"].graph.nodes if n.meta.get("pass") == "cast_grads_to_bf16"]
    assert len(stamped) == 2 * n_params
    assert all(n.meta["param"] for n in stamped)


def test_dead_code_elimination_keeps_every_wait_of_a_coalesced_all_reduce():
    """A wait completes its collective: an unread one must stay, or the work stays pending."""
    from torch import fx

    from graphoffload.graph import GraphSignature, TrainGraph
    from graphoffload.passes.eliminate_dead_code import eliminate_dead_code

    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    reduced = g.call_function(c10d.all_reduce_coalesced.default, ([a, b], "sum", "0"))
    waits = [g.call_function(c10d.wait_tensor.default, (g.call_function(operator.getitem, (reduced, i)),))
             for i in range(2)]
    unused_view = g.call_function(aten.view.default, (a, [-1]))
    g.output((waits[0],))
    graph = eliminate_dead_code(TrainGraph(fx.GraphModule(torch.nn.Module(), g), GraphSignature((), ())), None)
    kept = list(graph.graph.nodes)
    assert all(w in kept for w in waits) and reduced in kept
    assert unused_view not in kept   # the pass does remove what is really dead


def test_a_schedule_error_names_the_missing_capability_and_the_passes_scheduled_so_far():
    from graphoffload.passes import BUILTIN_PASS_SPECS, PassManager

    parking = next(s for s in BUILTIN_PASS_SPECS if s.name == "park_gradients").as_pass()
    dce = next(s for s in BUILTIN_PASS_SPECS if s.name == "eliminate_dead_code").as_pass()
    assert "buckets" in parking.requires
    with pytest.raises(PassError) as info:
        PassManager(builtin=[dce, parking])
    message = str(info.value)
    assert "'buckets'" in message and "scheduled so far: ['eliminate_dead_code']" in message


def test_user_passes_declare_what_they_require_and_provide():
    from graphoffload.passes import PassManager

    def make(graph, ctx):
        return graph

    def use(graph, ctx):
        return graph

    make.provides = ("widgets",)
    use.requires = ("widgets",)
    assert [p.name for p in PassManager([make, use], builtin=[]).passes] == ["make", "use"]
    with pytest.raises(PassError, match=r"\['widgets'\], which no pass scheduled before it provides"):
        PassManager([use, make], builtin=[])
    with pytest.raises(PassError, match=r"requires \['gadgets'\], which no pass provides and no pass is named"):
        PassManager([Pass(use, "use", requires=("gadgets",))], builtin=[])


def test_the_registry_is_the_one_list_of_built_in_passes():
    from graphoffload.passes import BUILTIN_PASS_SPECS, BUILTIN_PASSES, builtin_schedule
    from graphoffload.sequence_parallel import SequenceParallel

    assert BUILTIN_PASSES == tuple(s.name for s in BUILTIN_PASS_SPECS)
    assert [p.name for p in builtin_schedule(CompileConfig())] == ["fuse_optimizer", "eliminate_dead_code"]
    everything = CompileConfig(sequence_parallel=SequenceParallel(), offload=graphoffload.Offload(),
                               fuse_optimizer=graphoffload.FuseOptimizer(park_gradients=True))
    assert [p.name for p in builtin_schedule(everything)] == [n for n in BUILTIN_PASSES if n != "zero"]
    # ZeRO combines with neither offload nor sequence parallelism yet
    assert [p.name for p in builtin_schedule(CompileConfig(data_parallel=graphoffload.ZeRO()))] == \
        ["zero", "fuse_optimizer", "eliminate_dead_code"]
    # every built-in requirement is provided by a built-in pass that comes before it
    provided: set[str] = set()
    for spec in BUILTIN_PASS_SPECS:
        assert set(spec.requires) <= provided, spec.name
        provided |= {spec.name, *spec.provides}


def test_a_user_pass_is_given_a_module_whose_code_is_its_graph_and_stages_keep_their_own():
    # the built-in passes leave code generation to the end; a user pass still runs the module
    seen = {}

    def run_module(graph, ctx):
        seen["code"] = graph.gm.code
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        seen["args"] = [n.target for n in placeholders]
        return graph

    step, model, opt, losses = compile_and_run(passes=[run_module])
    # the code takes the signature's placeholders (renamed at capture), not make_fx's arg0_1...
    assert seen["args"] == [s.name for s in step.last.stages["fuse_optimizer"].signature.inputs]
    assert all(f"{name}," in seen["code"] or f"{name})" in seen["code"] for name in seen["args"])
    assert "arg0_1" not in seen["code"]
    # each stage is the graph as it was after its pass, however later passes changed the nodes
    captured, fused = step.last.stages["captured"], step.last.stages["fuse_optimizer"]
    assert "bucket" not in {k for n in captured.graph.nodes for k in n.meta}
    assert any("bucket" in n.meta for n in fused.graph.nodes)
    assert captured.gm.code != fused.gm.code
    assert torch.isfinite(losses[0])


def test_compiling_pauses_the_cycle_collector_and_restores_it():
    import gc

    states = []

    def record(graph, ctx):
        states.append(gc.isenabled())
        return graph

    assert gc.isenabled()
    compile_and_run(passes=[record])
    assert states == [False] and gc.isenabled()
    gc.disable()
    try:
        compile_and_run(passes=[record])
        assert states == [False, False] and not gc.isenabled()   # a user's choice is kept
    finally:
        gc.enable()
