"""Liveness-based memory prediction on graphs small enough to count by hand. Every storage is
rounded up to the CUDA caching allocator's 512-byte blocks."""

from __future__ import annotations

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import graphoffload
from graphoffload import GraphSignature, InputSpec, OutputSpec, TrainGraph, analyze_memory


def blocks(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def f32(*shape: int) -> int:
    return blocks(4 * torch.Size(shape).numel())


def square_sum_step(model, optimizer, x):
    loss = model(x).square().sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def compiled_linear_step(opt_cls, **opt_kwargs):
    model = nn.Linear(128, 64, bias=False)
    opt = opt_cls(model.parameters(), lr=0.1, **opt_kwargs)
    step = graphoffload.offload_compile(square_sum_step)
    x = torch.randn(8, 128)
    step(model, opt, x)
    return step, model, opt, x


def test_single_linear_step_peak_equals_the_hand_count():
    step, model, _, x = compiled_linear_step(torch.optim.SGD)
    profile = step.memory("captured")
    resident = f32(64, 128) + f32(8, 128) + blocks(8)     # weight, batch, float64 lr
    assert profile.resident == resident
    # the peak is the weight-gradient matmul: everything resident, the loss (returned, so alive
    # to the end), the gradient of y = x @ W.T that it reads, and the weight gradient it writes;
    # y, y**2 and the intermediate gradient factors have died by then
    assert profile.peak == resident + f32() + f32(8, 64) + f32(64, 128)
    node = step.graphs["captured"].graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)[1]
    assert profile.peak_node == node.name
    # after the update only the loss is left beside the inputs
    assert profile.live[-1] == resident + f32()


def test_resident_bytes_are_parameters_state_lr_and_batch():
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(square_sum_step)
    x = torch.randn(5, 32)
    step(model, opt, x)
    params = sum(blocks(p.nbytes) for p in model.parameters())
    state = sum(blocks(t.nbytes) for s in opt.state.values() for t in s.values())
    assert len(opt.state) == 4 and state == 4 * blocks(4) + 2 * params   # step, exp_avg, exp_avg_sq
    assert step.memory("captured").resident == params + state + blocks(8) + blocks(x.nbytes)
    assert step.memory().resident == step.memory("captured").resident


def hand_graph(fn, *inputs: torch.Tensor) -> TrainGraph:
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    n_out = len(gm.graph.output_node().args[0])
    return TrainGraph(gm, GraphSignature(tuple(InputSpec("batch", n, i) for i, n in enumerate(names)),
                                         tuple(OutputSpec("user", i) for i in range(n_out))))


