"""A GradScaler and CompileConfig(skip_nonfinite=True) under ZeRO stages 1, 2 and 3 (issue 16):
the decision to skip an update is made over the whole averaged gradient and every rank's loss,
so every rank skips or applies the same update and a GradScaler's scale evolves alike.

Two gloo ranks train a tiny fp32 model on their own micro-batches against single-process eager
training on the whole batch. The GradScaler run has a step where rank 0's micro-batch overflows
one gradient row that rank 1 owns: rank 0's own chunks stay finite, so only combining the flags
makes it skip with rank 1 (and with eager). The skip_nonfinite run has a step whose loss is inf
on rank 1 alone (its gradients finite): rank 0 must skip too. One rank's rewrite is also compiled
in a single process (`AsRank`) for the graph's shape and what is refused.

With `offload=` (ZeRO-Offload) the same runs update each rank's chunks on the host (or, with
`device_updates=1`, on the device from host state): the host updates must read the flag combined
over the group, or rank 0 would update its finite chunks on the poisoned step that eager skips.
With `accumulation_steps` and host sums (`Offload(accumulate_on="host")`) the inf checks of the
accumulated chunks run on the host (`host_unscale_`), and the window rank 0 poisons in a row rank 1
owns must still be skipped by both: rank 1's host flag joins its device flag before the group's max."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from ring_dist import run_ranks
from helpers import loss_steps, nonfinite_eagerly
from test_zero import AsRank, _Uneven, _whole
from test_zero_stage3 import _ancestors

import graphoffload

c10d = torch.ops._c10d_functional
RTOL = 2e-5
POISONED = 2   # the (first) step whose batch is not finite


def _loss(model, batch):
    """The model's loss, plus `offset` (an inf offset makes the loss inf, the gradients finite)
    and a term adding 0 whose gradient is `poison` in the last row of a.weight (rank 1's rows)."""
    row = model.a.weight[-1]
    return model(batch["x"], batch["y"]) + batch["offset"].mean() + batch["poison"].mean() * (row - row.detach()).sum()


plain_step, scaled_step, eager_skipping_step = loss_steps(_loss)


def scaled_clipped_step(model, optimizer, scaler, batch):
    loss = _loss(model, batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)   # unscales this rank's chunks in place
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss


def _batches(world: int, poison: dict[int, dict[str, tuple[int, float]]], steps: int = 5) -> list[dict]:
    """Whole batches of 2 rows a rank; `poison[step]` maps a key ("offset" or "poison") to (the
    rank whose rows get it, the value)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(steps):
        batch = {"x": torch.randn(2 * world, 6, generator=g), "y": torch.randn(2 * world, 3, generator=g),
                 "offset": torch.zeros(2 * world), "poison": torch.zeros(2 * world)}
        for key, (rank, value) in poison.get(i, {}).items():
            batch[key][2 * rank:2 * rank + 2] = value
        out.append(batch)
    return out


def _micro(batch: dict, rank: int) -> dict:
    return {k: v[2 * rank:2 * rank + 2] for k, v in batch.items()}


def _assert_like_eager(model, eager, what) -> float:
    """The largest relative error of a parameter, after asserting it is within RTOL."""
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        err = ((_whole(p) - q).abs().max() / q.abs().max()).item()
        assert err <= RTOL, f"{what}: {name} is {err:.3g} from eager"
        worst = max(worst, err)
    return worst


def _same_on_every_rank(value: torch.Tensor, world: int) -> bool:
    values = [torch.zeros_like(value) for _ in range(world)]
    dist.all_gather(values, value)
    return all(torch.equal(v, values[0]) for v in values)


def _assert_offloaded(targets: list, offload) -> None:
    """With `offload=`, the update ran where `device_updates` says: every bucket on the host
    ("never"), or on the device with its state prefetched from the host (1). With host sums the
    inf checks ran on the host too (and only their flags come back to the device)."""
    if offload is None:
        return
    host = torch.ops.graphoffload.host_adam_.default in targets
    if offload.accumulate_on == "host":
        assert host and torch.ops.graphoffload.host_unscale_.default in targets
        assert torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default not in targets
        return
    prefetched = torch.ops.graphoffload.prefetch_to_device.default in targets
    assert (host, prefetched) == ((True, False) if offload.device_updates == "never" else (False, True))


def _scaler_as_eager(rank, world, stage, step_fn=scaled_step, offload=None):
    eager = _Uneven()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    scaler_e, scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) for _ in range(2))
    step = graphoffload.offload_compile(step_fn, offload=offload,
                                        data_parallel=graphoffload.ZeRO(stage=stage, timeout_s=60))
    # 1e37 * 2**8 overflows fp32: rank 0's gradient of a.weight's last row is inf, so is the
    # average's, whose row rank 1 holds; eager's (the mean over 4 rows, 5e36 * 2**8) too
    scales, worst = [], 0.0
    for i, batch in enumerate(_batches(world, {POISONED: {"poison": (0, 1e37)}})):
        before = copy.deepcopy(_whole(model.a.weight).detach())
        step_fn(eager, opt_e, scaler_e, batch)
        step(model, opt, scaler, _micro(batch, rank))
        scales.append(scaler.get_scale())
        assert scaler.get_scale() == scaler_e.get_scale(), (stage, i, scaler.get_scale(), scaler_e.get_scale())
        if i == POISONED:
            assert torch.equal(_whole(model.a.weight), before)   # skipped on every rank
        worst = max(worst, _assert_like_eager(model, eager, f"stage {stage} {step_fn.__name__} step {i}"))
        assert _same_on_every_rank(scaler._scale, world) and _same_on_every_rank(scaler._growth_tracker, world)
    assert scales[POISONED] == scales[POISONED - 1] / 2   # the skipped step backed the scale off
    assert max(scales) > 2.0**8                            # growth_interval=2: the clean steps grew it
    assert all(s["step"].item() == 4 for s in opt.state.values())   # 5 calls, one skipped
    graph = step.last.graph
    assert graph.notes_of("zero", "nonfinite")[0].fields["checks"] >= 1
    targets = [n.target for n in graph.gm.graph.nodes]
    _assert_offloaded(targets, offload)
    # found_inf: one scalar all-reduce (and clipping's norm one more)
    assert targets.count(c10d.all_reduce.default) == 1 + (step_fn is scaled_clipped_step)
    print(f"rank {rank} stage {stage} {step_fn.__name__}: largest relative error {worst:.3g}")


def _accumulating_scaler_as_eager(rank, world, stage, k=2, offload=None):
    """accumulation_steps=k: the scaler unscales, checks and steps once a window, on the sums; a
    window in which rank 0's first micro-batch overflows a row rank 1 holds is skipped by both."""
    eager = _Uneven()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    scaler_e, scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) for _ in range(2))
    step = graphoffload.offload_compile(scaled_step, accumulation_steps=k, offload=offload,
                                        data_parallel=graphoffload.ZeRO(stage=stage, timeout_s=60))
    batches = _batches(world, {k: {"poison": (0, 1e37)}}, steps=3 * k)   # the second window's first
    scales, worst = [], 0.0
    for start in range(0, len(batches), k):
        for batch in batches[start:start + k]:
            scaler_e.scale(_loss(eager, batch) / k).backward()
            step(model, opt, scaler, _micro(batch, rank))
        scaler_e.step(opt_e)
        scaler_e.update()
        opt_e.zero_grad()
        assert scaler.get_scale() == scaler_e.get_scale(), (stage, start, scaler.get_scale(), scaler_e.get_scale())
        scales.append(scaler.get_scale())
        worst = max(worst, _assert_like_eager(model, eager, f"stage {stage} k={k} window {start // k}"))
    assert scales[1] == scales[0] / 2 and all(s["step"].item() == 2 for s in opt.state.values())
    _assert_offloaded([n.target for n in step.last.graph.gm.graph.nodes], offload)
    print(f"rank {rank} stage {stage} accumulation_steps={k} GradScaler: largest relative error {worst:.3g}")


