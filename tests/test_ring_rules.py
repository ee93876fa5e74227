"""ring_attention's rule table on tiny hand-built graphs: token ids (a batch input) go through a
sharded embedding into one attention call, then the few ops a rule is about. The pass runs as
rank 0 of 2 without a process group (it only emits collectives; nothing here runs them), and
each test checks what the rule did to the graph: sizes rewritten, inputs sharded, partial sums
all-reduced, ops refused with their name."""

from __future__ import annotations

import operator
from collections.abc import Callable

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphoffload import CompileConfig, SequenceParallel
from graphoffload.errors import UnsupportedError
from graphoffload.graph import GraphSignature, InputSpec, OutputSpec, TrainGraph
from graphoffload.ops.attention import ATTENTION
from graphoffload.passes import PassContext
from graphoffload.passes.ring_attention import ring_attention
from graphoffload.passes.ring_attention_rules import FALLBACK, RULES, rule_for

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
SEQ, WIDTH, WORLD = 8, 4, 2


class _RankOfTwo(SequenceParallel):
    """Rank 0 of 2 without torch.distributed: the pass reads only these from the group."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return WORLD

    @property
    def group_name(self) -> str:
        return "test"


def _graph(build: Callable[[fx.Graph, fx.Node, dict[str, fx.Node]], fx.Node],
           extra: dict[str, tuple[int, ...]] | None = None) -> TrainGraph:
    """ids (1, SEQ) -> embedding (1, SEQ, WIDTH) -> attention over it; `build(graph, attended,
    extras)` adds the ops under test on the attention's output (1, SEQ, WIDTH) and returns the
    output node. `extra` names parameter placeholders (float, these shapes)."""
    graph = fx.Graph()
    mode = FakeTensorMode()
    ids = graph.placeholder("ids")
    table = graph.placeholder("table")
    extras = {name: graph.placeholder(name) for name in extra or {}}
    with mode:
        ids.meta["val"] = mode.from_tensor(torch.zeros(1, SEQ, dtype=torch.long))
        table.meta["val"] = mode.from_tensor(torch.zeros(16, WIDTH))
        for name, shape in (extra or {}).items():
            extras[name].meta["val"] = mode.from_tensor(torch.zeros(shape))
    emb = graph.call_function(aten.embedding.default, (table, ids))
    heads = graph.call_function(aten.view.default, (emb, [1, 1, SEQ, WIDTH]))
    attention = graph.call_function(ATTENTION, (heads, heads, heads, None, True, None))
    attended = graph.call_function(operator.getitem, (attention, 0))
    out = graph.call_function(aten.view.default, (attended, [1, SEQ, WIDTH]))
    graph.output((build(graph, out, extras),))
    for node in graph.nodes:
        node.meta.update(phase="input" if node.op == "placeholder" else "forward", **{"pass": "capture"})
        if node.op == "call_function":
            with mode:
                node.meta["val"] = node.target(*fx.map_arg(node.args, lambda n: n.meta["val"]))
    inputs = (InputSpec("batch", "ids", 0), InputSpec("param", "table", "table"),
              *(InputSpec("param", name, name) for name in extras))
    return TrainGraph(fx.GraphModule(torch.nn.Module(), graph), GraphSignature(inputs, (OutputSpec("user", 0),)))


def _split(graph: TrainGraph) -> TrainGraph:
    ctx = PassContext(CompileConfig(sequence_parallel=_RankOfTwo(layout="contiguous")), torch.device("cpu"))
    return ring_attention(graph, ctx)


def _result(graph: TrainGraph) -> fx.Node:
    return graph.graph.output_node().args[0][0]


def test_every_rule_is_keyed_by_an_op_overload_and_an_op_without_one_takes_the_fallback():
    assert all(isinstance(op, torch._ops.OpOverload) for op in RULES)
    assert rule_for(aten.atan2.default) is FALLBACK and rule_for(aten.amax.default) is FALLBACK
    assert rule_for(aten.cumsum.default) is not FALLBACK and rule_for(aten.view.default) is not FALLBACK


def test_a_view_after_the_sharded_embedding_gets_the_local_length():
    made = {}

    def build(graph, x, extras):
        made["flat"] = graph.call_function(aten.view.default, (x, [SEQ, WIDTH]))   # (batch 1 x seq, width)
        made["rows"] = graph.call_function(aten.view.default, (made["flat"], [SEQ * WIDTH]))
        return made["rows"]

    final = _split(_graph(build))
    assert made["flat"].args[1] == [SEQ // WORLD, WIDTH]
    assert made["rows"].args[1] == [SEQ // WORLD * WIDTH]
    assert made["rows"].meta["val"].shape == (SEQ // WORLD * WIDTH,)
    # the embedding reads this rank's token ids: the first half of the sequence (contiguous layout)
    emb = next(n for n in final.graph.nodes if n.target is aten.embedding.default)
    ids_part = emb.args[1]
    assert ids_part.target is aten.slice.Tensor and ids_part.args[1:] == (1, 0, SEQ // WORLD)
    (attention,) = final.notes_of("ring_attention", "attention")
    assert attention.fields == {"forward": 1, "backward": 0}


def test_a_view_that_cuts_the_sequence_in_two_is_refused():
    def build(graph, x, extras):
        return graph.call_function(aten.view.default, (x, [2, SEQ // 2, WIDTH]))

    with pytest.raises(UnsupportedError, match="splitting the sequence dimension"):
        _split(_graph(build))


def test_a_cumsum_along_the_sequence_is_refused_naming_the_op_and_one_along_the_features_is_not():
    def along(dim):
        return lambda graph, x, extras: graph.call_function(aten.cumsum.default, (x, dim))

    with pytest.raises(UnsupportedError, match=r"aten\.cumsum\.default.*combines positions along the split"):
        _split(_graph(along(1)))
    final = _split(_graph(along(2)))
    assert _result(final).target is aten.cumsum.default
    assert _result(final).meta["val"].shape == (1, SEQ // WORLD, WIDTH)


def test_an_elementwise_op_without_a_rule_shards_a_full_operand_that_broadcasts_along_the_sequence():
    made = {}

    def build(graph, x, extras):
        made["out"] = graph.call_function(aten.atan2.default, (x, extras["positions"]))
        return made["out"]

    final = _split(_graph(build, {"positions": (SEQ, WIDTH)}))
    positions = next(n for n in final.graph.nodes if n.name == "positions")
    part = made["out"].args[1]
    assert part.target is aten.slice.Tensor and part.args[:4] == (positions, 0, 0, SEQ // WORLD)
    assert made["out"].meta["val"].shape == (1, SEQ // WORLD, WIDTH)
    assert _result(final) is made["out"]   # a shard stays a shard at the output: no collective


def test_an_op_without_a_rule_that_reduces_over_the_sequence_is_refused():
    def build(graph, x, extras):
        return graph.call_function(aten.amax.default, (x, [1]))

    with pytest.raises(UnsupportedError, match=r"aten\.amax\.default.*reduces over the split sequence"):
        _split(_graph(build))


def test_a_sum_over_the_sequence_is_all_reduced_and_a_mean_is_divided_by_the_ranks():
    def reduce(op):
        return lambda graph, x, extras: graph.call_function(op, (x, [1]))

    summed = _result(_split(_graph(reduce(aten.sum.dim_IntList))))
    assert summed.target is c10d.wait_tensor.default          # all-reduced where the output reads it
    assert summed.args[0].target is c10d.all_reduce.default and summed.args[0].args[0].target is aten.sum.dim_IntList
    meaned = _result(_split(_graph(reduce(aten.mean.dim))))
    assert meaned.target is aten.div.Scalar and meaned.args[1] == WORLD
    assert meaned.args[0].target is c10d.wait_tensor.default
    assert meaned.meta["val"].shape == (1, WIDTH)


def test_a_linear_op_keeps_a_partial_sum_partial_and_a_nonlinear_one_reduces_it_first():
    def then(op):
        def build(graph, x, extras):
            total = graph.call_function(aten.sum.dim_IntList, (x, [1]))
            return graph.call_function(op, (total,))
        return build

    neg = _result(_split(_graph(then(aten.neg.default))))   # linear: reduced once, after the neg
    assert neg.target is c10d.wait_tensor.default and neg.args[0].args[0].target is aten.neg.default
    exp = _result(_split(_graph(then(aten.exp.default))))   # not linear: its input is reduced
    assert exp.target is aten.exp.default and exp.args[0].target is c10d.wait_tensor.default
