"""ZeRO stage 3 (the `zero` pass with `zero_params`): parameters sharded between steps.

Each of N gloo ranks trains a tiny model on its own micro-batch; after every step the model's
parameters are `Shard(0)` DTensors whose local rows are about 1/N of the parameters, and their
`full_tensor()` equals single-process eager training on the whole batch. The graph gathers every
parameter bucket before forward and again before backward, reduce-scatters each gradient
bucket, and updates this rank's rows in place: the collectives are counted. One rank's rewrite is
also compiled in a single process (`AsRank`, from test_zero) for what needs no other rank: the
predicted peak against the parameters' bytes, what is refused, and parameters swapped by the
user; with `accumulation_steps`, each call's collectives (gathers on both calls, reduce-scatters on
the updating call alone), the accumulating call's peak against stage 2's, and a one-rank group
trained through windows and resumed mid-window (the 2-rank run: tests/test_zero_accumulation.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from ring_dist import run_ranks
from helpers import zero_optimizer as _optimizer

import test_zero

import graphoffload
from graphoffload.data_parallel import shard_rows
from graphoffload.memory import block_bytes
from graphoffload.torch_private import pytree

STEPS = 3
RTOL = 2e-5
AsRank = test_zero.AsRank
c10d = torch.ops._c10d_functional


class _Stack(torch.nn.Module):
    """A few layers of uneven dims 0 (5 and 3 rows do not split over 2 or 4 ranks evenly), a
    tied weight read twice in forward, and a 0-dim parameter (not sharded)."""

    def __init__(self, layers: int = 3, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, width)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.narrow = torch.nn.Linear(width, 5)
        self.out = torch.nn.Linear(5, 3)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            h = h + torch.tanh(layer(h))
        h = self.out(torch.tanh(self.narrow(self.norm(h))))
        return ((h * self.scale - y) ** 2).mean()


def _step(model, optimizer, batch):
    loss = model(batch["x"], batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _batches(world: int, rows: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(rows * world, 6, generator=g, dtype=torch.float64),
             "y": torch.randn(rows * world, 3, generator=g, dtype=torch.float64)} for _ in range(STEPS)]


def _micro(batch, rank, world):
    rows = batch["x"].shape[0] // world
    return {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}


def _zero3(**kw):
    return graphoffload.ZeRO(stage=3, bucket_numel=kw.pop("bucket_numel", 300), timeout_s=60, **kw)


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in model.named_parameters()}


def _trains_as_eager(rank, world, optimizer, dtype=torch.float64):
    eager = _Stack().to(dtype)
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer(optimizer, eager), _optimizer(optimizer, model)
    step = graphoffload.offload_compile(_step, data_parallel=_zero3())
    for batch in _batches(world):
        batch = {k: v.to(dtype) for k, v in batch.items()}
        _step(eager, opt_e, batch)
        step(model, opt, _micro(batch, rank, world))
        got = _full_params(model)
        for name, q in eager.named_parameters():
            err = ((got[name] - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"stage 3 {optimizer} {dtype}: {name} is {err:.3g} from eager"

    # between steps: every parameter but the 0-dim one a Shard(0) DTensor of this rank's rows,
    # and the optimizer keyed by the very parameters the model holds
    local = whole = 0
    for name, p in model.named_parameters():
        whole += p.numel()
        if p.dim() == 0:
            assert type(p) is torch.nn.Parameter and not isinstance(p, DTensor)
            local += 1
            continue
        assert isinstance(p, DTensor) and isinstance(p, torch.nn.Parameter), name
        assert p.placements == (Shard(0),) and p.device_mesh.size() == world
        assert p.to_local().shape == (shard_rows(p.shape[0], world, rank)[1], *p.shape[1:]), name
        local += p.to_local().numel()
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    assert set(map(id, opt.state)) == {id(p) for p in model.parameters()}
    rows = sum(p.numel() // p.shape[0] for p in model.parameters() if p.dim()) / whole
    assert abs(local / whole - 1 / world) <= rows + 1 / whole, (local, whole)
    sd = model.state_dict()
    assert isinstance(sd["inp.weight"], DTensor) and torch.equal(sd["inp.weight"].full_tensor(),
                                                                 got["inp.weight"])

    # collectives: one all-gather per parameter bucket in forward and one per bucket backward
    # reads, one reduce-scatter per gradient bucket, nothing else
    graph = step.last.graph
    params = graph.notes_of("zero", "params")[0].fields
    shards = graph.notes_of("zero", "shards")[0].fields
    targets = [n.target for n in graph.gm.graph.nodes]
    assert len(params["forward_buckets"]) > 2 and 0 < len(params["backward_buckets"]) <= len(params["forward_buckets"])
    assert targets.count(c10d.all_gather_into_tensor.default) == \
        len(params["forward_buckets"]) + len(params["backward_buckets"])
    assert targets.count(c10d.reduce_scatter_tensor.default) == shards["buckets"]
    assert targets.count(c10d.all_reduce_coalesced.default) == targets.count(c10d.all_reduce.default) == 0
    assert targets.count(c10d.wait_tensor.default) == targets.count(c10d.all_gather_into_tensor.default) + \
        shards["buckets"]
    return local / whole


def _gpt_trains_as_eager(rank, world):
    """The tiny GPT (attention, layer norms, tied embedding and head read twice in forward) with
    updates fused into backward (small fusion buckets), so a bucket's update runs between
    backward's gathers of the parameters: every parameter as eager's on the whole batch."""
    from test_zero import _batches as gpt_batches, _gpt
    from steps import train_step

    eager = _gpt()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer("adamw", eager), _optimizer("adamw", model)
    config = graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=2048))
    step = graphoffload.offload_compile(train_step, config=config, data_parallel=_zero3(bucket_numel=4096))
    for batch in gpt_batches(world):
        train_step(eager, opt_e, batch)
        rows = batch["input_ids"].shape[0] // world
        step(model, opt, {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()})
        got = _full_params(model)
        for name, q in eager.named_parameters():
            err = ((got[name] - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"stage 3 GPT: {name} is {err:.3g} from eager"
    fused = [n.fields for n in step.last.graph.notes_of("fuse_optimizer", "bucket")]
    assert any(f["in_backward"] for f in fused), fused


def _world2(rank, world, path):
    fractions = [_trains_as_eager(rank, world, name) for name in ("adamw", "sgd")]
    _trains_as_eager(rank, world, "adamw", torch.float32)
    _gpt_trains_as_eager(rank, world)
    _dcp_world2(rank, world, path)
    print(f"rank {rank}: local parameter fraction {fractions[0]:.4f}")


@pytest.mark.slow   # several processes; one spawn per world size (starting ranks costs more than a run)
def test_zero_stage_3_trains_as_eager_and_its_dcp_checkpoint_resumes_on_2_and_4_ranks(tmp_path):
    """(The 4-rank spawn also trains stage 3 with offload=: no process start-up of its own.)"""
    run_ranks(_world2, 2, str(tmp_path), deadline_s=300)
    run_ranks(_world4, 4, str(tmp_path), deadline_s=300)


# ---------------------------------------------------------------- single process: one rank's rewrite


class _Deep(torch.nn.Module):
    """Equal layers, so a bucket of `LAYER` elements is one layer's weight and bias."""

    def __init__(self, layers: int = 8, width: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


LAYER = 64 * 64 + 64


def _deep_step(model, optimizer, x):
    loss = model(x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _compile_deep(stage, rank=0, world=2):
    model = _Deep()
    opt = torch.optim.AdamW(model.parameters())
    step = graphoffload.offload_compile(_deep_step, data_parallel=AsRank(stage=stage, bucket_numel=LAYER,
                                                                         as_rank=rank, as_world=world))
    step.compile(model, opt, torch.randn(2, 64))
    return step, model, opt


@pytest.mark.parametrize("world", [2, 4])
def test_stage_3_holds_1_over_n_of_the_parameters_and_gathers_about_one_layer_at_a_time(world, one_process_group):
    (stage2, model2, _), (stage3, model3, _) = _compile_deep(2, world=world), _compile_deep(3, world=world)
    whole = sum(block_bytes(p) for p in model2.parameters())      # as memory() counts them (whole blocks)
    mine = sum(block_bytes(p.to_local()) for p in model3.parameters())
    assert sum(p.to_local().numel() for p in model3.parameters()) == 8 * LAYER // world   # rank 0's rows
    m2, m3 = stage2.memory(), stage3.memory()
    # the graph's inputs: stage 2 holds every whole parameter, stage 3 this rank's rows alone
    assert m2.resident - m3.resident == whole - mine
    # between forward and backward (the loss's gradient seed) no gathered parameter is live but
    # the last layer's, kept for backward: beside the inputs, what stage 2 holds there (the
    # activations) and that one bucket (the analysis keeps its whole gather buffer alive)
    graph = stage3.last.graph.gm.graph
    seed = next(n for n in graph.nodes if n.meta.get("phase") == "backward")
    seed2 = next(n for n in stage2.last.graph.gm.graph.nodes if n.meta.get("phase") == "backward")
    assert seed.target == seed2.target
    assert m3.live_at(seed.name) - m3.resident == m2.live_at(seed2.name) - m2.resident + \
        block_bytes(torch.empty(LAYER))
    # the predicted peak: the shards plus a few layers (a gathered layer, and one layer's gradient
    # packed for its reduce-scatter); far below stage 2's, which holds every whole parameter
    assert m3.peak - m3.resident <= 6 * LAYER * 4, (m3.peak - m3.resident) / (LAYER * 4)
    assert m2.peak - m3.peak >= whole - mine - LAYER * 4

    # prefetch: every forward gather but the first is launched before the previous bucket's
    # layer computes, and waited for only after it
    params = stage3.last.graph.notes_of("zero", "params")[0].fields
    assert len(params["forward_buckets"]) == 8 and set(params["forward_buckets"]) == {LAYER}
    # backward reads 7 weights (not the first layer's: no input gradient to compute; no bias):
    # the last layer's from forward's copy, kept, and 6 gathered again
    assert params["kept"] == ("layers.7.weight",)
    assert len(params["backward_buckets"]) == 6 and set(params["backward_buckets"]) == {64 * 64}
    # volume: forward gathers every parameter, backward 6 weights, the reduce-scatter every
    # gradient: about 1.4x DDP's all-reduce (twice the gradients; the ZeRO paper's analysis: 1.5x)
    assert params["volume_vs_ddp"] == pytest.approx((8 * LAYER + 6 * 64 * 64 + 8 * LAYER) / (2 * 8 * LAYER))
    nodes = list(graph.nodes)
    launches = [i for i, n in enumerate(nodes) if n.target is c10d.all_gather_into_tensor.default]
    waits = [i for i, n in enumerate(nodes) if n.target is c10d.wait_tensor.default
             and n.args[0].target is c10d.all_gather_into_tensor.default]
    assert len(launches) == len(waits) == 14
    # every gather reads a copy of the chunks, never the chunk (an update may overwrite it meanwhile)
    assert all(nodes[i].args[0].target is torch.ops.aten.cat.default for i in launches)
    for launch, wait in zip(launches[1:8], waits[1:8]):
        assert any(n.target is torch.ops.aten.addmm.default for n in nodes[launch:wait])
    for launch, wait in zip(launches[8:], waits[8:]):   # backward: the previous layer's matmuls between
        assert any(n.target is torch.ops.aten.mm.default for n in nodes[launch:wait])


def _clip_step(model, optimizer, x):
    loss = model(x)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss, norm


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, todo = set(), [node]
    while todo:
        for n in todo.pop().all_input_nodes:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_stage_3_clips_with_one_scalar_all_reduce_that_every_update_reads(one_process_group):
    """clip_grad_norm_ under stage 3 (stages 1-2's global norm): the per-gradient norms read this
    rank's reduce-scattered chunks, one scalar all_reduce of their total's square (after every
    gradient reduce-scatter) is the only collective clipping adds, and every update reads
    gradients scaled by the coefficient computed from its root, which the step also returns."""
    model = _Deep()
    opt = torch.optim.AdamW(model.parameters())
    step = graphoffload.offload_compile(_clip_step, data_parallel=AsRank(stage=3, bucket_numel=LAYER))
    graph = step.compile(model, opt, torch.randn(2, 64))
    plain = _compile_deep(3)[0].last.graph
    nodes = list(graph.gm.graph.nodes)

    def collectives(g):
        return sorted(str(n.target) for n in g.gm.graph.nodes if n.target in (
            c10d.all_reduce.default, c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default))

    assert collectives(graph) == sorted(collectives(plain) + [str(c10d.all_reduce.default)])
    [reduce] = [n for n in nodes if n.target is c10d.all_reduce.default]
    assert reduce.meta["val"].dim() == 0
    assert max(i for i, n in enumerate(nodes) if n.target is c10d.reduce_scatter_tensor.default) < nodes.index(reduce)
    scatters = {n for n in nodes if n.target is c10d.reduce_scatter_tensor.default}
    norms = [n for n in nodes if n.target is torch.ops.aten.linalg_vector_norm.default and n.args[0].target is not
             torch.ops.aten.stack.default]
    assert len(norms) == 16 and all(_ancestors(n) & scatters for n in norms)   # this rank's chunks, not whole
    assert all(n.args[0].meta["val"].shape[0] == 32 for n in norms)
    updates = [n for n in nodes if n.target is torch.ops.aten._fused_adamw_.tensor_lr]
    grads = [g for u in updates for g in u.args[1]]
    assert len(grads) == 16
    for g in grads:   # each the chunk clipping scaled in place, by the global norm's coefficient
        scale = next(u for u in g.users if u.target is torch.ops.aten.mul_.Tensor) if g.target is not \
            torch.ops.aten.mul_.Tensor else g
        assert reduce in _ancestors(scale.args[1]) and scatters & _ancestors(scale.args[0])
        assert nodes.index(scale) < min(nodes.index(u) for u in updates if g in u.args[1])
    output = next(n for n in nodes if n.op == "output")
    assert reduce in _ancestors(output)   # the returned norm: the global one
    fields = graph.notes_of("zero", "clip")[0].fields
    assert fields["terms"] == fields["scales"] == 16


def _grad_kept_step(model, optimizer, x):
    optimizer.zero_grad()
    model(x).backward()
    optimizer.step()


def _returns_a_parameter_step(model, optimizer, x):
    model(x).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model.layers[0].weight


@pytest.mark.parametrize("step_fn, match", [
    (_grad_kept_step, r"stage 3 keeps only this rank's own gradients, but the step leaves .*\.grad set"),
    (_returns_a_parameter_step, r"stage 3 shards parameter layers.0.weight between steps, but the step returns it"),
])
def test_what_stage_3_cannot_do_yet_is_refused_before_anything_changes(step_fn, match, one_process_group):
    model = _Deep()
    opt = torch.optim.AdamW(model.parameters())
    params = list(model.parameters())
    step = graphoffload.offload_compile(step_fn, data_parallel=AsRank(stage=3))
    with pytest.raises(graphoffload.UnsupportedError, match=match):
        step.compile(model, opt, torch.randn(2, 64))
    assert not opt.state and all(p is q for p, q in zip(model.parameters(), params))
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_parameters_swapped_after_stage_3_sharded_them_are_refused(one_process_group):
    step, model, opt = _compile_deep(3)
    sharded = model.layers[3].weight
    assert isinstance(sharded, DTensor) and sharded.to_local().shape == (32, 64)
    assert any(p is sharded for g in opt.param_groups for p in g["params"]) and sharded in opt.state
    step.compile(model, opt, torch.randn(2, 64))   # the same parameters: no new trace
    assert step.trace_count == 1
    new = model.layers[3].weight = torch.nn.Parameter(torch.zeros(64, 64))
    with pytest.raises(graphoffload.CaptureError, match=r"AdamW holds a DTensor parameter .* was a parameter a "
                                                        r"ZeRO stage 3 step sharded replaced in the model\?"):
        step.compile(model, opt, torch.randn(2, 64))
    # replaced in the optimizer too
    opt.param_groups[0]["params"] = [new if p is sharded else p for p in opt.param_groups[0]["params"]]
    with pytest.raises(graphoffload.StateError, match=r"parameter layers.3.weight is a plain Parameter of shape "
                                                      r"\(64, 64\), but this ZeRO stage 3 step sharded it .* load "
                                                      r"new values into the parameters the step made"):
        step.compile(model, opt, torch.randn(2, 64))


def _world4(rank, world, path):
    fraction = _trains_as_eager(rank, world, "adamw")
    _dcp_world4(rank, world, path)
    # ZeRO-Offload of stage 3 on 4 ranks (the 2-rank runs: tests/test_zero_offload.py): the tiny
    # GPT in fp64 with fp32 master weights, every update on the host, each rank's parameters as
    # eager's on the whole batch and its host state about 1/4 of one process offloading the model
    import test_zero_offload

    share, _ = test_zero_offload._trains_as_eager(rank, world, 3, graphoffload.Offload(device_updates="never"))
    print(f"rank {rank}: local parameter fraction {fraction:.4f}; offloaded (state bytes, host bytes) / "
          f"one process's {share}")


def _full_state(model, opt) -> dict:
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: {k: t.full_tensor() if isinstance(t, DTensor) else t.clone() for k, t in s.items()}
            for p, s in opt.state.items()}


def _same(a: dict, b: dict) -> bool:
    flat_a, flat_b = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(flat_a) == len(flat_b) and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


def _dcp_world2(rank, world, path):
    """DCP saves the model's DTensor parameters and the optimizer's DTensor state; a fresh model
    (other values) under a fresh step loads them into the DTensors its step made and goes on
    bit-identically to the run that was not interrupted."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    batches = [_micro(b, rank, world) for b in _batches(world)]
    model = _Stack().double()
    opt, step = _optimizer("adamw", model), graphoffload.offload_compile(_step, data_parallel=_zero3())
    for batch in batches[:2]:
        step(model, opt, batch)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    saved = (_full_params(model), _full_state(model, opt))
    loss = step(model, opt, batches[2])
    after = (_full_params(model), _full_state(model, opt))

    if rank == 0:
        torch.save({"saved": saved, "after": after}, f"{path}/full.pt")
    fresh, opt, step = _load_dcp(path, batches[2])
    assert _same((_full_params(fresh), _full_state(fresh, opt)), saved)
    assert torch.equal(step(fresh, opt, batches[2]), loss)
    assert _same((_full_params(fresh), _full_state(fresh, opt)), after)   # bit-identical


def _load_dcp(path, batch):
    """A fresh model (other values), optimizer and step, compiled first so that the parameters
    and state are this world's DTensors; DCP loads each rank's rows into them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    fresh = _Stack().double()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    opt, step = _optimizer("adamw", fresh), graphoffload.offload_compile(_step, data_parallel=_zero3())
    step.compile(fresh, opt, batch)
    sharded = list(fresh.parameters())
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, opt, state["optim"])
    assert all(p is q for p, q in zip(fresh.parameters(), sharded))   # loaded into, not replaced
    return fresh, opt, step


