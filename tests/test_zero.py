"""ZeRO data parallelism, stages 1 and 2 (the `zero` pass), against single-process eager
training: each of N gloo ranks trains the tiny GPT on its own micro-batch, and after every step
its loss is its own micro-batch's and its parameters equal eager's on the whole batch (the mean
loss); each rank keeps optimizer state for its own parameters only (about 1/N of it); the
graph holds one gradient collective and one all-gather per bucket; what is not supported yet is
refused; ranks that disagree on shapes, or never call, make the others raise. One rank's
rewrite is also compiled in a single process (`AsRank`), for what needs no other rank: four
ranks' ownership, the collectives per bucket, padding, and what is refused."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from ring_dist import run_ranks, silent_rank

from steps import clipped_step, zero_first_step
from steps import train_step as gpt_step

import graphoffload
from graphoffload.data_parallel import bucket_owners

STEPS = 3
RTOL = 2e-5
c10d = torch.ops._c10d_functional


def _gpt():
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    # fp64: the key bias's gradient is zero up to rounding, and AdamW turns fp32 rounding noise
    # of that size into lr-sized steps whichever order the ranks' sums are added in
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)).double()


def _batches(world: int, rows: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 64, (rows * world, 16), generator=g)
        out.append({"input_ids": x, "labels": torch.roll(x, -1, 1)})
    return out


def _optimizer(name, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if name == "adamw groups":   # no weight decay on biases and norms; one parameter alone, so one rank
        # owns none of its update kernel, which that rank drops
        params = [p for p in model.parameters() if p is not model.ln_f.bias]
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                                  {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 2e-2},
                                  {"params": [model.ln_f.bias], "lr": 3e-2}],
                                 lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _state_numel(opt) -> int:
    return sum(t.numel() for state in opt.state.values() for t in state.values() if t.dim())


def _train_and_compare(rank, world, stage, optimizer, step_fn=gpt_step):
    eager = _gpt()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer(optimizer, eager), _optimizer(optimizer, model)
    # small fusion buckets: the updates whose gradients' collective ends inside backward run there
    config = graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=2048))
    step = graphoffload.offload_compile(step_fn, config=config,
                                        data_parallel=graphoffload.ZeRO(stage=stage, bucket_numel=4096, timeout_s=60))
    for batch in _batches(world):
        rows = batch["input_ids"].shape[0] // world
        mine = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
        with torch.no_grad():   # the rank's own loss, from the parameters every rank holds
            own = eager(mine["input_ids"], labels=mine["labels"])
        step_fn(eager, opt_e, batch)   # the whole batch: the mean of the micro-batches' losses
        got = step(model, opt, mine)
        assert torch.allclose(got, own, rtol=RTOL, atol=0), (got, own)
        for p, q in zip(model.parameters(), eager.parameters()):   # .grad left set: the average, as DDP
            assert (p.grad is None) == (q.grad is None)
            assert p.grad is None or torch.allclose(p.grad, q.grad, rtol=RTOL, atol=RTOL * q.grad.abs().max())
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            err = ((p - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"stage {stage} {optimizer}: {name} is {err:.3g} from eager"

    # optimizer state: entries for this rank's own parameters only, about 1/N of the whole
    graph = step.last.graph
    shards = graph.notes_of("zero", "shards")[0].fields
    owned = set(shards["owned_params"])
    names = {p: n for n, p in model.named_parameters()}
    assert {names[p] for p in opt.state} == owned
    # the update kernels cover this rank's parameters, each once, and no other (a kernel of
    # others' parameters alone is dropped)
    kernels = [n for n in step.graphs["zero"].graph.nodes if getattr(n.target, "overloadpacket", None)
               in (torch.ops.aten._fused_adamw_, torch.ops.aten._fused_sgd_)]
    updated = [name for n in kernels for name in n.meta["param"]]
    assert sorted(updated) == sorted(owned)
    mine, total = _state_numel(opt), _state_numel(opt_e)
    fractions = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(fractions, torch.tensor(mine / total, dtype=torch.float32))
    assert sum(float(f) for f in fractions) == pytest.approx(1.0)   # every parameter's state on one rank
    # whole parameters are owned: a rank's share is 1/N up to the largest parameter's
    largest = max(p.numel() for p in model.parameters()) / sum(p.numel() for p in model.parameters())
    assert abs(mine / total - 1 / world) <= largest, (mine, total, largest)

    # collectives: one gradient collective and one all-gather per bucket
    targets = [n.target for n in step.graphs["final"].graph.nodes]
    buckets = shards["buckets"]
    assert buckets > 1
    assert targets.count(c10d.all_gather_into_tensor.default) == buckets
    assert targets.count(c10d.all_reduce_coalesced.default) == (buckets if stage == 1 else 0)
    assert targets.count(c10d.reduce_scatter_tensor.default) == (buckets if stage == 2 else 0)
    assert targets.count(c10d.wait_tensor.default) == buckets + (shards["params"] if stage == 1 else buckets)
    fused = [n.fields for n in graph.notes_of("fuse_optimizer", "bucket")]
    assert any(f["in_backward"] for f in fused), fused
    collective = "all-reduce" if stage == 1 else "reduce-scatter"
    assert {f.get("waits_for") for f in fused if not f["in_backward"]} <= {collective}, fused
    return mine / total


def _mismatched_shapes(rank, world):
    model = _gpt()
    opt = _optimizer("adamw", model)
    # ranks passing micro-batches of different shapes: named on every rank, nothing changed
    step = graphoffload.offload_compile(gpt_step, data_parallel=graphoffload.ZeRO(stage=1, timeout_s=60))
    rows = 2 if rank == 0 else 3
    with pytest.raises(graphoffload.StateError, match=r"ZeRO data parallelism: the ranks pass step inputs of "
                                                      r"different shapes.*rank 0: \(2, 16\).*rank 1: \(3, 16\)"):
        step(model, opt, {k: v[:rows] for k, v in _batches(world, rows=3)[0].items()})
    assert not opt.state


def _world2(rank, world):
    _mismatched_shapes(rank, world)
    fractions = [_train_and_compare(rank, world, stage, optimizer)
                 for stage, optimizer in ((1, "adamw"), (2, "adamw"), (1, "sgd"), (2, "sgd"))]
    _train_and_compare(rank, world, 1, "adamw", zero_first_step)
    _train_and_compare(rank, world, 2, "adamw groups")
    print(f"rank {rank}: optimizer state fraction {fractions[0]:.3f}")


@pytest.mark.slow   # several processes
def test_zero_stages_1_and_2_train_as_eager_world2():
    run_ranks(_world2, 2, deadline_s=400)


def _world4(rank, world):
    fraction = _train_and_compare(rank, world, 2, "adamw")
    print(f"rank {rank}: optimizer state fraction {fraction:.3f}")


@pytest.mark.slow   # several processes
def test_zero_stage_2_trains_as_eager_world4():
    run_ranks(_world4, 4, deadline_s=400)


def _first_call_with_a_short_timeout():
    model = _gpt()
    step = graphoffload.offload_compile(gpt_step, data_parallel=graphoffload.ZeRO(stage=2, timeout_s=1))
    step(model, _optimizer("adamw", model), {k: v[:2] for k, v in _batches(2)[0].items()})


@pytest.mark.slow   # several processes
def test_a_rank_that_never_calls_a_zero_step_times_out_the_others():
    run_ranks(silent_rank, 2, _first_call_with_a_short_timeout, graphoffload.RankTimeoutError,
              "ZeRO data parallelism: rank 0 of 2 waited 1 s for the other ranks to start the step", deadline_s=60)


# ---------------------------------------------------------------- single process: what is refused


def test_stage_3_is_refused_as_not_supported_yet():
    with pytest.raises(graphoffload.UnsupportedError, match="ZeRO stage 3 .* not supported yet"):
        graphoffload.ZeRO(stage=3)
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        graphoffload.ZeRO(stage=0)


@pytest.mark.parametrize("extra, named", [
    ({"offload": graphoffload.Offload()}, "offload="),
    ({"sequence_parallel": graphoffload.SequenceParallel()}, "sequence_parallel="),
    ({"accumulation_steps": 2}, "accumulation_steps > 1"),
])
def test_combinations_not_supported_yet_are_refused(extra, named):
    with pytest.raises(graphoffload.UnsupportedError, match=f"ZeRO data parallelism with {named} is not supported yet"):
        graphoffload.offload_compile(gpt_step, data_parallel=graphoffload.ZeRO(stage=2), **extra)
    with pytest.raises(graphoffload.UnsupportedError, match="not supported yet"):
        graphoffload.CompileConfig(data_parallel=graphoffload.ZeRO(), **extra)


def test_a_zero_step_outside_a_process_group_says_how_to_start_one():
    model = _gpt()
    step = graphoffload.offload_compile(gpt_step, data_parallel=graphoffload.ZeRO())
    with pytest.raises(graphoffload.UnsupportedError, match="needs torch.distributed: call "
                                                            r"torch.distributed.init_process_group\(\)"):
        step(model, _optimizer("adamw", model), {k: v[:2] for k, v in _batches(1)[0].items()})
    assert not _optimizer("adamw", model).state


def test_ownership_is_balanced_per_bucket_and_overall():
    sizes = [[4096, 64, 64, 1024, 1024, 32], [96, 96, 3072, 32], [50]]
    owners = bucket_owners(sizes, 2)
    assert owners == bucket_owners(sizes, 2)   # every rank computes the same
    for bucket, owner in zip(sizes, owners):
        assert len(owner) == len(bucket) and set(owner) <= {0, 1}
    loads = [sum(s for b, o in zip(sizes, owners) for s, r in zip(b, o) if r == rank) for rank in (0, 1)]
    assert abs(loads[0] - loads[1]) <= max(max(b) for b in sizes)
    assert bucket_owners([[5, 5, 5, 5]], 4) == [[0, 1, 2, 3]]


# ---------------------------------------------------------------- single process: the rewrite of one rank


@dataclass(frozen=True)
class AsRank(graphoffload.ZeRO):
    """ZeRO as rank `as_rank` of `as_world` sees it, without a process group: enough to compile
    (`step.compile`) and look at one rank's graph; running it would need the other ranks."""

    as_rank: int = 0
    as_world: int = 2

    @property
    def rank(self) -> int:
        return self.as_rank

    @property
    def world_size(self) -> int:
        return self.as_world

    @property
    def group_name(self) -> str:
        return "0"