def _skip_as_eager(rank, world, stage, offload=None):
    eager = _Uneven()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = graphoffload.offload_compile(plain_step, config=graphoffload.CompileConfig(skip_nonfinite=True),
                                        offload=offload, data_parallel=graphoffload.ZeRO(stage=stage, timeout_s=60))
    # the step after: rank 0's gradient of a.weight's last row is 1e20 (the loss finite), whose
    # average's row rank 1 holds; the global norm (and eager's on the whole batch) overflows fp32
    worst = 0.0
    bad = {POISONED: {"offset": (1, float("inf"))}, POISONED + 1: {"poison": (0, 1e20)}}
    for i, batch in enumerate(_batches(world, bad)):
        state = {p: {k: _whole(t).clone() for k, t in s.items()} for p, s in opt.state.items()}
        params = [_whole(p).detach().clone() for p in model.parameters()]
        loss = step(model, opt, _micro(batch, rank))
        assert torch.isfinite(loss) == (i != POISONED or rank != 1)   # the rank's own loss
        assert eager_skipping_step(eager, opt_e, batch) == (i in bad)   # on the whole batch
        if i in bad:   # nothing changed
            for p, q in zip(model.parameters(), params):
                assert torch.equal(_whole(p), q)
            for p, s in opt.state.items():
                assert all(torch.equal(_whole(t), state[p][k]) for k, t in s.items())
        worst = max(worst, _assert_like_eager(model, eager, f"stage {stage} skip_nonfinite step {i}"))
        skipped = torch.tensor(step.skipped_steps)
        assert step.skipped_steps == sum(j <= i for j in bad) and _same_on_every_rank(skipped, world)
    assert all(s["step"].item() == 3 for s in opt.state.values())
    _assert_offloaded([n.target for n in step.last.graph.gm.graph.nodes], offload)
    print(f"rank {rank} stage {stage} skip_nonfinite: largest relative error {worst:.3g}")