def _dcp_world4(rank, world, path):
    """The 2-rank checkpoint on 4 ranks: DCP reshards the DTensors (16 rows: 8+8 -> 4+4+4+4; 5:
    3+2 -> 2+2+1+0), every value as saved; the next step, the same global batch in 4
    micro-batches, as the 2-rank run went on up to summation order."""
    full = torch.load(f"{path}/full.pt")
    batch = _micro(_batches(2)[2], rank, world)
    fresh, opt, step = _load_dcp(path, batch)
    assert _same((_full_params(fresh), _full_state(fresh, opt)), full["saved"])
    step(fresh, opt, batch)
    got = _full_params(fresh)
    for name, p in full["after"][0].items():
        err = ((got[name] - p).abs().max() / p.abs().max()).item()
        assert err <= RTOL, f"{name} is {err:.3g} from the 2-rank run"



def test_a_first_call_interrupted_mid_update_names_the_sharded_parameters_it_changed(one_process_group):
    """The step replaces the parameters when it first compiles, inside the first call: what that
    call's fused updates changed before a failure is still reported (a one-rank group runs it)."""
    from test_interrupted_step import ARMED, SMALL_BUCKETS, make, train_step

    model, opt = make()
    step = graphoffload.offload_compile(train_step, config=SMALL_BUCKETS, data_parallel=_zero3(bucket_numel=9))
    ARMED["backward"] = RuntimeError
    try:
        with pytest.raises(graphoffload.PartialUpdateError, match=r"interrupted part-way.*last\.weight"):
            step(model, opt, torch.randn(4, 8))
    finally:
        ARMED["backward"] = None
    assert isinstance(model.last.weight, DTensor)
    with pytest.raises(graphoffload.StateError, match="refusing to run"):
        step(model, opt, torch.randn(4, 8))


