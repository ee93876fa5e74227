"""ZeRO with offload= (ZeRO-Offload), stages 1, 2 and 3, against single-process eager training:
each of 2 gloo ranks trains the tiny GPT (fp64, as tests/test_zero.py's) on its own micro-batch
with its chunk's fp32 master weights and AdamW state in host memory, updated on the CPU path
(device_updates="never"), or on a mix of CPU and device buckets that the planner chooses under
a budget; after every step its parameters equal eager's on the whole batch. Each rank's host
memory is measured against a single-process offloaded step of the same model (about 1/N of it),
and `optimizer.state` holds `Shard(0)` DTensors whose local chunks are the host tensors (stage
3: the parameters too, DTensors of the rows the uploads write). One rank's graph is also compiled
in a single process (`AsRank`) for the order of its waits and collectives. With
`Offload(activations="auto")` under a budget below the keep-everything peak the plan recomputes or
offloads saved activations and still trains as eager; with `Offload(overlap_next_step=True)` every
stage's CPU-path uploads are handed over to the next forward's gathers (stages 1-2: the all-gathers
of the updated rows, moved to the start of the next call), and the parameters read after
`step.synchronize()` or through the model's `state_dict()` (which run the pending gathers) equal
eager's."""

from __future__ import annotations

import copy
import dataclasses
import operator
import time

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.tensor import DTensor, Shard
from ring_dist import run_ranks
from steps import clipped_step, zero_first_step
from steps import train_step as gpt_step
from test_offload_planner import BALANCED
from helpers import whole as _whole
from test_zero import AsRank, _batches, _gpt, _optimizer

import graphoffload
from graphoffload import Offload
from graphoffload.data_parallel import shard_rows
from graphoffload.runtime.host_arena import aligned_bytes

RTOL = 2e-5
c10d = torch.ops._c10d_functional
ops = torch.ops.graphoffload
FUSE = graphoffload.FuseOptimizer(bucket_numel=2048)
# a calibration whose device update is much faster than the CPU's, so the planner puts every
# bucket it may on the device: a budget below the all-device plan's peak forces a mix
FAST_DEVICE = dataclasses.replace(BALANCED, cpu_update_params_per_s=1e6, cpu_update_params_per_s_under_copy=5e5)
# a link so slow that an offloaded activation stalls backward far longer than a replay takes:
# under a tight budget the activation planner recomputes
SLOW_LINK = dataclasses.replace(BALANCED, h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6)


def _step(stage: int, offload: Offload, step_fn=gpt_step) -> graphoffload.CompiledStep:
    return graphoffload.offload_compile(step_fn, offload=offload, config=graphoffload.CompileConfig(fuse_optimizer=FUSE),
                                        data_parallel=graphoffload.ZeRO(stage=stage, bucket_numel=4096, timeout_s=60))


def _host_numel(opt) -> int:
    """Elements of the host state this rank holds (master weights and moments, a DTensor's local
    chunk), step counters aside."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel()
               for state in opt.state.values() for k, t in state.items() if k != "step")


def _state_bytes(host) -> int:
    """Bytes of a host state's arena that hold optimizer state and master weights (not scratch)."""
    return host.arena.allocated_bytes - sum(aligned_bytes(t.shape, t.dtype) for t in host.scratch.values())