def eager_skipping_window(model, optimizer, window: list[dict]) -> list[bool]:
    """skip_nonfinite with accumulation_steps=k, eagerly, as a single-process compiled step does
    it: each call's flag is its loss's finiteness, the updating call's also the fp32 global norm
    of the accumulated gradients; a flagged accumulating call is counted and its gradients stay
    in the sums, a flagged updating call skips step(). Returns each call's flag."""
    k, flags = len(window), []
    for j, batch in enumerate(window):
        loss = _loss(model, batch)
        (loss / k).backward()
        bad = not torch.isfinite(loss)
        if j == k - 1:
            bad = nonfinite_eagerly(loss, model)   # the loss, or the accumulated gradients' norm
            if not bad:
                optimizer.step()
            optimizer.zero_grad()
        flags.append(bool(bad))
    return flags


def _accumulating_skip_as_eager(rank, world, stage, k=2):
    """skip_nonfinite with accumulation_steps=k: the second window's first call has an inf loss
    on rank 1 alone (counted by both ranks, the window's update applied, as in one process); the
    third window's first call overflows, on rank 0, a gradient row rank 1 holds after the
    reduce-scatter (the loss finite): the sums carry it to the updating call, which both skip."""
    eager = _Uneven()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = graphoffload.offload_compile(plain_step, accumulation_steps=k,
                                        config=graphoffload.CompileConfig(skip_nonfinite=True),
                                        data_parallel=graphoffload.ZeRO(stage=stage, timeout_s=60))
    bad = {k: {"offset": (1, float("inf"))}, 2 * k: {"poison": (0, 1e21)}}
    batches = _batches(world, bad, steps=3 * k)
    flags, worst = [], 0.0
    for start in range(0, len(batches), k):
        params = [_whole(p).detach().clone() for p in model.parameters()]
        for batch in batches[start:start + k]:
            step(model, opt, _micro(batch, rank))
        flags += eager_skipping_window(eager, opt_e, batches[start:start + k])
        skipped = torch.tensor(step.skipped_steps)
        assert step.skipped_steps == sum(flags) and _same_on_every_rank(skipped, world), (stage, start, flags)
        if flags[-1]:   # the window's update skipped on every rank
            assert all(torch.equal(_whole(p), q) for p, q in zip(model.parameters(), params))
        worst = max(worst, _assert_like_eager(model, eager, f"stage {stage} skip_nonfinite k={k} window {start // k}"))
    assert flags == [i in (k, 3 * k - 1) for i in range(3 * k)], flags
    assert all(s["step"].item() == 2 for s in opt.state.values())
    print(f"rank {rank} stage {stage} accumulation_steps={k} skip_nonfinite: largest relative error {worst:.3g}")