class _Checkpointed(_Stack):
    """_Stack with its hidden layers under activation checkpointing: backward's recompute reads
    the parameters again, from the backward gather."""

    def forward(self, x, y):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            h = h + checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), h, use_reentrant=False)
        h = self.out(torch.tanh(self.narrow(self.norm(h))))
        return ((h * self.scale - y) ** 2).mean()


def _groups(model):
    """Two param groups (no weight decay on vectors), and the first layer frozen."""
    model.inp.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 2e-2}],
                             lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("module, optimizer", [(_Stack, "adamw"), (_Checkpointed, "adamw"), (_Stack, "groups")])
def test_one_rank_trains_as_eager_through_the_gathers(module, optimizer, one_process_group):
    """A group of one rank runs the whole rewrite (gathers, views repeated in backward, a
    checkpointed region's recompute reading the backward gather; two param groups and a frozen
    layer, which stays a plain whole parameter): parameters as eager's."""
    eager = module().double()
    model = copy.deepcopy(eager)
    make = _groups if optimizer == "groups" else lambda m: _optimizer(optimizer, m)
    opt_e, opt = make(eager), make(model)
    step = graphoffload.offload_compile(_step, data_parallel=_zero3())
    for batch in _batches(1):
        _step(eager, opt_e, batch)
        step(model, opt, batch)
        got = _full_params(model)
        for name, q in eager.named_parameters():
            assert torch.allclose(got[name], q, rtol=1e-12, atol=1e-12), name
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert all(not isinstance(p, DTensor) for p in frozen) and len(frozen) == (2 if optimizer == "groups" else 0)
    if module is _Checkpointed:   # the recompute reads whole parameters gathered in backward
        nodes = list(step.last.graph.gm.graph.nodes)
        seed = next(i for i, n in enumerate(nodes) if n.meta.get("phase") == "backward")
        reads = [i for n in nodes if n.meta.get("recompute") for i in n.all_input_nodes if i.meta.get("pass") == "zero"]
        assert reads and all(nodes.index(i) > seed for i in reads)