def _trains_as_eager(rank, world, stage, offload, expect_mix=False, step_fn=gpt_step, expect_weight_replays=False):
    eager = _gpt()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer("adamw", eager), _optimizer("adamw", model)
    step = _step(stage, offload, step_fn)
    for i, batch in enumerate(_batches(world)):
        rows = batch["input_ids"].shape[0] // world
        mine = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
        step_fn(eager, opt_e, batch)   # the whole batch: the mean of the micro-batches' losses
        step(model, opt, mine)
        read = dict(model.named_parameters())
        if offload.overlap_next_step:   # the CPU path's uploads of the rows run on past the call (handed over)
            executor = step.last.executor
            handed = step.last.graph.notes_of("offload_optimizer", "handed_over")[0].fields["buckets"]
            assert bool(executor.params_in_flight()) == (handed > 0)
            # stages 1-2: every bucket's all-gather of the updated rows is left to the next call
            assert executor.gathers_pending == (stage != 3)
            if i == 1:   # the model's state_dict() synchronizes itself (uploads landed, rows gathered)
                state = model.state_dict()
                read = {name: state[name] for name in read}
            else:
                step.synchronize()
            assert not executor.params_in_flight() and not executor.gathers_pending
        for (name, p), q in zip(read.items(), eager.parameters()):
            err = ((_whole(p) - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"stage {stage} {offload}: {name} is {err:.3g} from eager at step {i}"

    # the state the user sees: Shard(0) DTensors over the group whose local chunks are the host
    # tensors the step updates, the fp32 master weights among them; step counters plain
    host = step.last.executor.host_state
    for (name, p) in model.named_parameters():
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq", "master_param"}, (name, set(state))
        chunk = (shard_rows(p.shape[0], world, rank)[1], *p.shape[1:])
        for key, t in state.items():
            if key == "step":
                assert type(t) is torch.Tensor and t.device.type == "cpu" and int(t) == len(_batches(world))
                continue
            assert isinstance(t, DTensor) and t.placements == (Shard(0),) and t.shape == p.shape, (name, key)
            local = t.to_local()
            assert local.shape == chunk and local.dtype == torch.float32 and host.arena.holds(local), (name, key)
        # the master weights hold this rank's rows of the parameter (fp32 of the fp64 model's);
        # stage 3: the parameter is a Shard(0) DTensor of those rows alone
        start, n = shard_rows(p.shape[0], world, rank)
        master = state["master_param"].to_local()
        if stage == 3:
            assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.to_local().shape == chunk, name
            rows = p.detach().to_local()
        else:
            rows = p.detach()[start:start + n]
        assert torch.allclose(master.double(), rows, rtol=1e-6, atol=1e-7), name

    # per-rank host state: the chunks partition the whole (no element twice), about 1/N each
    held, total = _host_numel(opt), 3 * sum(p.numel() for p in model.parameters())
    counts = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor(held))
    assert sum(int(c) for c in counts) == total
    one_row = sum(p.numel() // p.shape[0] for p in model.parameters()) / sum(p.numel() for p in model.parameters())
    assert abs(held / total - 1 / world) <= one_row, (held, total)
    # ... and the host memory it measured, against one process offloading the whole model (all
    # on the CPU path: the host scratch the gradients land in depends on which buckets take it)
    share = None
    if offload.device_updates == "never" and not offload.overlap_next_step:
        alone = graphoffload.offload_compile(gpt_step, offload=Offload(device_updates="never"),
                                             config=graphoffload.CompileConfig(fuse_optimizer=FUSE))
        whole = copy.deepcopy(eager)
        alone(whole, _optimizer("adamw", whole), mine)
        full_host = alone.last.executor.host_state
        share = (round(_state_bytes(host) / _state_bytes(full_host), 3),
                 round(host.arena.allocated_bytes / full_host.arena.allocated_bytes, 3))
        assert abs(share[0] - 1 / world) <= one_row, share
        # (activations="auto": the arena holds the offloaded activations' host scratch too)
        assert share[1] <= 1 / world + one_row or offload.activations == "auto", share

    if step_fn is _clip_step:   # the zero pass's global norm, the coefficient applied on the host
        graph = step.last.graph
        assert graph.notes_of("zero", "clip")
        assert any("clip_grad_norm_" in n.fields["cause"] for n in graph.notes_of("offload_optimizer",
                                                                                 "waits_past_backward"))
    # the graph: each CPU-path bucket waits for its upload before the all-gather that reads it
    # (stage 3: before the step returns; the next call's gathers read the rows)
    nodes = list(step.last.graph.graph.nodes)
    plan = step.last.graph.notes_of("offload_optimizer", "plan")
    device_buckets = plan[0].fields["device_buckets"] if plan else 0
    if expect_mix:
        assert 0 < device_buckets < plan[0].fields["buckets"], plan[0].fields
    gathers = [i for i, n in enumerate(nodes) if n.target is c10d.all_gather_into_tensor.default]
    uploads = [i for i, n in enumerate(nodes) if n.target is ops.copy_to_device.default]
    # (stage 3 with overlap_next_step: handed over at the step's end, waited for in the next forward)
    waits = [i for i, n in enumerate(nodes) if n.target in (ops.wait_device.default, ops.hand_over.default)
             and n.args[0].target is ops.copy_to_device.default]
    cpu_buckets = plan[0].fields["buckets"] - device_buckets if plan else len(uploads)
    assert len(uploads) == len(waits) == cpu_buckets > 0
    if stage == 3:   # (which gather packs which rows: the single-process test)
        assert min(waits) > max(uploads) and len(step.last.graph.notes_of("zero", "params")[0].fields["sharded"]) \
            == sum(1 for p in model.parameters() if isinstance(p, DTensor)) > 0
    elif offload.overlap_next_step:   # the gathers moved to the start: before forward, so before every upload
        assert max(gathers) < min(uploads)   # (their waits and packing: the single-process test)
    else:
        assert max(uploads) < min(gathers)   # (the order of each wait and its all-gather: the single-process test)
    if offload.activations == "auto":   # the budget made the planner move saved activations, and it is met
        fields = step.last.graph.notes_of("offload_optimizer", "activations")[0].fields
        assert fields["recompute"] + fields["offload"] > 0 and fields["peak_bytes"] <= offload.gpu_memory_budget
        assert step.memory("final").peak <= offload.gpu_memory_budget
        device_buckets = (device_buckets, fields["recompute"], fields["offload"])
        if expect_weight_replays:   # stage 3: replays read weights from backward's gathers
            reads = _replays_reading_parameters(step.last.graph)
            assert any(c.meta["gathered"] == "backward" and c.meta["val"].dim() == 2 for _, c in reads), (rank, fields)
            device_buckets = (*device_buckets, len(reads))
    if offload.overlap_next_step:
        handed = step.last.graph.notes_of("offload_optimizer", "handed_over")[0].fields["buckets"]
        assert handed == cpu_buckets, (stage, handed)
        device_buckets = (device_buckets, handed)
    return share, device_buckets


def _world2(rank, world, path):
    results = [_trains_as_eager(rank, world, stage, Offload(device_updates="never")) for stage in (1, 2, 3)]
    for stage in (2, 3):
        budget = _mixed_budget(rank, world, stage)
        results.append(_trains_as_eager(rank, world, stage, Offload(calibration=FAST_DEVICE, gpu_memory_budget=budget),
                                        expect_mix=True))
    # clip_grad_norm_ (every update clips): the global norm from the ranks' chunks, applied on the host
    for stage in (1, 3):
        results.append(_trains_as_eager(rank, world, stage, Offload(device_updates="never"), step_fn=_clip_step))
    # activations="auto" under a budget below every-activation-kept: recomputed or offloaded per rank
    results += [_trains_as_eager(rank, world, 2, Offload(device_updates="never", activations="auto",
                                                         gpu_memory_budget=int(0.8 * _keep_peak(2, world))))]
    # stage 3 at 0.7x over a slow link: replays of regions that read weights, from backward's gathers
    results += [_trains_as_eager(rank, world, 3, Offload(device_updates="never", activations="auto",
                                                         calibration=SLOW_LINK,
                                                         gpu_memory_budget=int(0.7 * _keep_peak(3, world))),
                                 expect_weight_replays=True)]
    # overlap_next_step: every stage hands the CPU path's uploads of the rows over to the next call,
    # whose forward waits for them before its gathers (stages 1-2: the all-gathers of the updated rows,
    # moved there); device-path buckets carry their write-backs
    results.append(_trains_as_eager(rank, world, 3, Offload(device_updates="never", overlap_next_step=True)))
    for stage in (1, 2):
        results.append(_trains_as_eager(rank, world, stage, Offload(device_updates="never", overlap_next_step=True)))
        results.append(_trains_as_eager(rank, world, stage, Offload(device_updates=2, calibration=FAST_DEVICE,
                                                                    overlap_next_step=True)))
    print(f"rank {rank}: (state bytes, host bytes) / one process's, device buckets: {results}")
    _bf16_dcp_resumes_bit_for_bit(rank, world, path)
    _a_lone_synchronize_times_out(rank, world)


def _a_lone_synchronize_times_out(rank, world):
    """Stages 1-2 with overlap_next_step: synchronize() runs the gathers the last call left to the
    next, a collective; a rank that synchronizes alone gets RankTimeoutError, not a hang."""
    model = _gpt()
    opt = _optimizer("adamw", model)
    step = graphoffload.offload_compile(
        gpt_step, offload=Offload(device_updates="never", overlap_next_step=True),
        config=graphoffload.CompileConfig(fuse_optimizer=FUSE),
        data_parallel=graphoffload.ZeRO(stage=1, bucket_numel=4096, timeout_s=3))
    batch = _batches(world)[0]
    rows = batch["input_ids"].shape[0] // world
    step(model, opt, {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()})
    if rank == 0:
        with pytest.raises(graphoffload.RankTimeoutError, match="synchronize"):
            step.synchronize()
    dist.barrier()


def _synchronized_gathers_and_a_failed_one(rank, world):
    """Stage 2 with overlap_next_step on 2 ranks, both synchronizing after some calls: each update's
    rows are gathered once on each rank (in synchronize(), or at the next call's start when no
    synchronize() ran), and the parameters equal eager's on the whole batch. Then rank 0
    synchronizes alone: RankTimeoutError after timeout_s, and from then on its synchronize(), the
    step and state_dict() refuse at once (no collective, no second wait), saying to restart."""
    timeout_s = 3.0
    eager = _gpt()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer("adamw", eager), _optimizer("adamw", model)
    step = graphoffload.offload_compile(
        gpt_step, offload=Offload(device_updates="never", overlap_next_step=True),
        config=graphoffload.CompileConfig(fuse_optimizer=FUSE),
        data_parallel=graphoffload.ZeRO(stage=2, bucket_numel=4096, timeout_s=timeout_s))
    batches = _batches(world)
    rows = batches[0]["input_ids"].shape[0] // world
    mine = [{k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()} for batch in batches]
    step.compile(model, opt, mine[0])   # (compiling issues all-gathers of its own: not counted)
    counts = []
    for i, batch in enumerate(batches):
        gpt_step(eager, opt_e, batch)
        counts.append(_all_gathers(lambda: step(model, opt, mine[i]))[1])
        if i != 1:   # none after the second call: the third gathers its rows at its start
            counts.append(_all_gathers(step.synchronize)[1])
            for p, q in zip(model.parameters(), eager.parameters()):
                err = ((p - q).abs().max() / q.abs().max()).item()
                assert err <= RTOL, (rank, i, err)
    buckets = step.last.graph.notes_of("zero", "deferred_gathers")[0].fields["buckets"]
    assert buckets > 1 and counts == [0, buckets, 0, buckets, buckets], (rank, counts)

    step(model, opt, mine[0])
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(graphoffload.RankTimeoutError, match="synchronize"):
            step.synchronize()
        assert time.monotonic() - start <= timeout_s + 5
        start = time.monotonic()
        for what in (step.synchronize, lambda: step(model, opt, mine[1]), step.state_dict, model.state_dict):
            with pytest.raises(graphoffload.StateError, match="refusing to .* restart the job from the last checkpoint"):
                what()
        assert time.monotonic() - start < timeout_s, "a refusal waited for the group"
    dist.barrier()


def _bf16_dcp_resumes_bit_for_bit(rank, world, path):
    """The README's DCP recipe with bf16 parameters under ZeRO-Offload (stage 2): DCP saves each
    rank's fp32 master weights and moments (`Shard(0)` DTensors of host tensors) beside the bf16
    parameters; a fresh model (other values), optimizer and step, compiled first (which places its
    fp32 host state), loads them in place, and `set_optimizer_state_dict` (which casts state to the
    parameters' dtype) keeps them fp32: the next two steps are bit for bit those of the run that
    went on, on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    def fresh():
        model = _gpt().to(torch.bfloat16)
        return model, _optimizer("adamw", model), _step(2, Offload(device_updates="never"))

    rows = _batches(world)[0]["input_ids"].shape[0] // world
    batches = [{k: v[rank * rows:(rank + 1) * rows] for k, v in b.items()} for b in _batches(world) * 2]
    model, opt, step = fresh()
    for batch in batches[:2]:
        step(model, opt, batch)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=f"{path}/bf16")
    went_on = [step(model, opt, batch) for batch in batches[2:4]]

    model2, opt2, step2 = fresh()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    step2.compile(model2, opt2, batches[2])
    state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    assert all(t.dtype == torch.float32 for s in state["optim"]["state"].values() for t in s.values())
    dcp.load(state, checkpoint_id=f"{path}/bf16")
    set_model_state_dict(model2, state["model"])
    set_optimizer_state_dict(model2, opt2, state["optim"])
    resumed = [step2(model2, opt2, batch) for batch in batches[2:4]]
    assert all(torch.equal(a, b) for a, b in zip(resumed, went_on)), (rank, resumed, went_on)
    host = step2.last.executor.host_state
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(p, q), (rank, name)
        for key, t in opt.state[p].items():
            u = opt2.state[q][key]
            assert type(u) is type(t) and u.dtype == t.dtype, (rank, name, key)
            assert torch.equal(*(x.to_local() if isinstance(x, DTensor) else x for x in (t, u))), (rank, name, key)
            assert key == "step" or host.arena.holds(u.to_local()), (rank, name, key)   # loaded in place


def _clip_step(model, optimizer, batch):
    return clipped_step(model, optimizer, batch, max_norm=0.05)   # below the tiny GPT's norms: every update clips


def _keep_peak(stage, world) -> int:
    """This rank's predicted device peak with every saved activation kept, state offloaded."""
    model = _gpt()
    graph = _step(stage, Offload(device_updates="never")).compile(
        model, _optimizer("adamw", model), {k: v[:2] for k, v in _batches(world)[0].items()})
    return graph.notes_of("offload_optimizer", "offloaded")[0].fields["device_peak_bytes"]


def _mixed_budget(rank, world, stage) -> int:
    """A budget a little over the all-CPU plan's predicted peak, well under the all-device plan's:
    the planner prefetches what it can late enough to fit, and keeps the rest on the CPU."""
    peaks = []
    for mode in ("never", "auto"):
        model = _gpt()
        step = _step(stage, Offload(device_updates=mode, calibration=FAST_DEVICE))
        graph = step.compile(model, _optimizer("adamw", model), {k: v[:2] for k, v in _batches(world)[0].items()})
        peaks.append(graph.notes_of("offload_optimizer", "offloaded")[0].fields["device_peak_bytes"])
    assert peaks[0] < peaks[1], peaks
    return peaks[0] + (peaks[1] - peaks[0]) // 20


@pytest.mark.slow   # several processes
def test_zero_offload_stages_1_2_and_3_train_as_eager_world2(tmp_path):
    """(The same ranks then resume a bf16 DCP checkpoint bit for bit.)"""
    run_ranks(_world2, 2, str(tmp_path), deadline_s=400)


# ---------------------------------------------------------------- single process: one rank's graph


@pytest.mark.slow   # two processes
def test_gathers_synchronize_ran_are_not_repeated_and_a_failed_one_breaks_the_step_world2():
    run_ranks(_synchronized_gathers_and_a_failed_one, 2, deadline_s=120)


def _compile_as(rank, stage, offload, step_fn=gpt_step, world=2):
    model = _gpt()
    opt = _optimizer("adamw", model)
    step = graphoffload.offload_compile(step_fn, offload=offload, config=graphoffload.CompileConfig(fuse_optimizer=FUSE),
                                        data_parallel=AsRank(stage=stage, bucket_numel=4096, as_rank=rank,
                                                             as_world=world))
    batch = {k: v[:2] for k, v in _batches(1)[0].items()}
    return step, step.compile(model, opt, batch), model, opt, batch


@pytest.mark.parametrize("stage", [1, 2])
def test_each_cpu_bucket_reads_this_ranks_reduced_chunks_and_lands_before_the_all_gather(stage, one_process_group):
    step, graph, model, opt, batch = _compile_as(1, stage, Offload(device_updates="never"), world=4)
    nodes = list(graph.gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    reduced = c10d.all_reduce_coalesced.default if stage == 1 else c10d.reduce_scatter_tensor.default
    waits_of_reduction = [at[n] for n in nodes if n.target is c10d.wait_tensor.default
                          and n.args[0].target in (reduced, operator.getitem)]
    chunk = {name: (shard_rows(p.shape[0], 4, 1)[1], *p.shape[1:]) for name, p in model.named_parameters()}
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    spec = {s.name: s.target for s in graph.signature.inputs}
    for n in nodes:
        if n.target is ops.copy_to_host.default:   # the gradients: this rank's chunks, after their reduction
            names = [spec[h.name][0] for h in n.args[1]]   # the host scratch each lands in
            assert [tuple(g.meta["val"].shape) for g in n.args[0]] == [chunk[name] for name in names]
            assert any(w < at[n] for w in waits_of_reduction)
        if n.target is ops.copy_to_device.default:   # the update: this rank's rows, fp32 masters of the chunk
            masters, params = n.args[1], n.args[3]
            assert [tuple(m.meta["val"].shape) for m in masters] == [tuple(p.meta["val"].shape) for p in params]
            assert all(p.target is torch.ops.aten.slice.Tensor for p in params)
            wait = next(u for u in n.users if u.target is ops.wait_device.default)
            # every all-gather that packs one of these rows comes after the upload is waited for
            readers = [g for g in gathers if set(params) & _packed(g)]
            assert readers and all(at[wait] < at[g] for g in readers), n.meta["param"]
    # binding the inputs places this rank's chunk state in host memory, as DTensors
    step.last.executor.inputs((model, opt, batch), {})
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            t = opt.state[p][key]
            assert isinstance(t, DTensor) and t.to_local().shape == chunk[name] and t.to_local().device.type == "cpu"
    shards = graph.notes_of("zero", "shards")[0].fields
    assert _host_numel(opt) == shards["state_numel"] + shards["local_numel"]   # moments + master weights


def test_stage_3_each_cpu_bucket_writes_this_ranks_rows_and_the_step_waits_for_its_upload(one_process_group):
    """Stage 3 with offload=, rank 1 of 4: each CPU-path bucket's host update reads this rank's
    reduce-scattered gradient chunks and its upload writes the rank's rows, which are the
    parameter placeholders themselves (no slice, no all-gather after the update); nothing in the
    step reads those rows after the upload, whose wait sits before the step's output, so the next
    call's gathers (and the user's reads of the DTensors) find them written."""
    step, graph, model, opt, batch = _compile_as(1, 3, Offload(device_updates="never"), world=4)
    nodes = list(graph.gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    spec = {s.name: s for s in graph.signature.inputs}
    chunk = {name: (shard_rows(p.shape[0], 4, 1)[1], *p.shape[1:]) for name, p in model.named_parameters()}
    scattered = [at[n] for n in nodes if n.target is c10d.wait_tensor.default
                 and n.args[0].target is c10d.reduce_scatter_tensor.default]
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    output = nodes[-1]
    uploads = [n for n in nodes if n.target is ops.copy_to_device.default]
    assert len(uploads) == len(graph.notes_of("fuse_optimizer", "bucket")) > 1
    written = set()
    for n in nodes:
        if n.target is ops.copy_to_host.default:   # the gradients: this rank's chunks, after their reduce-scatter
            names = [spec[h.name].target[0] for h in n.args[1]]
            assert [tuple(g.meta["val"].shape) for g in n.args[0]] == [chunk[name] for name in names]
            assert any(w < at[n] for w in scattered)
    for n in uploads:
        masters, params = n.args[1], n.args[3]
        # the rank's rows: the "param" placeholders, shaped as its chunk, and their fp32 master weights
        assert all(p.op == "placeholder" and spec[p.name].kind == "param" and spec[p.name].mutable for p in params)
        assert [tuple(p.meta["val"].shape) for p in params] == [chunk[spec[p.name].target] for p in params]
        assert [tuple(m.meta["val"].shape) for m in masters] == [tuple(p.meta["val"].shape) for p in params]
        written |= set(params)
        # no node reads the rows after the upload but its wait, which the output follows
        wait = next(u for u in n.users if u.target is ops.wait_device.default)
        readers = [u for p in params for u in p.users if at[u] > at[n] and u is not wait]
        assert not readers, readers
        assert all(nodes[i].target is ops.wait_device.default for i in range(at[wait], at[output]))
        # every gather of these rows (forward's and backward's) packed them before the upload
        assert all(at[g] < at[n] for g in gathers if set(params) & _packed_rows(g))
    assert written == {p for p in graph.gm.graph.nodes if p.op == "placeholder" and spec[p.name].kind == "param"
                       and p.meta["val"].dim()}   # every sharded parameter's rows, once
    # binding the inputs places this rank's chunk state in host memory, as DTensors; the
    # master weights mirror the rows the model's DTensor parameters hold
    step.last.executor.inputs((model, opt, batch), {})
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and tuple(p.to_local().shape) == chunk[name]
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            t = opt.state[p][key]
            assert isinstance(t, DTensor) and t.to_local().shape == chunk[name] and t.to_local().device.type == "cpu"
        assert torch.equal(opt.state[p]["master_param"].to_local(), p.to_local().float())


def _packed_rows(gather) -> set:
    """The parameter placeholders (stage 3: a rank's rows) an all-gather's flat buffer is packed from."""
    seen, todo = set(), [gather.args[0]]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            seen.add(n)
            continue
        todo += n.all_input_nodes
    return seen


def _packed(gather) -> set:
    """The chunk views an all-gather's flat buffer is packed from."""
    seen, todo = set(), [gather.args[0]]
    while todo:
        n = todo.pop()
        if n.target is torch.ops.aten.slice.Tensor and n.args[0].op == "placeholder":
            seen.add(n)
            continue
        todo += [a for a in n.all_input_nodes if a.op != "placeholder"]
    return seen


def test_overlap_next_step_hands_stage_3_rows_to_the_next_forwards_gathers(one_process_group):
    """Offload(overlap_next_step=True) under ZeRO, rank 1 of 4. Stage 3: each CPU-path bucket's
    upload of this rank's rows is handed over at the step's end, and the next call waits for it
    right before its forward first reads the rows: before every all-gather that packs them and
    before any other reader. Stages 1-2: the all-gather after the update reads the uploaded rows in
    the same call, so each upload is waited for there and nothing is handed over."""
    step, graph, model, opt, batch = _compile_as(1, 3, Offload(device_updates="never", overlap_next_step=True), world=4)
    nodes = list(graph.gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    handed = {n.args[2]: n for n in nodes if n.target is ops.hand_over.default}
    waits = [n for n in nodes if n.target is ops.wait_handed_over.default]
    assert len(handed) == len(waits) == len(graph.notes_of("fuse_optimizer", "bucket")) > 1
    assert not [n for n in nodes if n.target is ops.wait_device.default and n.args[0].target is ops.copy_to_device.default]
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    for wait in waits:
        rows = set(wait.args[0])
        upload = handed[wait.args[1]].args[0]
        assert upload.target is ops.copy_to_device.default and set(upload.args[3]) == rows
        packing = [g for g in gathers if rows & _packed_rows(g)]
        assert packing and all(at[wait] < at[g] for g in packing), wait
        readers = [u for p in rows for u in p.users if u not in (wait, upload, handed[wait.args[1]])]
        assert readers and all(at[wait] < at[u] for u in readers), wait
    assert graph.notes_of("offload_optimizer", "handed_over")[0].fields["buckets"] == len(waits)


@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_next_step_moves_stage_1_2_all_gathers_into_the_next_forward(stage, one_process_group):
    """Offload(overlap_next_step=True) under ZeRO stages 1-2, rank 1 of 4: each bucket's all-gather
    of the updated rows runs at the start of the next call, right before forward first reads any of
    its parameters; each CPU-path bucket's upload of this rank's rows is handed over at the step's
    end and waited for right before the gather packs those rows; no gather reads the rows after an
    upload in the same call; the gathers' nodes are what synchronize() runs between calls."""
    step, graph, model, opt, batch = _compile_as(1, stage, Offload(device_updates="never", overlap_next_step=True),
                                                 world=4)
    nodes = list(graph.gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    handed = {n.args[2]: n for n in nodes if n.target is ops.hand_over.default}
    waits = [n for n in nodes if n.target is ops.wait_handed_over.default]
    uploads = [n for n in nodes if n.target is ops.copy_to_device.default]
    assert len(handed) == len(waits) == len(uploads) == len(graph.notes_of("fuse_optimizer", "bucket")) > 1
    assert not [n for n in nodes if n.target is ops.wait_device.default and n.args[0].target is ops.copy_to_device.default]
    assert not graph.notes_of("offload_optimizer", "read_after_update")
    assert graph.notes_of("offload_optimizer", "handed_over")[0].fields["buckets"] == len(waits)
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    note = graph.notes_of("zero", "deferred_gathers")[0].fields
    assert note["buckets"] == len(gathers) == graph.notes_of("zero", "shards")[0].fields["buckets"] > 1
    assert note["kept"] == 0
    spec = {s.name: s for s in graph.signature.inputs}
    params = {n for n in nodes if n.op == "placeholder" and spec[n.name].kind == "param"}
    for gather in gathers:   # before forward's first read of its parameters, before every update
        packed = {v.args[0] for v in _packed(gather)}
        first_read = min((u for p in packed for u in p.users if u.meta.get("phase") == "forward"), key=at.__getitem__)
        assert at[gather] < at[first_read] and at[gather] < min(at[u] for u in uploads)
        assert gather.meta["deferred_gather"] is not None
        copies = [n for n in nodes if n.target is torch.ops.aten.copy_.default and n.args[0] in packed]
        assert copies and all(at[gather] < at[c] < at[first_read] for c in copies)
    for wait in waits:   # the rows' upload, handed over, waited for before any gather packs them
        upload = handed[wait.args[1]].args[0]
        rows = {v.args[0] for v in upload.args[3]}
        assert upload.target is ops.copy_to_device.default and rows <= params
        packing = [g for g in gathers if rows & {v.args[0] for v in _packed(g)}]
        assert packing and all(at[wait] < min(at[v] for v in _packed(g)) for g in packing), wait
        readers = [u for p in rows for u in p.users if u.meta.get("phase") != "optimizer"]
        assert readers and all(at[wait] < at[u] for u in readers), wait
    # synchronize()'s graph: the gathers' nodes alone, reading the parameters
    gm, names = step.last.executor.deferred_gathers
    sub = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(sub) == sum("deferred_gather" in n.meta for n in nodes) and \
        sum(n.target is c10d.all_gather_into_tensor.default for n in sub) == len(gathers)
    assert {name for _, name in names} == {spec[p.name].target for p in params if p.meta["val"].dim()}


def test_overlap_next_step_keeps_the_gather_of_a_bucket_read_after_the_update(one_process_group):
    """Stage 2 with overlap_next_step, rank 1 of 4, a step that reads weights after
    optimizer.step() (tests/test_read_after_step.py's): the buckets holding those parameters
    keep their all-gather after the update (the read sees the whole updated parameters) and their
    uploads are waited for in the step; the other buckets' gathers still move to the next call."""
    from test_read_after_step import norm_after_step

    step, graph, model, opt, batch = _compile_as(1, 2, Offload(device_updates="never", overlap_next_step=True),
                                                 norm_after_step, world=4)
    nodes = list(graph.gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    note = graph.notes_of("zero", "deferred_gathers")[0].fields
    assert note["kept"] > 0 and note["buckets"] > 0
    spec = {s.name: s.target for s in graph.signature.inputs}
    uploads = [n for n in nodes if n.target is ops.copy_to_device.default]
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
    kept = [g for g in gathers if "deferred_gather" not in g.meta]
    assert len(kept) == note["kept"] and all(at[g] > max(at[u] for u in uploads) for g in kept)
    read_after = {"tok.weight", "ln_f.weight", "blocks.1.mlp.0.weight"}
    assert read_after <= {spec[v.args[0].name] for g in kept for v in _packed(g)}
    handed = [{spec[v.args[0].name] for v in n.args[1]} for n in nodes if n.target is ops.hand_over.default]
    assert handed and not any(read_after & params for params in handed)
    assert graph.notes_of("offload_optimizer", "read_after_update")[0].fields["buckets"] == len(uploads) - len(handed)


def test_the_plan_charges_the_bucket_collectives_on_the_link_and_counts_their_buffers(one_process_group):
    world = 4
    slow, fast = (dataclasses.replace(FAST_DEVICE, collective_bytes_per_s=rate) for rate in (1e6, 1e12))
    notes = {}
    for name, cal in (("slow", slow), ("fast", fast)):
        graph = _compile_as(1, 2, Offload(calibration=cal), world=world)[1]
        notes[name] = (graph.notes_of("offload_optimizer", "collectives")[0].fields,
                       graph.notes_of("offload_optimizer", "plan")[0].fields, graph)
    shards = notes["slow"][2].notes_of("zero", "shards")[0].fields
    # a reduce-scatter of the padded buffer and an all-gather of this rank's part per bucket, fp64:
    # a rank sends (N-1)/N of the one and N-1 times the other
    part_bytes = shards["padded_numel"] // world * 8
    assert notes["slow"][0]["collectives"] == 2 * shards["buckets"]
    assert notes["slow"][0]["sent_bytes"] == pytest.approx(2 * (world - 1) * part_bytes, rel=1e-6)
    assert notes["slow"][0]["seconds"] == pytest.approx(notes["slow"][0]["sent_bytes"] / 1e6)
    assert notes["slow"][0]["calibrated"] and notes["slow"][0]["link_bytes_per_s"] == 1e6
    assert FAST_DEVICE.link_bytes_per_s == FAST_DEVICE.d2h_bytes_per_s   # no collective rate calibrated
    # the collectives are on the predicted timeline: a slower link lengthens the step by their time
    longer = notes["slow"][1]["step_seconds"] - notes["fast"][1]["step_seconds"]
    assert longer >= 0.99 * (notes["slow"][0]["seconds"] - notes["fast"][0]["seconds"]) > 0
    # and their buffers in the predicted peak: the liveness holds an all-gather's packed chunks
    # and its gathered output while it runs
    graph = notes["fast"][2]
    profile = graphoffload.memory.analyze_memory(graph)
    nodes = list(graph.gm.graph.nodes)
    for i, n in enumerate(nodes):
        if n.target is c10d.all_gather_into_tensor.default:
            out = n.meta["val"].numel() * n.meta["val"].element_size()
            assert profile.live[i] - profile.live[i - 1] >= out
            assert profile.live[i] >= profile.resident + out + n.args[0].meta["val"].numel() * 8


# ---------------------------------------------------------------- a group of one process


@pytest.mark.parametrize("stage, offload, step_fn, sanitize", [
    (2, Offload(device_updates="never"), gpt_step, False),
    (1, Offload(device_updates=2, calibration=FAST_DEVICE), gpt_step, False),
    (1, Offload(device_updates="never"), zero_first_step, False),   # .grad left set: the averages
    # stage 3: the updates write the rows the model's DTensors hold; under the sanitizer a read of
    # rows inside the step that is not ordered after their upload sees NaN (the step's end waits
    # for every upload: the single-process test below checks the graph's waits)
    (3, Offload(device_updates="never"), gpt_step, True),
    (3, Offload(device_updates=2, calibration=FAST_DEVICE), gpt_step, True),
    # overlap_next_step, stages 1-2: the uploads handed over, the all-gathers at the next call's
    # start; under the sanitizer a gather packing rows before their upload's wait sees NaN
    (2, Offload(device_updates="never", overlap_next_step=True), gpt_step, True),
    (1, Offload(device_updates=2, calibration=FAST_DEVICE, overlap_next_step=True), gpt_step, True),
], ids=["stage2-cpu", "stage1-hybrid", "stage1-grad-left-set", "stage3-cpu-sanitized", "stage3-hybrid-sanitized",
        "stage2-cpu-overlap-sanitized", "stage1-hybrid-overlap-sanitized"])
def test_one_rank_with_bf16_parameters_offloads_as_plain_offload_bit_for_bit(stage, offload, step_fn, sanitize,
                                                                            one_process_group):
    """ZeRO over a group of one: the chunk is the whole parameter, so the step must do exactly what
    offload alone does: bf16 parameters, fp32 master weights (narrowed through the staging buffers
    on the CPU path, through the fp32 masters on the device path); also after a parameter is
    changed outside the step (the rank's master weights mirror it again). Stage 3's parameters
    are read after each step as the user reads them: `full_tensor()` and `state_dict()`."""
    base = _gpt().to(torch.bfloat16)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [_optimizer("adamw", m) for m in models]
    config = graphoffload.CompileConfig(fuse_optimizer=FUSE)
    steps = [graphoffload.offload_compile(step_fn, offload=offload,
                                          config=dataclasses.replace(config, sanitize=sanitize),
                                          data_parallel=graphoffload.ZeRO(stage=stage, bucket_numel=4096)),
             graphoffload.offload_compile(step_fn, offload=offload, config=config)]
    for i, batch in enumerate(_batches(1)):
        if i == 2:
            for m in models:
                with torch.no_grad():
                    next(m.parameters()).mul_(0.5)
        if i == 1 and stage == 3:   # rows written through to_local(), as README's recipe loads values
            with torch.no_grad():
                models[0].blocks[0].mlp[0].weight.to_local().mul_(0.5)
                models[1].blocks[0].mlp[0].weight.mul_(0.5)
        losses = [step(m, o, batch) for step, m, o in zip(steps, models, opts)]
        assert torch.equal(*losses), (i, losses)
        if offload.overlap_next_step:   # the uploads (and stages 1-2's gathers) run on past the call
            for step in steps:
                step.synchronize()
        for p, q in zip(*(m.parameters() for m in models)):
            assert torch.equal(_whole(p), q), i
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
        if stage == 3:
            assert all(isinstance(p, DTensor) for p in models[0].parameters())
            sd, expected = models[0].state_dict(), models[1].state_dict()
            assert all(torch.equal(sd[k].full_tensor(), v) for k, v in expected.items() if k in sd), i
    plan = steps[0].last.graph.notes_of("offload_optimizer", "plan")
    assert (plan[0].fields["device_buckets"] if plan else 0) == (0 if offload.device_updates == "never" else
                                                                  plan[0].fields["buckets"] // 2)
    for p, q in zip(*(m.parameters() for m in models)):
        mine, alone = opts[0].state[p]["master_param"], opts[1].state[q]["master_param"]
        assert isinstance(mine, DTensor) and torch.equal(mine.to_local(), alone)



class _AllGathers(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the functional all-gathers dispatched on the calling thread, where the step and
    synchronize() issue them. (Not the profiler: a CPU profile around a step whose host updates
    run on worker threads once aborted the process.)"""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == "_c10d_functional::all_gather_into_tensor":
            self.count += 1
        return func(*args, **(kwargs or {}))


def _all_gathers(fn):
    """`fn()`, and how many all-gathers it issued (calls of the functional collective)."""
    with _AllGathers() as counted:
        result = fn()
    return result, counted.count


def test_rows_synchronize_gathered_are_not_gathered_again_at_the_next_call(one_process_group):
    """Stage 2 (stage 1 differs in the gradients' collective only) with overlap_next_step over a group of one: each update's rows are gathered once,
    by synchronize() (or the model's state_dict(), which runs it) when it ran between calls, else
    at the start of the next call; the first call gathers nothing (the parameters are the user's,
    whole). Losses and parameters are bit for bit those of the same step without overlap_next_step,
    which gathers every bucket after its update, every call."""
    base = _gpt()
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    opts = [_optimizer("adamw", m) for m in models]
    overlap, plain = (_step(2, Offload(device_updates="never", overlap_next_step=o)) for o in (True, False))
    synced = {0: "synchronize", 2: "state_dict", 3: "synchronize"}   # none after call 1, after call 4 the end
    for step, model, opt in ((overlap, models[0], opts[0]), (plain, models[1], opts[1])):
        step.compile(model, opt, _batches(1)[0])   # (compiling issues all-gathers of its own: not counted)
    for i, batch in enumerate(_batches(1) + _batches(1)[:2]):
        loss, gathered = _all_gathers(lambda: overlap(models[0], opts[0], batch))
        expected, every_call = _all_gathers(lambda: plain(models[1], opts[1], batch))
        note = overlap.last.graph.notes_of("zero", "deferred_gathers")[0].fields
        buckets = note["buckets"]
        assert note["kept"] == 0 and buckets == every_call > 1
        assert torch.equal(loss, expected), i
        # the last call's rows, unless synchronize() gathered them
        assert gathered == (buckets if i > 0 and i - 1 not in synced else 0), (i, gathered, buckets)
        assert overlap.last.executor.gathers_pending
        if i in synced:
            _, sync_gathers = _all_gathers(overlap.synchronize if synced[i] == "synchronize" else models[0].state_dict)
            assert sync_gathers == buckets and not overlap.last.executor.gathers_pending, (i, sync_gathers)
            assert _all_gathers(overlap.synchronize)[1] == 0   # once: nothing is pending any more
            for p, q in zip(*(m.parameters() for m in models)):
                assert torch.equal(p, q), i
    for p, q in zip(*(m.parameters() for m in models)):
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(opts[0].state[p][key].to_local(), opts[1].state[q][key].to_local()), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_dcp_checkpoint_of_zero_offload_resumes_bit_for_bit(stage, dtype, one_process_group, tmp_path):
    """The README's DCP recipe with offload=: the fresh step, compiled first, places its fp32
    master weights and moments as Shard(0) DTensors of host tensors, DCP loads the saved ones into
    them in place, and `set_optimizer_state_dict` keeps them fp32 (bf16: it would cast them to the
    parameters' dtype; fp32: the master weights equal the parameters) (stage 3: the parameters
    loaded into the DTensors the fresh step made of them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    def fresh():
        model = _gpt().to(dtype)
        opt = _optimizer("adamw", model)
        return model, opt, graphoffload.offload_compile(
            gpt_step, offload=Offload(device_updates="never"), config=graphoffload.CompileConfig(fuse_optimizer=FUSE),
            data_parallel=graphoffload.ZeRO(stage=stage, bucket_numel=4096))

    model, opt, step = fresh()
    batches = _batches(1)
    for batch in batches[:2]:
        step(model, opt, batch)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path / "ckpt"))
    went_on = step(model, opt, batches[2])

    model2, opt2, step2 = fresh()
    step2.compile(model2, opt2, batches[2])
    state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    set_model_state_dict(model2, state["model"])
    set_optimizer_state_dict(model2, opt2, state["optim"])
    assert torch.equal(step2(model2, opt2, batches[2]), went_on)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert isinstance(q, DTensor) == (stage == 3) and torch.equal(_whole(p), _whole(q))
        for key, t in opt.state[p].items():
            u = opt2.state[q][key]
            assert type(u) is type(t) and u.dtype == t.dtype
            assert torch.equal(*(x.to_local() if isinstance(x, DTensor) else x for x in (t, u)))


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_clips_on_a_mix_of_paths_as_eager(stage, one_process_group):
    """clip_grad_norm_ with device-path buckets too (they scale on the device, the CPU path's on the host;
    stage 3: the rows the updates write are the parameters' DTensors)."""
    eager = _gpt()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer("adamw", eager), _optimizer("adamw", model)
    step = _step(stage, Offload(device_updates=2, calibration=FAST_DEVICE), _clip_step)
    for batch in _batches(1):
        _clip_step(eager, opt_e, batch)
        step(model, opt, batch)
        worst = max(((_whole(p) - q).abs().max() / q.abs().max()).item()
                    for p, q in zip(model.parameters(), eager.parameters()))
        assert worst <= RTOL, worst   # (fp32 master weights of an fp64 model)
    assert 0 < step.last.graph.notes_of("offload_optimizer", "plan")[0].fields["device_buckets"]


@pytest.mark.parametrize("dtype, load", [(torch.float32, "optimizer"), (torch.float32, "step"), (torch.bfloat16, "step"),
                                         (torch.bfloat16, "compiled")],
                         ids=["fp32-optimizer.load_state_dict", "fp32-step.load_state_dict", "bf16-step.load_state_dict",
                              "bf16-compiled-then-optimizer.load_state_dict"])
def test_torch_save_of_zero_offload_state_resumes_bit_for_bit(dtype, load, one_process_group, tmp_path):
    """`torch.save` of `model.state_dict()`, `optimizer.state_dict()` and `step.state_dict()` under
    ZeRO-Offload stage 2 (the host DTensors' local tensors are views into the one host arena), and
    `copy.deepcopy` of them; loaded with `torch.load` into a fresh model, optimizer and step (before
    its first call), the next steps are bit-identical to the run that went on. bf16 parameters
    resume through `step.load_state_dict`, which keeps the fp32 master weights fp32 (the first call
    finds the loaded parameters equal to them rounded, and keeps them), and so does
    `optimizer.load_state_dict` once the fresh step has compiled (it hooks the load to keep the
    state it offloads in its dtype)."""
    def fresh():
        model = _gpt().to(dtype)
        return model, _optimizer("adamw", model), _step(2, Offload(device_updates="never"))

    model, opt, step = fresh()
    batches = _batches(1) * 2   # 2 steps, the checkpoint, 4 more
    for batch in batches[:2]:
        step(model, opt, batch)
    host = step.last.executor.host_state
    arena_bytes = host.arena.allocated_bytes
    local = opt.state[next(model.parameters())]["exp_avg"].to_local()
    assert host.arena.holds(local) and local.storage_offset() == 0   # a view into the arena, its own storage
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step.state_dict()}, tmp_path / "ckpt.pt")
    copied = copy.deepcopy(step.state_dict())
    assert host.arena.allocated_bytes == arena_bytes and len(host.arena.chunks) == 1   # no copy kept in the arena
    went_on = [step(model, opt, batch) for batch in batches[2:]]

    saved = torch.load(tmp_path / "ckpt.pt")   # weights_only, the default: the DTensors load too
    for sd in (saved["step"], copied):   # what was saved and the deep copy are the state at the checkpoint
        assert _state_equal(sd["optimizers"][0], saved["optim"])
    model2, opt2, step2 = fresh()
    model2.load_state_dict(saved["model"])
    if load == "compiled":
        step2.compile(model2, opt2, batches[2])
    if load in ("optimizer", "compiled"):
        opt2.load_state_dict(saved["optim"])
    else:
        step2.load_state_dict(saved["step"], optimizers=[opt2])
    resumed = [step2(model2, opt2, batch) for batch in batches[2:]]
    assert all(torch.equal(a, b) for a, b in zip(resumed, went_on)), (resumed, went_on)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        for key, t in opt.state[p].items():
            u = opt2.state[q][key]
            assert type(u) is type(t) and torch.equal(*(x.to_local() if isinstance(x, DTensor) else x for x in (t, u)))
            assert key != "master_param" or u.dtype == torch.float32
    assert step2.last.executor.host_state.arena.holds(opt2.state[q]["exp_avg"].to_local())   # moved into its arena


def _state_equal(a, b) -> bool:
    """Whether two optimizer state dicts hold the same values (a DTensor by its local tensor)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        a, b = (x.to_local() if isinstance(x, DTensor) else x for x in (a, b))
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _replays_reading_parameters(graph) -> list[tuple[fx.Node, fx.Node]]:
    """(replayed node, the stage 3 parameter copy it reads) for every activation replay's read of
    a gathered parameter."""
    return [(n, i) for n in graph.graph.nodes if str(n.meta.get("recompute", "")).startswith("activations")
            for i in n.all_input_nodes if i.meta.get("gathered")]


@pytest.mark.parametrize("link", ["balanced", "slow"])
def test_stage_3_replays_read_the_backward_gathered_parameters_and_train_as_eager(link, one_process_group):
    """Stage 3 + ZeRO-Offload + `activations="auto"` under 0.6x (0.7x with a slow link, where
    offloads stall and the plan must recompute) of the keep-everything peak, 8 rows a step so
    activations outweigh the parameters: the plan recomputes regions that read weights, each
    replay reads its parameters from backward's gather (forward's is freed by then), that
    gather's wait placed before the replay and after its launch; the predicted peak meets the
    budget and three steps train as eager (fp32 master weights: within RTOL)."""
    # fixed rates: with this machine's measured ones the plan (recompute or offload, and what a
    # budget can reach) depended on the CPU and its load
    extra = {"calibration": SLOW_LINK if link == "slow" else BALANCED}
    batches = _batches(1, rows=8)
    model = _gpt()
    kept = _step(3, Offload(device_updates="never", activations="auto", gpu_memory_budget=1 << 40, **extra)).compile(
        model, _optimizer("adamw", model), batches[0])
    budget = int((0.7 if link == "slow" else 0.6) * kept.notes_of("offload_optimizer", "offloaded")[0]
                 .fields["device_peak_bytes"])
    eager = _gpt()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer("adamw", eager), _optimizer("adamw", model)
    step = _step(3, Offload(device_updates="never", gpu_memory_budget=budget, activations="auto", **extra))
    for i, batch in enumerate(batches):
        gpt_step(eager, opt_e, batch)
        step(model, opt, batch)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            err = ((_whole(p) - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"{name} is {err:.3g} from eager at step {i}"
    graph = step.last.graph
    fields = graph.notes_of("offload_optimizer", "activations")[0].fields
    assert fields["recompute"] > 0 and fields["peak_bytes"] <= budget, fields
    assert step.memory("final").peak <= budget
    reads = _replays_reading_parameters(graph)
    assert reads and all(copy_.meta["gathered"] == "backward" for _, copy_ in reads), reads
    if link == "slow":   # nothing offloaded: the budget is met by replays alone, weights read among them
        assert fields["offload"] == 0 and any(copy_.meta["param"][0].endswith("weight") and
                                              copy_.meta["val"].dim() == 2 for _, copy_ in reads), fields
    position = {n: i for i, n in enumerate(graph.graph.nodes)}
    for node, copy_ in reads:
        wait = copy_
        while wait.target is not c10d.wait_tensor.default:
            wait = wait.args[0]
        assert position[wait.args[0]] < position[wait] < position[node], (node.name, wait.name)
    if link == "slow":   # a restarted job re-applies the plan from the cache, the moved gathers too (AsRank: a
        # group name the cache key holds alike on both compiles)
        offload = Offload(device_updates="never", gpu_memory_budget=budget, activations="auto", **extra)
        made = []
        for _ in range(2):
            fresh = _gpt()
            made.append(graphoffload.offload_compile(
                gpt_step, offload=offload, config=graphoffload.CompileConfig(fuse_optimizer=FUSE),
                data_parallel=AsRank(stage=3, bucket_numel=4096, as_rank=0, as_world=1)).compile(
                    fresh, _optimizer("adamw", fresh), batches[0]))
        assert made[1].notes_of("offload_optimizer", "activations_reused") and _replays_reading_parameters(made[1])
        assert [n.name for n in made[1].graph.nodes] == [n.name for n in made[0].graph.nodes]
    print(f"{link}: budget {budget}, predicted peak {fields['peak_bytes']}, recompute {fields['recompute']}, "
          f"offload {fields['offload']}, {len(reads)} replayed reads of gathered parameters")
