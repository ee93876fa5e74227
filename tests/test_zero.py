"""ZeRO data parallelism, stages 1 and 2 (the `zero` pass), against single-process eager
training: each of N gloo ranks trains the tiny GPT on its own micro-batch, and after every step
its loss is its own micro-batch's and its parameters equal eager's on the whole batch (the mean
loss); each rank keeps optimizer state for its own parameters only (about 1/N of it); the
graph holds one gradient collective and one all-gather per bucket; what is not supported yet is
refused; ranks that disagree on shapes, or never call, make the others raise. Global-norm
clipping is run on stage 3 here too (its own tests: tests/test_zero_stage3.py). One rank's
rewrite is also compiled in a single process (`AsRank`), for what needs no other rank: four
ranks' ownership, the collectives per bucket, padding, and what is refused."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from ring_dist import run_ranks, silent_rank
from helpers import whole as _whole, zero_gpt as _gpt, zero_optimizer

from steps import clipped_step, zero_first_step
from steps import train_step as gpt_step

import graphoffload
from graphoffload.data_parallel import shard_rows
from graphoffload.torch_private import pytree

STEPS = 3
RTOL = 2e-5
c10d = torch.ops._c10d_functional


def _batches(world: int, rows: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 64, (rows * world, 16), generator=g)
        out.append({"input_ids": x, "labels": torch.roll(x, -1, 1)})
    return out


def _optimizer(name, model):
    if name == "adamw groups":   # no weight decay on biases and norms; one parameter alone, so one rank
        # owns none of its update kernel, which that rank drops
        params = [p for p in model.parameters() if p is not model.ln_f.bias]
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                                  {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0, "lr": 2e-2},
                                  {"params": [model.ln_f.bias], "lr": 3e-2}],
                                 lr=1e-2, weight_decay=0.1)
    return zero_optimizer(name, model)


def _state_numel(opt) -> int:
    """Elements of optimizer state this rank holds (a DTensor's local chunk), step counters aside."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel()
               for state in opt.state.values() for k, t in state.items() if k != "step")