def _autocast_step(model, optimizer, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch["x"], batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_one_rank_under_bf16_autocast_repeats_the_weights_casts_in_backward(one_process_group):
    """Autocast casts each weight in forward: backward reads the casts, which are repeated from
    the backward gather (so the forward copies die after forward); fp32 parameters as eager's."""
    eager = _Stack()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer("adamw", eager), _optimizer("adamw", model)
    step = graphoffload.offload_compile(_autocast_step, data_parallel=_zero3())
    for batch in _batches(1):
        batch = {k: v.float() for k, v in batch.items()}
        assert torch.equal(step(model, opt, batch), _autocast_step(eager, opt_e, batch))
        got = _full_params(model)
        for name, q in eager.named_parameters():
            err = ((got[name] - q).abs().max() / q.abs().max()).item()
            assert err <= 1e-5, f"{name} is {err:.3g} from eager"
    nodes = step.last.graph.gm.graph.nodes
    casts = [n for n in nodes if n.target is torch.ops.aten._to_copy.default and n.meta.get("pass") == "zero"]
    assert casts and all(n.meta["phase"] == "backward" for n in casts)
    assert step.last.graph.notes_of("zero", "params")[0].fields["recomputed"] >= len(casts)


# ---------------------------------------------------------------- accumulation_steps


def _compile_deep_window(stage, update, world=2, k=2):
    """One rank's accumulating (or, `update`, updating) call of an `accumulation_steps=k` step."""
    model = _Deep()
    opt = torch.optim.AdamW(model.parameters())
    step = graphoffload.offload_compile(_deep_step, accumulation_steps=k, data_parallel=AsRank(
        stage=stage, bucket_numel=LAYER, as_world=world))
    if update:   # at the window's last micro-batch, as a step loaded from a checkpoint taken there
        step.load_state_dict({"optimizers": [opt.state_dict()],
                              "accumulation": {"steps": k, "micro_step": k - 1, "grad_sums": {}}}, optimizers=[opt])
    step.compile(model, opt, torch.randn(2, 64))
    return step, model


def test_stage_3_accumulation_gathers_every_call_and_reduce_scatters_once_per_window(one_process_group):
    """Both calls of a window gather each layer's bucket for forward and again for backward; only
    the updating call reduce-scatters (once per gradient bucket), the sums of the whole window."""
    for update in (False, True):
        step, model = _compile_deep_window(3, update)
        graph = step.last.graph
        targets = [n.target for n in graph.gm.graph.nodes]
        params = graph.notes_of("zero", "params")[0].fields
        assert len(params["forward_buckets"]) == 8 and len(params["backward_buckets"]) == 6, params
        assert params["kept"] == ("layers.7.weight",)
        assert targets.count(c10d.all_gather_into_tensor.default) == 14
        assert targets.count(c10d.reduce_scatter_tensor.default) == (8 if update else 0)   # a layer a bucket
        assert targets.count(c10d.all_reduce.default) == targets.count(c10d.all_reduce_coalesced.default) == 0
        # the running sums stay whole on every rank (each rank's own micro-batches, not reduced yet)
        sums = [s for s in graph.signature.inputs if s.kind == "grad_sum"]
        placeholders = graph.placeholders()
        assert len(sums) == 16 and all(placeholders[s.name].meta["val"].shape == model.get_parameter(s.target).shape
                                       for s in sums)
        assert all(isinstance(p, DTensor) and p.to_local().shape[0] == p.shape[0] // 2 for p in model.parameters())


@pytest.mark.parametrize("world", [2, 4])
def test_stage_3_accumulating_call_predicts_the_parameters_saving_over_stage_2(world, one_process_group):
    """Accumulating calls hold the whole running sums under both stages; stage 3 holds this
    rank's rows of the parameters instead of the whole ones, and at its peak (backward) at most
    two gathered buckets (the one read and the next, in flight)."""
    (s2, model2), (s3, model3) = _compile_deep_window(2, False, world), _compile_deep_window(3, False, world)
    whole = sum(block_bytes(p) for p in model2.parameters())
    mine = sum(block_bytes(p.to_local()) for p in model3.parameters())
    m2, m3 = s2.memory(), s3.memory()
    assert m2.resident - m3.resident == whole - mine
    assert whole - mine - 2 * LAYER * 4 <= m2.peak - m3.peak < whole - mine, (m2.peak - m3.peak, whole - mine)


def test_one_rank_accumulates_as_eager_and_resumes_mid_window(one_process_group):
    """A group of one rank runs both calls of the window through the gathers: parameters as eager
    accumulation's; a step taken mid-window (`step.state_dict()`: micro_step and the whole running
    sums) resumes in a fresh model, optimizer and step bit-identically."""
    k = 2
    eager = _Stack().double()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer("adamw", eager), _optimizer("adamw", model)
    step = graphoffload.offload_compile(_step, accumulation_steps=k, data_parallel=_zero3())
    batches = _batches(1) + _batches(1)[:1]
    for i, batch in enumerate(batches[:2 * k]):
        (eager(batch["x"], batch["y"]) / k).backward()
        step(model, opt, batch)
        if i % k == k - 1:
            opt_e.step()
            opt_e.zero_grad()
            got = _full_params(model)
            for name, q in eager.named_parameters():
                assert torch.allclose(got[name], q, rtol=1e-12, atol=1e-12), name
    assert step.micro_step == 0 and all(p.grad is None for p in model.parameters())

    # mid-window: one micro-batch into the third window
    step(model, opt, batches[0])
    saved = copy.deepcopy(step.state_dict())
    assert saved["accumulation"]["micro_step"] == 1
    assert {n: t.shape for n, t in saved["accumulation"]["grad_sums"].items()} == \
        {n: p.shape for n, p in model.named_parameters()}
    fresh = _Stack().double()
    opt_f = _optimizer("adamw", fresh)
    resumed = graphoffload.offload_compile(_step, accumulation_steps=k, data_parallel=_zero3())
    resumed.compile(fresh, opt_f, batches[1])   # shards the fresh parameters; then load into them
    with torch.no_grad():
        for p, q in zip(fresh.parameters(), model.parameters()):
            (p.to_local() if isinstance(p, DTensor) else p).copy_(q.to_local() if isinstance(q, DTensor) else q)
    resumed.load_state_dict(saved, optimizers=[opt_f])
    assert resumed.micro_step == 1
    assert torch.equal(resumed(fresh, opt_f, batches[1]), step(model, opt, batches[1]))
    assert _same((_full_params(fresh), _full_state(fresh, opt_f)), (_full_params(model), _full_state(model, opt)))