def _compile_as(rank, world, stage, step_fn=gpt_step, optimizer="adamw", bucket_numel=4096, **config):
    model = _gpt().float()
    opt = _optimizer(optimizer, model)
    zero = AsRank(stage=stage, bucket_numel=bucket_numel, as_rank=rank, as_world=world)
    step = graphoffload.offload_compile(step_fn, data_parallel=zero, config=graphoffload.CompileConfig(**config))
    return step.compile(model, opt, {k: v[:2] for k, v in _batches(1)[0].items()}), model, opt


@pytest.mark.parametrize("stage", [1, 2])
def test_every_parameter_is_owned_by_one_rank_of_four_and_its_state_lives_there(stage):
    owned = []
    for rank in range(4):
        graph, model, opt = _compile_as(rank, 4, stage)
        shards = graph.notes_of("zero", "shards")[0].fields
        names = {p: n for n, p in model.named_parameters()}
        assert {names[p] for p in opt.state} == set(shards["owned_params"])   # created for its own alone
        owned.append(set(shards["owned_params"]))
        targets = [n.target for n in graph.gm.graph.nodes]
        gradient = c10d.all_reduce_coalesced.default if stage == 1 else c10d.reduce_scatter_tensor.default
        assert targets.count(gradient) == targets.count(c10d.all_gather_into_tensor.default) == shards["buckets"]
    assert set().union(*owned) == {n for n, _ in _gpt().named_parameters()}
    assert sum(map(len, owned)) == len(set().union(*owned))   # no parameter on two ranks