def _world2(rank, world):
    for stage in (1, 2, 3):
        _scaler_as_eager(rank, world, stage)
        _skip_as_eager(rank, world, stage)
    _scaler_as_eager(rank, world, 2, scaled_clipped_step)
    _accumulating_scaler_as_eager(rank, world, 2)
    _accumulating_scaler_as_eager(rank, world, 3, k=3)
    for stage in (1, 3):
        _accumulating_skip_as_eager(rank, world, stage)
    # ZeRO-Offload: this rank's chunks updated on the host, or on the device from host state
    host = graphoffload.Offload(device_updates="never")
    for stage in (1, 2, 3):
        _scaler_as_eager(rank, world, stage, offload=host)
        _skip_as_eager(rank, world, stage, offload=host)
    _scaler_as_eager(rank, world, 2, offload=graphoffload.Offload(device_updates=1))
    _scaler_as_eager(rank, world, 2, scaled_clipped_step, offload=host)
    _accumulating_scaler_as_eager(rank, world, 2, offload=host)
    _accumulating_scaler_as_eager(rank, world, 2, offload=graphoffload.Offload(device_updates="never",
                                                                               accumulate_on="host"))


@pytest.mark.slow   # two processes
def test_grad_scaler_and_skip_nonfinite_decide_over_the_group_world2():
    run_ranks(_world2, 2, deadline_s=300)


# ---------------------------------------------------------------- single process: one rank's rewrite


