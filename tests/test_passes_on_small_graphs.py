"""Passes on small hand-built graphs: each test builds the few nodes a rule is about, runs the
pass (through the PassManager, so provenance and the contracts are exercised too) and checks
exactly what changed, beside the end-to-end equality tests that train real models."""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphoffload import CompileConfig
from graphoffload.graph import GraphSignature, InputSpec, OutputSpec, TrainGraph
from graphoffload.passes import Pass, PassContext, PassManager, eliminate_dead_code

aten = torch.ops.aten


def _graph(build) -> TrainGraph:
    """A graph with one batch input `x` (4 floats); `build(graph, x)` returns the output node."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode() as mode:
        x.meta["val"] = mode.from_tensor(torch.zeros(4))
    x.meta.update(phase="input", **{"pass": "capture"})
    out = build(graph, x)
    graph.output((out,))
    for node in graph.nodes:
        node.meta.setdefault("pass", "capture")
        node.meta.setdefault("phase", "forward")
        if node.op == "call_function":
            with mode:
                node.meta["val"] = node.target(*fx.map_arg(node.args, lambda n: n.meta["val"]))
    signature = GraphSignature((InputSpec("batch", "x", 0),), (OutputSpec("user", 0),))
    return TrainGraph(fx.GraphModule(torch.nn.Module(), graph), signature)


def _run(graph: TrainGraph, passes) -> TrainGraph:
    ctx = PassContext(CompileConfig(), torch.device("cpu"))
    final, _ = PassManager(passes, builtin=[]).run(graph, ctx)
    return final


def _targets(graph: TrainGraph) -> list:
    return [n.target for n in graph.graph.nodes if n.op == "call_function"]


def test_dead_code_elimination_drops_unused_pure_nodes_and_keeps_writes_and_draws():
    def build(graph, x):
        graph.call_function(aten.cos.default, (x,))                    # unused, pure: dropped
        graph.call_function(aten.rand_like.default, (x,))              # unused draw: kept (shifts later draws)
        scratch = graph.call_function(aten.empty_like.default, (x,))
        graph.call_function(aten.copy_.default, (scratch, x))         # unused write: kept
        return graph.call_function(aten.sin.default, (x,))

    final = _run(_graph(build), [Pass(eliminate_dead_code, "eliminate_dead_code")])
    assert _targets(final) == [aten.rand_like.default, aten.empty_like.default, aten.copy_.default,
                               aten.sin.default]
    (removed,) = final.notes_of("eliminate_dead_code", "removed")
    assert removed.fields["nodes"] == 1 and removed == "removed 1 unused nodes"


def test_a_node_a_pass_creates_is_stamped_with_that_pass_even_when_it_copies_meta():
    def double(graph: TrainGraph, ctx) -> TrainGraph:
        out = graph.graph.output_node().args[0][0]
        with graph.graph.inserting_after(out):
            twice = graph.graph.call_function(aten.mul.Tensor, (out, 2))
        twice.meta.update(out.meta)          # copies "pass": "capture" along with the rest
        del twice.meta["val"]                 # the manager infers it
        graph.graph.output_node().args = ((twice,),)
        return graph

    final = _run(_graph(lambda graph, x: graph.call_function(aten.sin.default, (x,))), [double])
    made = {n.target: n.meta["pass"] for n in final.graph.nodes if n.op == "call_function"}
    assert made == {aten.sin.default: "capture", aten.mul.Tensor: "double"}
    twice = next(n for n in final.graph.nodes if n.target is aten.mul.Tensor)
    assert twice.meta["val"].shape == (4,)


def test_greedy_buckets_close_when_the_next_item_would_not_fit():
    from graphoffload.bucketing import greedy_buckets

    sizes = [3, 4, 2, 9, 1, 1, 5]
    buckets = greedy_buckets(sizes, lambda n: n, 7)
    assert buckets == [[3, 4], [2], [9], [1, 1, 5]]   # 9 alone: larger than the limit
    assert [x for b in buckets for x in b] == sizes     # order kept, nothing lost
    assert greedy_buckets([], lambda n: n, 7) == []


def test_the_manager_refreshes_the_value_of_nodes_a_pass_edited_and_of_their_users():
    # x[4] -> view(2, 2) -> sin -> out; the pass makes the view (4, 1) and touches no meta:
    # the manager recomputes the view's value and the sin's after it, as Inductor's updater does
    def build(graph, x):
        return graph.call_function(aten.sin.default, (graph.call_function(aten.view.default, (x, [2, 2])),))

    def reshape_pass(graph, ctx):
        (view,) = [n for n in graph.graph.nodes if n.target is aten.view.default]
        view.args = (view.args[0], [4, 1])
        return graph

    graph = _graph(build)
    sin_val_before = next(n for n in graph.graph.nodes if n.target is aten.sin.default).meta["val"]
    final = _run(graph, [Pass(reshape_pass, "reshape")])
    vals = {n.target: n.meta["val"] for n in final.graph.nodes if n.op == "call_function"}
    assert tuple(vals[aten.view.default].shape) == (4, 1)
    assert tuple(vals[aten.sin.default].shape) == (4, 1)
    assert vals[aten.sin.default] is not sin_val_before


def test_an_edit_that_changes_no_value_keeps_the_value_objects():
    def build(graph, x):
        return graph.call_function(aten.cos.default, (graph.call_function(aten.sin.default, (x,)),))

    graph = _graph(build)
    kept = {n.name: n.meta.get("val") for n in graph.graph.nodes}

    def rename_only(graph, ctx):
        # an edit that changes no value: cos(sin(x)) -> cos(neg(x)); the new value equals the old
        (sin,) = [n for n in graph.graph.nodes if n.target is aten.sin.default]
        with graph.graph.inserting_after(sin):
            neg = graph.graph.call_function(aten.neg.default, (sin.args[0],))
        sin.replace_all_uses_with(neg)
        graph.graph.erase_node(sin)
        return graph

    final = _run(graph, [Pass(rename_only, "rename_only")])
    cos = next(n for n in final.graph.nodes if n.target is aten.cos.default)
    assert cos.meta["val"] is kept[cos.name]   # recomputed (its input changed), equal, so kept
    assert next(n for n in final.graph.nodes if n.target is aten.neg.default).meta["pass"] == "rename_only"


def test_a_pass_whose_edit_leaves_a_node_without_a_value_is_named_in_the_error():
    import pytest

    from graphoffload.errors import PassError

    def build(graph, x):
        return graph.call_function(aten.view.default, (x, [2, 2]))

    def bad_view(graph, ctx):
        (view,) = [n for n in graph.graph.nodes if n.target is aten.view.default]
        view.args = (view.args[0], [3, 3])   # 9 elements from 4: no value
        return graph

    with pytest.raises(PassError, match="pass 'bad_view' changed the inputs of node view"):
        _run(_graph(build), [Pass(bad_view, "bad_view")])


def test_every_fused_update_kernel_of_the_vocabulary_has_exactly_one_update_rule():
    # capture finds update nodes by FUSED_UPDATE_OPS; the passes move and rewrite them by their
    # rule: an op in one list and not the other would be captured but never fused, or the reverse
    from graphoffload.ops.fused_optimizer_meta import FUSED_UPDATE_OPS, is_fused_update
    from graphoffload.passes.update_kernels import UPDATE_KERNELS, kernel_rule

    assert set(UPDATE_KERNELS) == set(FUSED_UPDATE_OPS)
    graph = fx.Graph()
    p, g = graph.placeholder("p"), graph.placeholder("g")
    for packet in FUSED_UPDATE_OPS:
        for overload in packet.overloads():
            node = graph.call_function(getattr(packet, overload), ([p], [g]))
            assert is_fused_update(node) and kernel_rule(node) is UPDATE_KERNELS[packet]
    other = graph.call_function(aten._foreach_add_.Scalar, ([p], 1))
    assert not is_fused_update(other) and kernel_rule(other) is None


def _two_layer_sgd_graph() -> TrainGraph:
    """loss = sum(x * w1 * w2), its backward written out, and one `_fused_sgd_` over both
    parameters after backward, as capture lowers `optimizer.step()`."""
    from graphoffload.ops import register_fused_optimizer_meta_kernels

    register_fused_optimizer_meta_kernels()
    graph = fx.Graph()
    mode = FakeTensorMode()

    def placeholder(name):
        node = graph.placeholder(name)
        node.meta.update(val=mode.from_tensor(torch.zeros(4)), phase="input", **{"pass": "capture"})
        if name.startswith("w"):
            node.meta["param"] = (name,)
        return node

    def op(phase, target, *args, **kwargs):
        node = graph.call_function(target, args, kwargs)
        with mode:
            node.meta["val"] = target(*fx.map_arg(args, lambda n: n.meta["val"]),
                                      **fx.map_arg(kwargs, lambda n: n.meta["val"]))
        node.meta.update(phase=phase, **{"pass": "capture"})
        return node

    w1, w2, x = placeholder("w1"), placeholder("w2"), placeholder("x")
    h = op("forward", aten.mul.Tensor, x, w1)
    loss = op("forward", aten.sum.default, op("forward", aten.mul.Tensor, h, w2))
    ones = op("backward", aten.ones_like.default, h)
    grad_w2 = op("backward", aten.mul.Tensor, ones, h)
    grad_h = op("backward", aten.mul.Tensor, ones, w2)     # reads w2: its update must follow this
    grad_w1 = op("backward", aten.mul.Tensor, grad_h, x)
    for grad, name in ((grad_w1, "w1"), (grad_w2, "w2")):
        grad.meta["param"] = (name,)
    update = op("optimizer", aten._fused_sgd_.default, [w1, w2], [grad_w1, grad_w2], [], weight_decay=0.0,
                momentum=0.0, lr=0.5, dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
    update.meta["param"] = ("w1", "w2")
    graph.output((loss,))
    signature = GraphSignature((InputSpec("param", "w1", "w1", mutable=True), InputSpec("param", "w2", "w2", mutable=True),
                                InputSpec("batch", "x", 0)), (OutputSpec("user", 0),))
    return TrainGraph(fx.GraphModule(torch.nn.Module(), graph), signature)


def test_fuse_optimizer_moves_each_update_right_after_its_gradient_and_the_last_read_of_its_weight():
    from graphoffload import FuseOptimizer
    from graphoffload.passes.fuse_optimizer import fuse_optimizer

    captured = _two_layer_sgd_graph()
    eager_w = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, -1.0, 2.0, 0.25])]
    x = torch.tensor([1.0, -2.0, 0.5, 3.0])
    expected = [w.clone() for w in eager_w]
    captured.gm(*expected, x)                       # the graph as captured, run on real tensors
    ctx = PassContext(CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=4)), torch.device("cpu"))
    fused, _ = PassManager([Pass(fuse_optimizer, "fuse_optimizer")], builtin=[]).run(_two_layer_sgd_graph(), ctx)

    order = [n for n in fused.graph.nodes if n.op == "call_function"]
    updates = [n for n in order if n.target is aten._fused_sgd_.default]
    assert [u.meta["param"] for u in updates] == [("w2",), ("w1",)]      # one bucket each, w2's gradient first
    position = {n: i for i, n in enumerate(order)}
    grad_h = next(n for n in order if n.meta["phase"] == "backward" and n.args[1:] and n.args[1].name == "w2")
    grad_w1 = next(n for n in order if n.meta.get("param") == ("w1",) and n.meta["phase"] == "backward")
    assert position[updates[0]] == position[grad_h] + 1     # after the last read of w2, not only its gradient
    assert position[updates[1]] == position[grad_w1] + 1
    assert all(u.meta["pass"] == "fuse_optimizer" for u in updates)
    (summary,) = fused.notes_of("fuse_optimizer", "buckets")
    assert summary.fields["buckets"] == 2 and summary.fields["in_backward"] == 2

    got = [w.clone() for w in eager_w]
    fused.gm(*got, x)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)                    # moved, split: the same bits
    assert not torch.equal(got[0], eager_w[0])      # and the update did run


def test_written_placeholders_sees_writes_through_views_as_the_access_lists_do():
    from graphoffload.aliasing import StorageMap, written_placeholders

    graph = fx.Graph()
    a, b, c, d = (graph.placeholder(name) for name in "abcd")
    with FakeTensorMode() as mode:
        for p in (a, b, c, d):
            p.meta["val"] = mode.from_tensor(torch.zeros(4, 2))
    flat = graph.call_function(aten.view.default, (a, [8]))
    graph.call_function(aten.add_.Tensor, (flat, 1.0))                  # a, through a declared view
    raw = graph.call_function(aten._unsafe_view.default, (b, [8]))
    graph.call_function(aten.mul_.Tensor, (raw, 2.0))                   # b, through _unsafe_view
    parts = graph.call_function(aten.split.Tensor, (c, 2))
    first = graph.call_function(operator.getitem, (parts, 0))
    graph.call_function(aten.zero_.default, (first,))                   # c, through split's list
    total = graph.call_function(aten.add.Tensor, (d, d))                # d only read
    graph.output((total,))
    for node in graph.nodes:
        if node.op == "call_function":
            with mode:
                node.meta["val"] = node.target(*fx.map_arg(node.args, lambda n: n.meta["val"]))

    full, lean = StorageMap(graph), StorageMap(graph, accesses=False)
    assert lean.ids == full.ids and not lean.accesses
    from_accesses = {p.name for p in (a, b, c, d)
                     if any(acc.writes and acc.node is not p for s in full.of(p) for acc in full.accesses[s])}
    assert written_placeholders(graph) == from_accesses == {"a", "b", "c"}


def test_verification_with_one_storage_cache_per_compile_finds_the_writes_a_fresh_map_finds(monkeypatch):
    # the PassManager keeps one StorageCache across a compile's verifications (each reads again
    # only the nodes a pass made or rewired): every verification's written-placeholder set must
    # be the one a map built from scratch gives, on steps whose passes rewire many nodes
    from gpt import GPT
    from steps import TINY, clipped_step, token_batches, train_step

    import graphoffload
    from graphoffload import aliasing
    from graphoffload.passes import verify

    answers = []

    def both(graph, cache=None):
        assert cache is not None   # the manager passes its cache
        cached, fresh = aliasing.written_placeholders(graph, cache), aliasing.written_placeholders(graph)
        answers.append((cached, fresh))
        return cached

    monkeypatch.setattr(verify, "written_placeholders", both)
    batch = token_batches(1)[0]
    cases = [(clipped_step, torch.optim.AdamW, {"offload": graphoffload.Offload()}),
             (train_step, torch.optim.SGD, {"accumulation_steps": 2, "offload": graphoffload.Offload(accumulate_on="host")})]
    for step_fn, opt, options in cases:
        torch.manual_seed(0)
        model = GPT(TINY)
        step = graphoffload.offload_compile(step_fn, **options)
        optimizer = opt(model.parameters(), lr=1e-2)
        for _ in range(options.get("accumulation_steps", 1)):   # every variant
            step(model, optimizer, batch)
    assert len(answers) >= 8 and any(len(cached) > 1 for cached, _ in answers)
    for cached, fresh in answers:
        assert cached == fresh


def test_a_prefetch_value_made_directly_is_the_fake_kernels():
    # offload_optimizer makes prefetch_to_device's value with the constructor fake `empty` ends
    # in; it must be what the fake kernel (empty_like under the mode) gives, field by field, or
    # None (the kernel then runs) where the two could differ
    from graphoffload.passes.offload_optimizer import _prefetch_value
    from graphoffload.torch_private import empty_fake

    ops = torch.ops.graphoffload
    mode = FakeTensorMode()
    cpu = torch.device("cpu")

    def fields(t):
        return (type(t), t.shape, t.dtype, t.device, t.stride(), t.storage_offset(), t.requires_grad, t.layout,
                t.fake_mode is mode)

    def graph_of(values):
        g = fx.Graph()
        nodes = [g.placeholder(f"h{i}") for i in range(len(values))]
        for node, value in zip(nodes, values):
            node.meta["val"] = value
        return g, nodes

    dense = [empty_fake(mode, shape, dtype, cpu) for shape, dtype in
             (((3, 4), torch.float32), ((5,), torch.bfloat16), ((1,), torch.float32), ((2, 1, 3), torch.float16))]
    for device in (torch.device("meta"), cpu, torch.device("cuda"), torch.device("cuda:0")):
        g, nodes = graph_of(dense)
        direct = _prefetch_value(g, nodes, device)
        with mode:
            kernel = ops.prefetch_to_device.default(dense, device, [])
        assert direct is not None and len(direct) == len(kernel) == len(dense) + 1
        for a, b in zip(direct, kernel):
            assert fields(a) == fields(b), device
    with mode:
        odd = [torch.empty(5, 3).t(), torch.empty(0, 3), torch.empty_strided((2, 1), (1, 5))]
    for value in odd:   # not laid out as `empty` lays it out: left to the kernel
        g, nodes = graph_of([dense[0], value])
        assert _prefetch_value(g, nodes, torch.device("meta")) is None
    g, nodes = graph_of([dense[0], torch.empty(3)])   # not a fake tensor of the graph's mode
    assert _prefetch_value(g, nodes, torch.device("meta")) is None


def test_every_host_op_value_rule_gives_what_dispatching_the_op_gives():
    # fill_missing_meta calls the host ops' fake kernels directly (ops.host_transfer.VALUE_RULES);
    # the value must be the one a trace through the dispatcher records, for every op of the table
    from graphoffload.graph import fake_value
    from graphoffload.ops.host_transfer import VALUE_RULES

    ops = torch.ops.graphoffload
    with FakeTensorMode() as mode:
        dev = [torch.empty(3, 4), torch.empty(5, 2).t()]          # one of them not contiguous
        host = [torch.empty(3, 4), torch.empty(2, 5)]
        ticket, lr = torch.empty((), dtype=torch.int64), torch.empty(())
    args = {
        ops.copy_to_host.default: (dev, host),
        ops.host_adam_.default: (ticket, host, host, host, host, [], [lr, lr], lr, 0.9, 0.99, 0.0, 1e-8, False, False,
                                 True),
        ops.host_sgd_.default: (ticket, host, host, [], lr, 0.0, 0.0, 0.0, False, False, True),
        ops.host_accumulate_.default: (ticket, host, host, False),
        ops.host_grad_norm_.default: (ticket, host, [lr, lr], 2.0, False),
        ops.host_unscale_.default: (ticket, ticket, host, [lr], lr),
        ops.copy_to_device.default: (ticket, host, host, dev),
        ops.prefetch_to_device.default: (dev, torch.device("cpu"), [ticket]),
        ops.wait_host.default: (ticket, host),
        ops.carry_host_write.default: (ticket, host),
        ops.wait_device.default: (ticket, dev),
        ops.hand_over.default: (ticket, dev, "k"),
        ops.wait_handed_over.default: (dev, "k"),
    }
    assert set(args) == set(VALUE_RULES)
    g = fx.Graph()
    for target, values in args.items():
        inputs = [g.placeholder(f"x{i}") for i in range(len(values))]
        for node, value in zip(inputs, values):
            node.meta["val"] = value
        node = g.call_function(target, tuple(inputs))
        with mode:
            dispatched = target(*values)
        direct = fake_value(node, mode)
        dispatched = dispatched if isinstance(dispatched, (list, tuple)) else [dispatched]
        direct = direct if isinstance(direct, (list, tuple)) else [direct]
        assert len(direct) == len(dispatched), target
        for a, b in zip(direct, dispatched):
            if b is None:
                assert a is None, target
                continue
            assert (type(a), a.shape, a.dtype, a.device, a.stride()) == (type(b), b.shape, b.dtype, b.device, b.stride()), target


def test_the_host_sum_helpers_give_every_node_they_make_its_value_as_they_make_it():
    # offload_optimizer's host-sum rewrite (drain, host inf check, host norm, the flags joined)
    # on the few nodes it is about: every node a helper makes has meta["val"] when the helper
    # returns, before the pass ends (no fill_missing_meta runs here), and the values are right
    from graphoffload.passes.host_accumulation import (HostCheck, HostNorm, check_on_host, combine_host_flags,
                                                       drain_on_host, lift_check, norm_on_host, wait_for_sums)

    ops = torch.ops.graphoffload
    g = fx.Graph()
    with FakeTensorMode() as mode:
        values = {"grad": torch.zeros(4, 3), "sum": torch.zeros(4, 3), "host": torch.zeros(4, 3),
                  "out": torch.zeros(()), "host_flag": torch.zeros(()), "host_inv": torch.zeros(()),
                  "found_inf": torch.zeros(()), "inv_scale": torch.ones(())}
    p = {}
    for name, val in values.items():
        p[name] = g.placeholder(name)
        p[name].meta["val"] = val
    check = g.call_function(aten._amp_foreach_non_finite_check_and_unscale_.default,
                            ([p["grad"]], p["found_inf"], p["inv_scale"]))
    norm = g.call_function(aten.linalg_vector_norm.default, (p["grad"], 2.0))
    total = g.call_function(aten.linalg_vector_norm.default, (g.call_function(aten.stack.default, ([norm],)), 2.0))
    reader = g.call_function(aten.add.Tensor, (p["found_inf"], total))
    g.output((total, reader))
    for node in g.nodes:
        if node.op == "call_function":
            with mode:
                node.meta["val"] = node.target(*fx.map_arg(node.args, lambda n: n.meta["val"]))
    before = set(g.nodes)
    meta = {"param": ("w",)}
    copied = lift_check(g, HostCheck(check, p["found_inf"], p["inv_scale"]), p["host_inv"], meta)
    with g.inserting_before(norm):
        parked = g.call_function(ops.copy_to_host.default, ([p["grad"]], [p["host"]]))
    with mode:
        parked.meta["val"] = torch.empty((), dtype=torch.int64)
    waits = wait_for_sums(g, parked, [("w", p["sum"])], [p["host"]])
    drained = drain_on_host(g, parked, p["sum"], p["host"], meta)
    checked = check_on_host(g, copied, drained, p["host"], p["host_flag"], p["host_inv"], meta)
    along = norm_on_host(g, HostNorm(norm, norm, 2.0, False), checked, p["host"], p["out"], torch.device("cpu"),
                         meta, p["host_flag"])
    combine_host_flags(g, p["found_inf"], [], [], torch.device("cpu"), [along])
    made = [n for n in g.nodes if n not in before and n is not parked]
    assert len(made) >= 10 and waits[0] in made
    missing = [n.name for n in made if "val" not in n.meta]
    assert not missing, f"made without meta['val']: {missing}"
    assert all(n.meta["phase"] in ("transfer", "optimizer") for n in made if n not in waits)
    joined = next(n for n in made if n.target is aten.maximum.default)
    assert reader.args[0] is joined
    assert (joined.meta["val"].shape, joined.meta["val"].dtype) == (torch.Size([]), torch.float32)
    # what the fill would compute agrees with what the helpers stored
    from graphoffload.graph import fake_value
    for n in made:
        want, got = fake_value(n, mode), n.meta["val"]
        if isinstance(want, torch.Tensor):
            assert (got.shape, got.dtype, got.device) == (want.shape, want.dtype, want.device), n.name


def test_a_planner_edits_change_record_gives_the_map_a_full_check_gives():
    # the activation planner's StorageCache reads again only the nodes its edits report (_Edit:
    # the nodes it made and the readers it rewired, when made and when undone); every map built
    # from that record must be the map built from scratch, and an unreported rewire needs `forget`
    from graphoffload.aliasing import StorageCache, StorageMap
    from graphoffload.passes.offload_activations import _Edit

    def build(graph, x):
        a = graph.call_function(aten.mul.Tensor, (x, 2.0))
        v = graph.call_function(aten.view.default, (a, [2, 2]))
        graph.call_function(aten.add_.Tensor, (v, 1.0))                  # writes a through its view
        r = graph.call_function(aten.relu.default, (a,))
        return graph.call_function(aten.add.Tensor, (r, a))

    graph = _graph(build)
    g = graph.graph
    by_target = {n.target: n for n in g.nodes if n.op == "call_function"}
    a, writer, relu = by_target[aten.mul.Tensor], by_target[aten.add_.Tensor], by_target[aten.relu.default]

    def facts(m):
        return ([(n.name, m.ids[n]) for n in m.nodes], [c.name for c in m.creator],
                [(s, [(p, n.name, w) for p, n, w in acc]) for s, acc in m.accesses.items()],
                sorted(m.output_reads), [(n.name, [w.name for w in m.written_by(n)]) for n in m.nodes])

    cache = StorageCache(records_changes=True)
    assert facts(StorageMap(g, cache=cache)) == facts(StorageMap(g))
    assert cache.changed == set()   # the first map checked every node; the record starts empty

    # an edit: a copy of `a`, the in-place writer's view and relu rewired to it (as a replay rewires)
    view = writer.args[0]
    with g.inserting_before(view):
        copy = g.call_function(aten.clone.default, (a,))
        copy_view = g.call_function(aten.view.default, (copy, [2, 2]))
    copy.meta["val"], copy_view.meta["val"] = a.meta["val"], view.meta["val"]
    for reader, old, new in ((writer, view, copy_view), (relu, a, copy)):
        reader.replace_input_with(old, new)
    edit = _Edit([copy, copy_view], [(writer, view, copy_view), (relu, a, copy)], cache=cache)
    assert cache.changed == {copy, copy_view, writer, relu}
    edited = StorageMap(g, cache=cache)
    assert facts(edited) == facts(StorageMap(g))
    assert edited.of(relu) != edited.of(a) and edited.written_by(writer) == [copy_view]

    edit.undo(graph, [], set())   # the readers back on `a`, the copies erased
    assert cache.changed == {writer, relu}
    undone = StorageMap(g, cache=cache)
    assert facts(undone) == facts(StorageMap(g)) == facts(StorageMap(g, cache=StorageCache()))
    assert undone.written_by(writer) == [view]

    # a rewire nobody reports is not read again from the record (it must be complete) ...
    relu.replace_input_with(a, g.find_nodes(op="placeholder")[0])
    assert facts(StorageMap(g, cache=cache)) != facts(StorageMap(g))
    # ... and after `forget` every node is checked again
    cache.forget()
    assert facts(StorageMap(g, cache=cache)) == facts(StorageMap(g))