def _assert_sharded_state(model, opt, rank, world):
    """Every parameter's state: DTensors of its shape over the group, Shard(0), this rank's chunk
    of `shard_rows` rows; the step counter and a 0-dim parameter's state plain tensors."""
    names = {p: n for n, p in model.named_parameters()}
    assert set(opt.state) == {p for p in model.parameters() if p.requires_grad}
    for p, state in opt.state.items():
        for key, t in state.items():
            if key == "step" or p.dim() == 0:   # replicated: plain tensors
                assert type(t) is torch.Tensor and t.dim() == 0, (names[p], key, type(t))
                continue
            assert isinstance(t, DTensor), (names[p], key, type(t))
            assert t.shape == p.shape and t.device_mesh.size() == world
            assert t.placements == (Shard(0),), (names[p], t.placements)
            assert t.to_local().shape == (shard_rows(p.shape[0], world, rank)[1], *p.shape[1:])


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

    # optimizer state: DTensors sharded Shard(0) over the group (the step counter a plain
    # tensor, as torch.optim keeps it for FSDP2), each rank holding its chunk of every parameter
    graph = step.last.graph
    shards = graph.notes_of("zero", "shards")[0].fields
    _assert_sharded_state(model, opt, rank, world)
    # the update kernels cover every parameter once, through this rank's rows of it
    kernels = [n for n in step.graphs["zero"].graph.nodes if getattr(n.target, "overloadpacket", None)
               in (torch.ops.aten._fused_adamw_, torch.ops.aten._fused_sgd_)]
    updated = [name for n in kernels for name in n.meta["param"]]
    assert sorted(updated) == sorted(n for n, _ in model.named_parameters())
    assert all(p.target is torch.ops.aten.slice.Tensor for n in kernels for p in n.args[0])
    mine, total = _state_numel(opt), _state_numel(opt_e)
    assert mine == shards["state_numel"]
    locals_ = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(locals_, torch.tensor(mine))
    assert sum(int(n) for n in locals_) == total   # the chunks partition the state: no element twice
    # every parameter split by rows: a rank's share is 1/N up to one row of each parameter
    rows = sum(p.numel() // p.shape[0] for p in model.parameters()) / sum(p.numel() for p in model.parameters())
    assert abs(mine / total - 1 / world) <= rows, (mine, total, rows)

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
    print(f"rank {rank}: optimizer state fraction {fractions[0]:.4f}")


@pytest.mark.slow   # several processes
def test_zero_stages_1_and_2_train_as_eager_world2():
    run_ranks(_world2, 2, deadline_s=400)


class _Uneven(torch.nn.Module):
    """Dims 0 that 4 ranks cannot split evenly (5 and 3 rows: chunks of 2, 2, 1, 0 and 1, 1, 1, 0)
    and a 0-dim parameter (replicated plain state, updated on every rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x, y):
        return ((self.b(torch.tanh(self.a(x))) * self.scale - y) ** 2).mean()


def _uneven_step(model, optimizer, batch):
    loss = model(batch["x"], batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _uneven_trains_as_eager(rank, world, stage):
    eager = _Uneven().double()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer("adamw", eager), _optimizer("adamw", model)
    step = graphoffload.offload_compile(_uneven_step, data_parallel=graphoffload.ZeRO(stage=stage, timeout_s=60))
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        batch = {"x": torch.randn(2 * world, 6, generator=g, dtype=torch.float64),
                 "y": torch.randn(2 * world, 3, generator=g, dtype=torch.float64)}
        _uneven_step(eager, opt_e, batch)
        step(model, opt, {k: v[2 * rank:2 * rank + 2] for k, v in batch.items()})
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            err = ((p - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"stage {stage}: {name} is {err:.3g} from eager"
    _assert_sharded_state(model, opt, rank, world)


def _world4(rank, world):
    fraction = _train_and_compare(rank, world, 2, "adamw")
    for stage in (1, 2):
        _uneven_trains_as_eager(rank, world, stage)
    print(f"rank {rank}: optimizer state fraction {fraction:.4f}")


@pytest.mark.slow   # several processes
def test_zero_stage_2_trains_as_eager_world4():
    run_ranks(_world4, 4, deadline_s=400)


MAX_NORM = 0.05   # below the tiny GPT's gradient norms (about 0.3 to 1 here): every update clips


def _clip_step(model, optimizer, batch):
    """clip_grad_norm_ as it runs on the CPU: one norm per gradient, their norm, one mul_ each."""
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    return loss, norm


def _foreach_clip_step(model, optimizer, batch):
    """clip_grad_norm_ as its foreach (GPU) path runs it: one _foreach_norm, one _foreach_mul_ (reads
    .grad itself, so not with accumulation_steps, whose accumulating calls leave .grad None)."""
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0))
    optimizer.step()
    optimizer.zero_grad()
    return loss, norm


def _clips_as_eager(rank, world, stage, optimizer, step_fn, k):
    """`step_fn` under ZeRO, `k` micro-batches a window (accumulation_steps), against eager on the
    whole batches: the same norm on every rank, eager's, and eager's parameters."""
    eager = _gpt()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer(optimizer, eager), _optimizer(optimizer, model)
    step = graphoffload.offload_compile(step_fn, accumulation_steps=k,
                                        data_parallel=graphoffload.ZeRO(stage=stage, bucket_numel=4096, timeout_s=60))
    batches = _batches(world)
    for start in range(0, len(batches) - k + 1, k):
        for batch in batches[start:start + k]:
            rows = batch["input_ids"].shape[0] // world
            (eager(batch["input_ids"], labels=batch["labels"]) / k).backward()
            _, norm = step(model, opt, {key: v[rank * rows:(rank + 1) * rows] for key, v in batch.items()})
        want = torch.nn.utils.clip_grad_norm_(eager.parameters(), MAX_NORM)
        opt_e.step()
        opt_e.zero_grad()
        assert want > 2 * MAX_NORM   # the update clipped
        norms = [torch.zeros((), dtype=norm.dtype) for _ in range(world)]
        dist.all_gather(norms, norm.detach())
        assert all(torch.equal(n, norms[0]) for n in norms), norms   # one value on every rank
        assert torch.allclose(norm, want, rtol=RTOL, atol=0), (norm, want)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            err = ((_whole(p) - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"stage {stage} {optimizer} {step_fn.__name__} k={k}: {name} is {err:.3g} from eager"
    graph = step.last.graph
    assert graph.notes_of("zero", "clip")
    targets = [n.target for n in graph.gm.graph.nodes]
    assert targets.count(c10d.all_reduce.default) == 1   # the norm's squares: one scalar all-reduce


def _uneven_clip_step(model, optimizer, batch):
    loss = model(batch["x"], batch["y"])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    return norm


def _uneven_clips_as_eager(rank, world, stage):
    """Uneven chunks (rank 1 holds fewer rows) and a 0-dim parameter, whose whole gradient every
    rank holds: counted once in the global norm."""
    eager = _Uneven().double()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer("adamw", eager), _optimizer("adamw", model)
    step = graphoffload.offload_compile(_uneven_clip_step, data_parallel=graphoffload.ZeRO(stage=stage, timeout_s=60))
    for batch in _uneven_batches():
        want = _uneven_clip_step(eager, opt_e, batch)
        norm = step(model, opt, _micro(batch, rank, world))
        assert want > 2 * MAX_NORM
        norms = [torch.zeros((), dtype=norm.dtype) for _ in range(world)]
        dist.all_gather(norms, norm)
        assert all(torch.equal(n, norms[0]) for n in norms), norms
        assert torch.allclose(norm, want, rtol=RTOL, atol=0), (norm, want)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            err = ((_whole(p) - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"stage {stage}: {name} is {err:.3g} from eager"


def _clipping_world2(rank, world):
    for stage, optimizer, step_fn, k in ((1, "adamw", _clip_step, 1), (2, "sgd", _foreach_clip_step, 1),
                                         (2, "adamw", _clip_step, 3), (1, "sgd", _clip_step, 3),
                                         (3, "adamw", _foreach_clip_step, 1), (3, "sgd", _clip_step, 2)):
        _clips_as_eager(rank, world, stage, optimizer, step_fn, k)
    for stage in (1, 2, 3):
        _uneven_clips_as_eager(rank, world, stage)


@pytest.mark.slow   # several processes
def test_clip_grad_norm_under_zero_uses_the_global_norm_world2():
    run_ranks(_clipping_world2, 2, deadline_s=300)


def _full(model, opt) -> dict:
    """Parameters and optimizer state, whole (DTensors gathered: a collective on every rank)."""
    names = {p: n for n, p in model.named_parameters()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": {names[p]: {k: t.full_tensor() if isinstance(t, DTensor) else t.clone() for k, t in s.items()}
                      for p, s in sorted(opt.state.items(), key=lambda item: names[item[0]])}}


def _dcp_step(world):
    return graphoffload.offload_compile(_uneven_step, data_parallel=graphoffload.ZeRO(stage=2, timeout_s=60))


def _uneven_batches() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(4, 6, generator=g, dtype=torch.float64),
             "y": torch.randn(4, 3, generator=g, dtype=torch.float64)} for _ in range(STEPS)]


def _micro(batch, rank, world):
    rows = batch["x"].shape[0] // world
    return {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}


def _load_dcp(rank, world, path):
    """A fresh model (other values), optimizer and step, compiled first so the state to load into
    is this world's DTensors; DCP reads each rank's chunks into them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    model = _Uneven().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt, step = _optimizer("adamw", model), _dcp_step(world)
    step.compile(model, opt, _micro(_uneven_batches()[2], rank, world))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return model, opt, step


def _dcp_world2(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _Uneven().double()
    opt, step = _optimizer("adamw", model), _dcp_step(world)
    batches = _uneven_batches()
    for batch in batches[:2]:
        step(model, opt, _micro(batch, rank, world))
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    saved = _full(model, opt)
    loss = step(model, opt, _micro(batches[2], rank, world))
    after = _full(model, opt)
    if rank == 0:
        torch.save({"saved": saved, "after": after}, f"{path}/full.pt")

    model, opt, step = _load_dcp(rank, world, path)
    _assert_sharded_state(model, opt, rank, world)
    assert _same(_full(model, opt), saved)
    resumed = step(model, opt, _micro(batches[2], rank, world))
    assert torch.equal(resumed, loss)
    assert _same(_full(model, opt), after)   # bit-identical to the run that went on


def _dcp_world4(rank, world, path):
    full = torch.load(f"{path}/full.pt")
    model, opt, step = _load_dcp(rank, world, path)
    _assert_sharded_state(model, opt, rank, world)
    assert _same(_full(model, opt), full["saved"])   # resharded from 2 chunks to 4, every value as saved
    step(model, opt, _micro(_uneven_batches()[2], rank, world))   # the same global batch, in 4 micro-batches
    got = _full(model, opt)
    for name, p in full["after"]["params"].items():   # as the world-2 run went on, up to summation order
        err = ((got["params"][name] - p).abs().max() / p.abs().max()).item()
        assert err <= RTOL, f"{name} is {err:.3g} from the world-2 run"


def _same(a: dict, b: dict) -> bool:
    flat_a, flat_b = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(flat_a) == len(flat_b) and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


@pytest.mark.slow   # several processes
def test_a_dcp_checkpoint_resumes_bit_identically_and_reshards_from_2_ranks_to_4(tmp_path):
    run_ranks(_dcp_world2, 2, str(tmp_path), deadline_s=300)
    run_ranks(_dcp_world4, 4, str(tmp_path), deadline_s=300)


def _first_call_with_a_short_timeout():
    """The timeout of the check every call starts with breaks the step too: the check's gather is
    left pending (rank 1's late answer pairs with it), so a retry's collectives would pair with
    rank 1's older ones. The retry raises StateError at once, with no collective and nothing
    changed; then the timeout is raised again for `silent_rank` to check."""
    model = _gpt()
    opt = _optimizer("adamw", model)
    step = graphoffload.offload_compile(gpt_step, data_parallel=graphoffload.ZeRO(stage=2, timeout_s=1))
    batch = {k: v[:2] for k, v in _batches(2)[0].items()}
    with pytest.raises(graphoffload.RankTimeoutError) as info:
        step(model, opt, batch)
    before = [p.detach().clone() for p in model.parameters()]
    start = time.monotonic()
    with pytest.raises(graphoffload.StateError, match="refusing to run .*RankTimeoutError.* restart the job") as refused:
        step(model, opt, batch)
    took = time.monotonic() - start
    assert took < 0.5, took   # no wait: timeout_s is 1 s
    print(f"after the input check's RankTimeoutError: the retry refused in {took * 1e3:.2f} ms")
    assert refused.value.__cause__ is info.value and not opt.state
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    raise info.value


@pytest.mark.slow   # several processes
def test_a_rank_that_never_calls_a_zero_step_times_out_the_others():
    run_ranks(silent_rank, 2, _first_call_with_a_short_timeout, graphoffload.RankTimeoutError,
              "ZeRO data parallelism: rank 0 of 2 waited 1 s for the other ranks to start the step", deadline_s=60)


# ---------------------------------------------------------------- single process: what is refused


def test_a_stage_other_than_1_2_or_3_is_refused():
    for stage in (0, 4):
        with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
            graphoffload.ZeRO(stage=stage)


def test_a_zero_step_outside_a_process_group_says_how_to_start_one():
    model = _gpt()
    step = graphoffload.offload_compile(gpt_step, data_parallel=graphoffload.ZeRO())
    with pytest.raises(graphoffload.UnsupportedError, match="needs torch.distributed: call "
                                                            r"torch.distributed.init_process_group\(\)"):
        step(model, _optimizer("adamw", model), {k: v[:2] for k, v in _batches(1)[0].items()})
    assert not _optimizer("adamw", model).state


def test_shard_rows_split_dim_0_as_torch_chunk():
    for rows in range(10):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(world)
            expected = [(int(c[0]), len(c)) if len(c) else (rows, 0) for c in chunks]
            expected += [(rows, 0)] * (world - len(chunks))   # torch.chunk returns fewer: the last ranks' are empty
            assert [shard_rows(rows, world, r) for r in range(world)] == expected, (rows, world)


# ---------------------------------------------------------------- single process: the rewrite of one rank


@dataclass(frozen=True)
class AsRank(graphoffload.ZeRO):
    """ZeRO as rank `as_rank` of `as_world` sees it, inside a group of this process alone
    (`one_process_group`): enough to compile (`step.compile`) and look at one rank's graph and
    state (a DTensor over the one-process mesh, holding this rank's chunk); running it would
    need the other ranks."""

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


def _compile_as(rank, world, stage, step_fn=gpt_step, optimizer="adamw", bucket_numel=4096, model=None, batch=None,
                **config):
    model = _gpt().float() if model is None else model
    opt = _optimizer(optimizer, model)
    zero = AsRank(stage=stage, bucket_numel=bucket_numel, as_rank=rank, as_world=world)
    step = graphoffload.offload_compile(step_fn, data_parallel=zero, config=graphoffload.CompileConfig(**config))
    batch = {k: v[:2] for k, v in _batches(1)[0].items()} if batch is None else batch
    return step.compile(model, opt, batch), model, opt


def _local_rows(opt, p):
    return {k: t.to_local().shape[0] for k, t in opt.state[p].items() if k != "step"}


@pytest.mark.parametrize("stage", [1, 2])
def test_four_ranks_each_hold_their_rows_of_every_parameters_state(stage, one_process_group):
    rows = {}
    for rank in range(4):
        graph, model, opt = _compile_as(rank, 4, stage)
        shards = graph.notes_of("zero", "shards")[0].fields
        for name, p in model.named_parameters():
            local = _local_rows(opt, p)
            assert set(local) == {"exp_avg", "exp_avg_sq"} and len(set(local.values())) == 1
            assert all(isinstance(t, DTensor) and t.shape == p.shape for k, t in opt.state[p].items() if k != "step")
            rows.setdefault(name, []).append(local["exp_avg"])
        assert shards["state_numel"] == _state_numel(opt)
        targets = [n.target for n in graph.gm.graph.nodes]
        gradient = c10d.all_reduce_coalesced.default if stage == 1 else c10d.reduce_scatter_tensor.default
        assert targets.count(gradient) == targets.count(c10d.all_gather_into_tensor.default) == shards["buckets"]
    for name, p in _gpt().named_parameters():   # the ranks' chunks tile dim 0, none twice
        assert rows[name] == [shard_rows(p.shape[0], 4, r)[1] for r in range(4)], name
        assert sum(rows[name]) == p.shape[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_zero_pass_stamps_exactly_the_nodes_it_created(stage, one_process_group):
    from test_provenance import assert_every_node_names_its_maker

    model = _gpt().float()
    opt = _optimizer("adamw", model)
    step = graphoffload.offload_compile(gpt_step, data_parallel=AsRank(stage=stage, bucket_numel=4096))
    step.compile(model, opt, {k: v[:2] for k, v in _batches(1)[0].items()})
    assert "zero" in assert_every_node_names_its_maker(step.graphs)
    made = [n for n in step.graphs["zero"].graph.nodes if n.meta["pass"] == "zero"]
    assert any(n.target is c10d.all_gather_into_tensor.default for n in made)


def test_uneven_rows_are_padded_per_chunk_and_an_empty_chunk_still_has_state(one_process_group):
    uneven = {"x": torch.randn(2, 6), "y": torch.randn(2, 3)}
    graph, model, opt = _compile_as(3, 4, 2, step_fn=_uneven_step, model=_Uneven(), batch=uneven)
    fields = graph.notes_of("zero", "shards")[0].fields
    # a.weight 5x6 in chunks of 2 rows, a.bias 5 of 2, b.weight 3x5 of 1, b.bias 3 of 1, scale: 1 a rank
    assert fields["padded_numel"] == 4 * (12 + 2 + 5 + 1 + 1) and fields["numel"] == 30 + 5 + 15 + 3 + 1
    assert graph.notes_of("zero", "padding")
    # rank 3 of 4 holds no row of any (its chunks are empty) but keeps state of every parameter
    assert {n: _local_rows(opt, p).get("exp_avg") for n, p in model.named_parameters() if p.dim()} == \
        {"a.weight": 0, "a.bias": 0, "b.weight": 0, "b.bias": 0}
    assert type(opt.state[model.scale]["exp_avg"]) is torch.Tensor   # 0-dim: replicated, plain
    gpt = _compile_as(0, 4, 2, bucket_numel=1 << 20)[0].notes_of("zero", "shards")[0].fields
    assert gpt["padded_numel"] == gpt["numel"]   # the GPT's dims 0 divide by 4: no padding


def test_full_state_loaded_before_the_first_call_is_narrowed_to_this_ranks_chunk(one_process_group):
    model = _gpt().float()
    opt = _optimizer("adamw", model)
    batch = {k: v[:2] for k, v in _batches(1)[0].items()}
    gpt_step(model, opt, batch)   # eager: full, plain state (as a full optimizer.load_state_dict leaves)
    full = {p: {k: t.clone() for k, t in s.items()} for p, s in opt.state.items()}
    zero = AsRank(stage=2, bucket_numel=4096, as_rank=1, as_world=2)
    graphoffload.offload_compile(gpt_step, data_parallel=zero).compile(model, opt, batch)
    for p, state in opt.state.items():
        start, rows = shard_rows(p.shape[0], 2, 1)
        assert torch.equal(state["step"], full[p]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor)
            assert torch.equal(state[key].to_local(), full[p][key][start:start + rows])


def _inf_norm_clipped_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=float("inf"))
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _clipped_keeping_grad_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    return loss


def _grad_doubling_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    for p in model.parameters():
        p.grad.add_(p.grad)
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("step_fn, stage, match", [
    (_inf_norm_clipped_step, 2, r"read by .* besides optimizer.step\(\).*clip_grad_norm_ \(L2 norm\).*not supported yet"),
    (_inf_norm_clipped_step, 3, r"read by .* besides optimizer.step\(\).*clip_grad_norm_ \(L2 norm\).*not supported yet"),
    (_clipped_keeping_grad_step, 1, r"stage 1 with clip_grad_norm_ and .grad left set.*zero_grad\(\) at the end"),
    (_clipped_keeping_grad_step, 2, r"stage 2 with clip_grad_norm_ and .grad left set.*zero_grad\(\) at the end"),
    (_grad_doubling_step, 1, r"changed by .* between backward and optimizer.step\(\).*not supported yet"),
])
def test_gradient_reads_zero_cannot_shard_are_refused_and_nothing_is_left_behind(step_fn, stage, match,
                                                                                 one_process_group):
    model = _gpt()
    opt = _optimizer("adamw", model)
    step = graphoffload.offload_compile(step_fn, data_parallel=AsRank(stage=stage))
    with pytest.raises(graphoffload.UnsupportedError, match=match):
        step.compile(model, opt, {k: v[:2] for k, v in _batches(1)[0].items()})
    assert not opt.state


@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_makes_one_scalar_all_reduce_after_the_gradient_collectives(stage, one_process_group):
    graph = _compile_as(1, 2, stage, step_fn=clipped_step)[0]
    nodes = list(graph.gm.graph.nodes)
    gradient = c10d.all_reduce_coalesced.default if stage == 1 else c10d.reduce_scatter_tensor.default
    norm = [i for i, n in enumerate(nodes) if n.target is c10d.all_reduce.default]
    assert len(norm) == 1 and nodes[norm[0]].meta["val"].dim() == 0
    assert max(i for i, n in enumerate(nodes) if n.target is gradient) < norm[0]
    fields = graph.notes_of("zero", "clip")[0].fields
    assert fields["terms"] == fields["scales"] == len(list(_gpt().parameters()))


def test_stage_2_refuses_a_step_that_leaves_grad_set(one_process_group):
    with pytest.raises(graphoffload.UnsupportedError, match=r"stage 2 keeps only this rank's own gradients, but "
                                                            r"the step leaves .*\.grad set.*ZeRO\(stage=1\)"):
        _compile_as(0, 2, 2, step_fn=zero_first_step)
    _compile_as(0, 2, 1, step_fn=zero_first_step)   # stage 1 leaves the averaged gradients, as DDP


def test_full_state_loaded_after_the_step_compiled_is_refused_with_what_to_do(one_process_group):
    model = _gpt().float()
    opt = _optimizer("adamw", model)
    batch = {k: v[:2] for k, v in _batches(1)[0].items()}
    step = graphoffload.offload_compile(gpt_step, data_parallel=AsRank(stage=2, bucket_numel=4096))
    step.compile(model, opt, batch)
    p = model.lm_head.weight if hasattr(model, "lm_head") else next(model.parameters())
    opt.state[p]["exp_avg"] = torch.zeros_like(p)   # as a full optimizer.load_state_dict leaves it
    # refused while the step binds its inputs, before it runs (one rank of two cannot run here)
    with pytest.raises(graphoffload.StateError, match=r"plain tensor of the whole parameter's shape .* load a full "
                                                      r"optimizer state_dict before the step compiles"):
        step.last.executor.inputs((model, opt, batch), {})