@pytest.mark.parametrize("stage", [1, 2])
def test_the_zero_pass_stamps_exactly_the_nodes_it_created(stage):
    from test_provenance import assert_every_node_names_its_maker

    model = _gpt().float()
    opt = _optimizer("adamw", model)
    step = graphoffload.offload_compile(gpt_step, data_parallel=AsRank(stage=stage, bucket_numel=4096))
    step.compile(model, opt, {k: v[:2] for k, v in _batches(1)[0].items()})
    assert "zero" in assert_every_node_names_its_maker(step.graphs)
    made = [n for n in step.graphs["zero"].graph.nodes if n.meta["pass"] == "zero"]
    assert any(n.target is c10d.all_gather_into_tensor.default for n in made)


def test_larger_buckets_pad_less():
    small = _compile_as(0, 4, 2, bucket_numel=4096)[0]
    large = _compile_as(0, 4, 2, bucket_numel=1 << 20)[0]
    fields = [g.notes_of("zero", "shards")[0].fields for g in (small, large)]
    assert fields[1]["buckets"] == 1 and fields[1]["padded_numel"] < 1.1 * fields[1]["numel"]
    assert fields[0]["padded_numel"] > 1.25 * fields[0]["numel"]
    assert small.notes_of("zero", "padding") and not large.notes_of("zero", "padding")


def test_clipping_is_refused_and_nothing_is_left_behind():
    model = _gpt()
    opt = _optimizer("adamw", model)
    step = graphoffload.offload_compile(clipped_step, data_parallel=AsRank(stage=1))
    with pytest.raises(graphoffload.UnsupportedError,
                       match="changed by .* between backward and optimizer.step.*not supported yet"):
        step.compile(model, opt, {k: v[:2] for k, v in _batches(1)[0].items()})
    assert not opt.state


def test_stage_2_refuses_a_step_that_leaves_grad_set():
    with pytest.raises(graphoffload.UnsupportedError, match=r"stage 2 keeps only this rank's own gradients, but "
                                                            r"the step leaves .*\.grad set.*ZeRO\(stage=1\)"):
        _compile_as(0, 2, 2, step_fn=zero_first_step)
    _compile_as(0, 2, 1, step_fn=zero_first_step)   # stage 1 leaves the averaged gradients, as DDP


def test_skip_nonfinite_is_refused():
    with pytest.raises(graphoffload.UnsupportedError, match="GradScaler or skip_nonfinite=True is not supported yet"):
        _compile_as(0, 2, 1, skip_nonfinite=True)