def test_views_do_not_allocate_but_keep_their_base_alive():
    def fn(a):
        b = a * 2                                  # 16 KiB
        view = b.t().unsqueeze(0)[:, 1:]           # views of b: nothing new
        e = a + 1                                  # 16 KiB, while b is still needed by the view
        s = view.sum()                             # reads b through the view: b dies here
        return [e, s]

    graph = hand_graph(fn, torch.randn(64, 64))
    profile = analyze_memory(graph)
    a = b = e = f32(64, 64)
    nodes = {n.target: n.name for n in graph.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert profile.resident == a
    assert profile.live_at(nodes[aten.mul.Tensor]) == a + b
    for view in (aten.t.default, aten.unsqueeze.default, aten.slice.Tensor):
        assert profile.live_at(nodes[view]) == a + b
    assert profile.live_at(nodes[aten.add.Tensor]) == a + b + e
    assert profile.live_at(nodes[aten.sum.default]) == a + b + e + f32()
    assert profile.peak == a + b + e + f32()


def test_in_place_ops_write_into_their_argument_without_allocating():
    def fn(a):
        b = a.clone()          # 4 KiB
        b.mul_(3).add_(1)      # in place: same storage
        return [b]

    graph = hand_graph(fn, torch.randn(1024))
    profile = analyze_memory(graph)
    assert profile.peak == 2 * f32(1024)
    ops = [n.name for n in graph.graph.nodes if n.op == "call_function"]
    assert len(ops) == 3
    assert all(profile.live_at(name) == 2 * f32(1024) for name in ops)


def test_unsafe_view_after_a_batched_matmul_shares_the_product_storage():
    def fn(a, w):
        return [(a @ w).sum()]    # make_fx: view, mm, _unsafe_view (a view, though its schema says not)

    graph = hand_graph(fn, torch.randn(4, 64, 64), torch.randn(64, 256))
    profile = analyze_memory(graph)
    product = f32(4, 64, 256)
    unsafe_view = next(n.name for n in graph.graph.nodes if n.target == torch.ops.aten._unsafe_view.default)
    assert profile.live_at(unsafe_view) == profile.resident + product
    assert profile.peak == profile.resident + product + f32()


def test_split_and_unbind_outputs_are_views_of_their_input():
    # `Tensor(a -> *) self -> Tensor(a)[]`: each piece aliases the input; counting each as a
    # storage of its own overestimated every attention block's q/k/v by twice their bytes
    def fn(a):
        b = a * 2                      # 48 KiB
        q, k, v = b.split(64, dim=1)   # views of b
        rows = v.unbind(0)             # views of b again
        return [(q * k).sum() + rows[0].sum()]

    graph = hand_graph(fn, torch.randn(64, 192))
    profile = analyze_memory(graph)
    a = b = f32(64, 192)
    nodes = {n.target: n.name for n in graph.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert profile.live_at(nodes[aten.split.Tensor]) == a + b
    assert profile.live_at(nodes[aten.unbind.int]) == a + b
    assert profile.peak == a + b + f32(64, 64) + f32()   # b, q * k, and one partial sum


def test_storage_map_with_kept_node_facts_equals_a_fresh_one_after_edits():
    # the activation planner keeps per-node facts across its edits (StorageCache): a node whose
    # args change, or a node the edit made, must be read again, so every map equals a fresh one
    from graphoffload.aliasing import StorageCache, StorageMap

    def fn(a):
        b = a.clone()
        v = b.view(4, 16)          # a view of b's storage
        v.mul_(2)                  # writes b through the view
        c = torch.relu(b)
        p, q = c.split(32)         # views of c
        return [p.sum() + q.sum()]

    graph = hand_graph(fn, torch.randn(64))
    g = graph.graph

    def facts(m):
        return m.ids, m.creator, list(m.accesses.items()), m.output_reads

    cache = StorageCache()
    assert facts(StorageMap(g, cache=cache)) == facts(StorageMap(g))
    relu = next(n for n in g.nodes if n.target == torch.ops.aten.relu.default)
    view = next(n for n in g.nodes if n.target == torch.ops.aten.view.default)
    with g.inserting_before(relu):   # relu now reads a copy: b's storage is no longer its input
        copy = g.call_function(torch.ops.aten.clone.default, (relu.args[0],))
    copy.meta["val"] = relu.args[0].meta["val"]
    relu.replace_input_with(relu.args[0], copy)
    with g.inserting_after(view):    # a second view: aliases the first's storage
        again = g.call_function(torch.ops.aten.view.default, (view, [64]))
    again.meta["val"] = view.meta["val"].view(64)
    edited = StorageMap(g, cache=cache)
    assert facts(edited) == facts(StorageMap(g))
    assert edited.of(again) == edited.of(view) and edited.of(copy) != edited.of(copy.args[0])


def test_storage_map_accesses_match_a_plain_reading_of_the_graph():
    # the map records accesses on a fast path (the planner builds one per edit): each storage's
    # accesses must still be every node reading, writing or creating it, in node order, with
    # `writes` set exactly for the node that creates it and the nodes whose schema write into it
    from graphoffload.aliasing import StorageMap, written_args

    def fn(a):
        b = a.clone()
        v = b.view(4, 16)
        v.mul_(2)                  # writes b through the view
        c = torch.relu(b)
        p, q = c.split(32)
        return [p.sum() + (q * b[:32]).sum()]

    m = StorageMap(hand_graph(fn, torch.randn(64)).graph)
    expected: dict[int, list] = {}
    for i, node in enumerate(m.nodes):
        written = {s for w in written_args(node) for s in m.of(w)}
        created = {s for s in m.of(node) if m.creator[s] is node}
        for s in sorted({s for inp in node.all_input_nodes for s in m.of(inp)} | written | created):
            expected.setdefault(s, []).append((i, node, s in written or s in created))
    assert {s: [tuple(a) for a in acc] for s, acc in m.accesses.items() if acc} == expected
    mul = next(n for n in m.nodes if n.target == torch.ops.aten.mul_.Tensor)
    assert any(a.node is mul and a.writes for a in m.accesses[m.of(mul)[0]])


def test_storage_map_sharing_the_last_maps_prefix_equals_a_fresh_one_and_leaves_it_as_it_was():
    # a map built with a StorageCache takes from the last map what comes before the first node
    # an edit changed; a storage made there that the edit reads later gets a list of its own
    # (the last map, still read by whoever holds it, keeps its accesses), and after the edit is
    # undone the map is the one before it again
    from graphoffload.aliasing import StorageCache, StorageMap, written_args

    def fn(a):
        b = a.clone()
        b.mul_(2)                  # writes b
        c = torch.relu(b)
        d = c * 3
        return [d.sum()]

    graph = hand_graph(fn, torch.randn(64))
    g = graph.graph

    def facts(m):
        return dict(m.ids), list(m.creator), [(s, list(acc)) for s, acc in m.accesses.items()], m.output_reads

    cache = StorageCache()
    first = StorageMap(g, cache=cache)
    before = facts(first)
    assert before == facts(StorageMap(g))
    clone = next(n for n in g.nodes if n.target == torch.ops.aten.clone.default)
    mul = next(n for n in g.nodes if n.target == torch.ops.aten.mul.Tensor)
    with g.inserting_before(mul):   # a late reader of b's storage, made near the end
        late = g.call_function(torch.ops.aten.add.Tensor, (clone, mul.args[0]))
    late.meta["val"] = clone.meta["val"] + mul.args[0].meta["val"]
    mul.replace_input_with(mul.args[0], late)
    edited = StorageMap(g, cache=cache)
    assert facts(edited) == facts(StorageMap(g))
    assert facts(first) == before    # the last map is left as it was
    sid = edited.of(clone)[0]
    assert [a.node for a in edited.accesses[sid]][-1] is late
    assert edited.written_by(next(n for n in g.nodes if n.target == torch.ops.aten.mul_.Tensor)) == [clone]
    assert all(edited.written_by(n) == written_args(n) for n in edited.nodes)
    mul.replace_input_with(late, late.args[1])   # the edit undone
    g.erase_node(late)
    assert facts(StorageMap(g, cache=cache)) == before


def test_storage_map_with_a_new_placeholder_keeps_the_nodes_after_it_and_equals_a_fresh_one():
    # an activation offload adds its host buffer as a placeholder after the last one; the map
    # built with a StorageCache then takes over the nodes after it up to the next change, one
    # position and (the buffer's storage made first) one storage number later: it must be the
    # map built from scratch, every storage's accesses in order, and leave the last map as it was
    from graphoffload.aliasing import StorageCache, StorageMap

    def fn(a, w):
        b = a * w
        v = b.view(8, 8)           # a view of b made in the kept part
        c = torch.relu(v)
        d = c.mul_(2)              # writes c
        e = d.flatten() + a        # reads a again after the kept part
        return [e.sum(), b]

    graph = hand_graph(fn, torch.randn(64), torch.randn(64))
    g = graph.graph

    def facts(m):
        return (dict(m.ids), list(m.creator), [(s, [tuple(a) for a in acc]) for s, acc in m.accesses.items()],
                m.output_reads, [m.written_by(n) for n in m.nodes])

    cache = StorageCache()
    first = StorageMap(g, cache=cache)
    before = facts(first)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    relu = next(n for n in g.nodes if n.target == torch.ops.aten.relu.default)
    add = next(n for n in g.nodes if n.target == torch.ops.aten.add.Tensor)
    with g.inserting_after(placeholders[-1]):   # a host buffer, as an offload adds it
        host = g.placeholder("h_buffer")
    host.meta["val"] = relu.meta["val"].new_empty(64)
    with g.inserting_before(add):               # a copy into it, after the kept nodes
        copy = g.call_function(torch.ops.aten.copy_.default, (host, placeholders[0]))
    copy.meta["val"] = host.meta["val"]
    edited = StorageMap(g, cache=cache)
    assert facts(edited) == facts(StorageMap(g))
    assert facts(first) == before
    assert edited.position[relu] == first.position[relu] + 1
    assert edited.of(host) == [len(placeholders)] and edited.of(relu) == [first.of(relu)[0] + 1]
    assert [a.node for a in edited.accesses[edited.of(host)[0]]] == [host, copy]
    # a second buffer, a placeholder with no tensor, and nothing else changed: every node kept
    with g.inserting_after(host):
        second = g.placeholder("h_second")
        flag = g.placeholder("flag")
    second.meta["val"], flag.meta["val"] = host.meta["val"].new_empty(8), 3
    again = StorageMap(g, cache=cache)
    assert facts(again) == facts(StorageMap(g))
    g.erase_node(flag)
    g.erase_node(second)
    assert facts(StorageMap(g, cache=cache)) == facts(StorageMap(g))


def test_analysis_counts_each_storage_as_storage_span_does():
    # analyze_memory counts the storages in one loop (the activation planner analyses every edit
    # of its graph); the profile must be what summing storage_span over the storages gives,
    # multi-output ops, views, in-place writes, a host input and a kept StorageCache included
    from dataclasses import replace

    from graphoffload.aliasing import StorageCache, StorageMap
    from graphoffload.memory import storage_span

    def fn(a, w, h):
        x = torch.layer_norm(a, (64,), w)          # one output of a multi-output op
        p, q = x.split(32, dim=1)                  # views
        y = p.relu().mul_(2) + h.sum()             # an in-place write into a new storage
        z = torch.ops.aten.native_layer_norm.default(q.contiguous(), (32,), None, None, 1e-5)[0]
        return [(y @ z.t()).sum(), z]

    graph = hand_graph(fn, torch.randn(16, 64), torch.randn(64), torch.randn(8))
    host = graph.signature.inputs[2]
    graph = graph.with_signature(inputs=(*graph.signature.inputs[:2], replace(host, host=True)))

    def by_spans(storages):
        on_host = {host.name}
        delta, resident = [0] * (len(storages.nodes) + 2), 0
        for sid in range(len(storages.creator)):
            nbytes, span = storage_span(storages, sid, on_host)
            if span is None:
                resident += nbytes
            else:
                delta[span[0]] += nbytes
                delta[span[1] + 1] -= nbytes
        live, running = [], resident
        for d in delta[:len(storages.nodes)]:
            running += d
            live.append(running)
        return resident, live

    for storages in (StorageMap(graph.graph), StorageMap(graph.graph, cache=StorageCache())):
        profile = analyze_memory(graph, storages)
        resident, live = by_spans(storages)
        assert profile.resident == resident and list(profile.live) == live
        assert profile.peak == max(live) and profile.peak_node == storages.nodes[live.index(max(live))].name
        assert profile.nodes == tuple(n.name for n in storages.nodes)
    assert analyze_memory(graph).resident == f32(16, 64) + f32(64)   # the host input is not counted