def _compile(stage, step_fn, *extra, rank=1, **config):
    model = _Uneven()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = graphoffload.offload_compile(step_fn, data_parallel=AsRank(stage=stage, as_rank=rank, as_world=2),
                                        config=graphoffload.CompileConfig(**config))
    return step.compile(model, opt, *extra, _micro(_batches(2, {})[0], rank)), opt


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_found_inf_is_combined_after_the_checks_of_the_chunks_and_read_by_every_update(stage, one_process_group):
    graph, _ = _compile(stage, scaled_step, torch.amp.GradScaler("cpu"))
    nodes = list(graph.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    gradient = c10d.all_reduce_coalesced.default if stage == 1 else c10d.reduce_scatter_tensor.default
    (flag,) = [n for n in nodes if n.target is c10d.all_reduce.default]
    assert flag.args[1] == "max" and flag.meta["val"].dim() == 0
    checks = [n for n in nodes if n.target is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default]
    # every check reads this rank's chunks (no gradient of a parameter's whole shape) and comes
    # after the gradient collectives, before the combined flag
    assert checks and all(index[c] < index[flag] for c in checks)
    assert max(index[n] for n in nodes if n.target is gradient) < index[flag]
    agreed = next(iter(flag.users)).users   # the wait's readers
    kernels = [n for n in nodes if n.target is torch.ops.aten._fused_adamw_.tensor_lr]
    assert kernels and all(index[k] > index[flag] for k in kernels)
    assert any(n.target is torch.ops.aten._amp_update_scale_.default for n in agreed)
    fields = graph.notes_of("zero", "nonfinite")[0].fields
    # one foreach check as traced, split into one per gradient by fuse_optimizer
    assert fields["checks"] == 1 and len(checks) == 5
    assert len(fields["flags"]) == 1 and not fields["skip_nonfinite"]


@pytest.mark.parametrize("stage", [1, 3])
def test_the_skip_flag_the_step_returns_is_combined_over_the_group(stage, one_process_group):
    graph, _ = _compile(stage, plain_step, skip_nonfinite=True)
    nodes = list(graph.gm.graph.nodes)
    # the flag's gradient norm made global as clipping's (its square summed), then the flag the
    # rank's own loss also sets combined by its maximum
    norm, flag = [n for n in nodes if n.target is c10d.all_reduce.default]
    assert norm.args[1] == "sum" and flag.args[1] == "max" and norm.meta["val"].dim() == 0
    assert norm in _ancestors(flag)
    output = nodes[-1]
    skipped = [v for spec, v in zip(graph.signature.outputs, output.args[0]) if spec.kind == "skipped"]
    assert skipped[0].target is c10d.wait_tensor.default and skipped[0].args[0] is flag
    # the flag's norms read this rank's chunks: rank 1 holds 2 of a.weight's 5 rows
    norms = [n for n in nodes if n.target is torch.ops.aten.linalg_vector_norm.default
             and n.args[0].meta["val"].shape[1:] == (6,)]
    assert norms and all(n.args[0].meta["val"].shape[0] == 2 for n in norms)


def _reached_avoiding(node: torch.fx.Node, wall: torch.fx.Node) -> set[torch.fx.Node]:
    """`node`'s ancestors reached without passing through `wall`."""
    seen, todo = set(), [node]
    while todo:
        for n in todo.pop().all_input_nodes:
            if n not in seen and n is not wall:
                seen.add(n)
                todo.append(n)
    return seen


@pytest.mark.parametrize("stage,skip", [(1, False), (2, False), (2, True)])
def test_with_offload_the_host_updates_read_the_flag_combined_over_the_group(stage, skip, one_process_group):
    """ZeRO-Offload: the host update of this rank's chunks takes its `found_inf` from a host
    copy of the combined flag (the wait of the "max" all-reduce), never of the rank's own."""
    if skip:
        graph, _ = _compile(stage, plain_step, skip_nonfinite=True, offload=graphoffload.Offload(device_updates="never"))
    else:
        model = _Uneven()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        step = graphoffload.offload_compile(scaled_step, offload=graphoffload.Offload(device_updates="never"),
                                            data_parallel=AsRank(stage=stage, as_rank=1, as_world=2))
        graph = step.compile(model, opt, torch.amp.GradScaler("cpu"), _micro(_batches(2, {})[0], 1))
    nodes = list(graph.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    (flag,) = [n for n in nodes if n.target is c10d.all_reduce.default and n.args[1] == "max"]
    agreed = next(iter(flag.users))
    updates = [n for n in nodes if n.target is torch.ops.graphoffload.host_adam_.default]
    assert updates and not any(n.target is torch.ops.aten._fused_adamw_.tensor_lr for n in nodes)
    for update in updates:
        host_flag = update.args[-2]   # found_inf
        (copy,) = [n for n in nodes if n.target is torch.ops.graphoffload.copy_to_host.default
                   and host_flag in n.args[1]]
        source = copy.args[0][copy.args[1].index(host_flag)]
        # the combined flag itself, or (a GradScaler's step) its sum over the devices, which
        # reads no inf check but through the combined flag
        checks = {n for n in nodes if n.target is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default}
        assert source is agreed or (agreed in _ancestors(source) and not checks & _reached_avoiding(source, agreed))
        assert index[agreed] < index[copy] < index[update]
    assert graph.notes_of("zero", "nonfinite")[0].fields["skip_nonfinite"] == skip


def test_accumulating_call_of_stage_3_with_a_grad_scaler_shards_the_parameters_its_update_updates(
        one_process_group):
    """The cause of stage 3 + accumulation + a GradScaler drifting from eager after the first
    window: `scaler.step(opt)`, a no-op on the accumulating call, did not count `opt` as stepped,
    so that call sharded no parameter and kept reading the whole tensors the updating call had
    replaced. Now it shards what the updating call does, and its skip flag is combined too."""
    model = _Uneven()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = graphoffload.offload_compile(scaled_step, accumulation_steps=2,
                                        data_parallel=AsRank(stage=3, as_rank=1, as_world=2))
    graph = step.compile(model, opt, torch.amp.GradScaler("cpu"), _micro(_batches(2, {})[0], 1))
    assert not graph.notes_of("capture", "accumulation")[0].fields["update"]
    assert set(graph.notes_of("zero", "params")[0].fields["sharded"]) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert isinstance(model.a.weight, DTensor)

    skipping = graphoffload.offload_compile(plain_step, accumulation_steps=2,
                                            config=graphoffload.CompileConfig(skip_nonfinite=True),
                                            data_parallel=AsRank(stage=2, as_rank=1, as_world=2))
    other = _Uneven()
    graph = skipping.compile(other, torch.optim.AdamW(other.parameters()), _micro(_batches(2, {})[0], 1))
    output = list(graph.gm.graph.nodes)[-1]
    (flag,) = [v for spec, v in zip(graph.signature.outputs, output.args[0]) if spec.kind == "skipped"]
    assert flag.target is c10d.wait_tensor.default and flag.args[0].args[1] == "max"
    assert graph.notes_of("zero", "nonfinite")[0].fields["skip_nonfinite"]
