"""ZeRO over one dimension of a device mesh and ring attention over the other (`data_parallel=`
and `sequence_parallel=` together), against single-process eager training.

Four gloo ranks form a 2 x 2 mesh ("dp", "sp"): the two ranks of an sp group split the sequence
of one micro-batch (passed whole, or as their `sp.shard` of it), the two dp groups shard the
optimizer state (stage 2: the gradients, stage 3: the parameters too). Every rank's loss is its
micro-batch's and its parameters equal eager training of a tiny Llama on the two micro-batches
together (stage 1 with clip_grad_norm_); the gradient collectives per bucket are counted by
group; a DCP checkpoint of the stage 2 run loads back on the same mesh. A GradScaler whose overflow
comes from one sp rank's part of a gradient row another dp rank holds, and skip_nonfinite=True
with one dp rank's loss inf, skip the step on all four ranks as eager does (stages 1, 2 and 3;
with accumulation_steps and with offload=). With offload= and accumulation_steps the running sums
are on the device, or this rank's chunks on the host (every call reducing over both groups; stages
1, 2 and 3), or where `accumulate_on="auto"` puts them under a budget above and one between its
trial peaks; every accumulating call's loss is the rank's own and the moments are eager's.
Without offload= the device sums are tested at stages 1, 2 and 3. ZeRO-Offload stages 2 and 3 with
`activations="auto"` under 0.9x of the keep-everything peak recompute and offload saved activations
and train as eager; stages 1, 2 and 3 with `overlap_next_step=True` train as eager, stages 1-2
gathering each update's chunks in the next call or in `synchronize()` (counted per call), and so
do stage 1 with accumulation_steps and device sums and stage 2 with host sums.
Groups that are not the two
dimensions of one mesh are refused before anything is traced (on 4 ranks, and as a pure check
without processes), and so is a first call that one rank never makes (`RankTimeoutError`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from ring_dist import run_ranks
from helpers import loss_steps, nonfinite_eagerly, whole as _full
from steps import hf_step
from test_ring_attention_step import assert_fp32_close

import graphoffload
from graphoffload.data_parallel import shard_rows
from graphoffload.groups import check_orthogonal

STEPS = 2
RTOL = 2e-5        # losses (fp32: Llama upcasts the logits)
FP64_RTOL = 1e-10  # fp64 parameters
c10d = torch.ops._c10d_functional


def _llama():   # fp32; the tests run it in fp64 too
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _batches(dp: int, rows: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 64, (rows * dp, 16), generator=g)
        out.append({"input_ids": x, "labels": x})   # Llama shifts the labels itself
    return out


def _clipped_hf_step(model, optimizer, batch):   # the tiny Llama's gradient norm is about 1.06: every step clips
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _penalty(model):
    return 1e-3 * (model.lm_head.weight ** 2).sum()


def _penalized_hf_step(model, optimizer, batch):
    """lm_head's weight read twice: on the split sequence (the logits) and off it (a penalty on the
    loss), so its gradient is whole over sp, not a partial sum ring attention leaves to zero."""
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss + _penalty(model)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _fp32_close(model, opt, eager, opt_e, ref, opt_ref):
    """fp32: each parameter and optimizer state tensor within 10 times eager fp32's own
    distance from eager fp64, in the 2-norm (the ring attention tests' bound: AdamW's first steps turn fp32
    rounding of near-zero gradient elements into lr-sized moves, whichever way the sums run)."""
    def close(got, want, exact, what):
        assert_fp32_close(_full(got), want, exact, what)

    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        close(p, q, r, name)
        for key, value in opt_e.state[q].items():
            if key != "step":
                close(opt.state[p][key], value, opt_ref.state[r][key], f"{name} {key}")


def _train_and_compare(rank, mesh, stage, batch_mode, dtype=torch.float64, step_fn=hf_step, offload=None):
    dp_mesh, sp_mesh = mesh["dp"], mesh["sp"]
    dp_rank, dp_world = dp_mesh.get_local_rank(), dp_mesh.size()
    eager = _llama().to(dtype)
    model, ref = copy.deepcopy(eager), copy.deepcopy(eager).double()
    opt_e, opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (eager, model, ref))
    sp = graphoffload.SequenceParallel(group=sp_mesh, batch=batch_mode, timeout_s=60)
    # small buckets: several gradient buckets, each with its two collectives
    step = graphoffload.offload_compile(step_fn, sequence_parallel=sp, offload=offload,
                                        data_parallel=graphoffload.ZeRO(stage=stage, group=dp_mesh,
                                                                        bucket_numel=8192, timeout_s=60))
    exact = dtype == torch.float64
    for batch in _batches(dp_world):
        rows = batch["input_ids"].shape[0] // dp_world
        mine = {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in batch.items()}
        with torch.no_grad():   # this dp rank's micro-batch's loss, from the parameters every rank holds
            own = eager(**mine).loss + (_penalty(eager) if step_fn is _penalized_hf_step else 0)
        step_fn(eager, opt_e, batch)   # the dp micro-batches together, full sequences
        if not exact:
            step_fn(ref, opt_ref, batch)
        got = step(model, opt, sp.shard(mine) if batch_mode == "sharded" else mine)
        assert torch.allclose(got, own, rtol=RTOL, atol=0), (rank, got, own)   # Llama's loss is fp32 (upcast)
        if exact:   # fp64: the same sums in another order
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                err = ((_full(p) - q).abs().max() / q.abs().max()).item()
                # (offload=: fp32 master weights of the fp64 model, as tests/test_zero_offload.py holds them)
                assert err <= (FP64_RTOL if offload is None else RTOL), \
                    f"rank {rank} stage {stage} {batch_mode} {offload}: {name} is {err:.3g} from eager"
    if not exact:
        _fp32_close(model, opt, eager, opt_e, ref, opt_ref)

    # optimizer state: Shard(0) DTensors over the dp dimension, this dp rank's rows
    for p, state in opt.state.items():
        for key, t in state.items():
            if key != "step":
                assert isinstance(t, DTensor) and t.placements == (Shard(0),) and t.device_mesh.size() == dp_world
                assert t.to_local().shape[0] == shard_rows(p.shape[0], dp_world, dp_rank)[1]
    # the gradients: per bucket one all-reduce over all four ranks (stage 1) or a reduce-scatter over
    # dp and an all-reduce of its result over sp (stages 2, 3); the loss: one all-reduce over sp
    final = step.last.stages["final"]
    assert (offload is not None) == any(s.host for s in final.signature.inputs)   # state in host memory
    (shards,) = final.notes_of("zero", "shards")
    (two,) = final.notes_of("zero", "two_dimensions")
    (deferred,) = final.notes_of("ring_attention", "deferred_gradients")
    buckets = shards.fields["buckets"]
    # every gradient a partial sum ring attention left, or whole over sp (read off the split sequence)
    assert buckets > 1 and len(deferred.fields["gradients"]) + len(two.fields["whole_over_sequence_parallel"]) \
        == shards.fields["params"]
    sp_group = two.fields["sequence_parallel_group"]
    assert sp_group == deferred.fields["group"]   # the group ring attention left the sums over
    groups = {two.fields["data_parallel_group"]: "dp", sp_group: "sp", two.fields["mesh_group"]: "mesh"}
    assert len(groups) == 3
    by_group: dict = {}
    for n in final.graph.nodes:
        if n.op == "call_function" and n.target in (c10d.all_reduce_coalesced.default, c10d.all_reduce.default,
                                                    c10d.reduce_scatter_tensor.default,
                                                    c10d.all_gather_into_tensor.default):
            key = (n.target, groups[n.args[-1]])
            by_group[key] = by_group.get(key, 0) + 1
    gathers = {3: shards.fields["buckets"] and len(final.notes_of("zero", "params")[0].fields["forward_buckets"])
               + len(final.notes_of("zero", "params")[0].fields["backward_buckets"]) if stage == 3 else 0,
               1: buckets, 2: buckets}[stage]
    want = {(c10d.all_gather_into_tensor.default, "dp"): gathers}
    if step_fn is _clipped_hf_step:   # the global norm: one scalar all-reduce over dp (the chunks are sp sums)
        want[(c10d.all_reduce.default, "dp")] = 1
    if stage == 1:
        want.update({(c10d.all_reduce_coalesced.default, "mesh"): buckets,   # one collective over both
                     (c10d.all_reduce.default, "sp"): 1})
    else:
        want.update({(c10d.reduce_scatter_tensor.default, "dp"): buckets,
                     (c10d.all_reduce.default, "sp"): buckets + 1})
    if step_fn is _penalized_hf_step:   # lm_head's sequence part summed over sp where the penalty's gradient meets it
        want[(c10d.all_reduce.default, "sp")] = want.get((c10d.all_reduce.default, "sp"), 0) + 1
        assert two.fields["whole_over_sequence_parallel"] == ("lm_head.weight",), two.fields
    assert by_group == want, (stage, by_group, want)
    return model, opt, step


def _state(model, opt) -> dict:
    names = {p: n for n, p in model.named_parameters()}
    return {"params": {n: _full(p).clone() for n, p in model.named_parameters()},
            "state": {names[p]: {k: _full(t).clone() for k, t in s.items()} for p, s in opt.state.items()}}


def _dcp_round_trip(rank, mesh, model, opt, path):
    """DCP saves the model and the dp-sharded state (the two ranks of an sp group hold the same
    chunks) and loads them into a fresh model and step on the same mesh, every value as saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    saved = _state(model, opt)
    fresh = _llama().double()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    step = graphoffload.offload_compile(hf_step, sequence_parallel=graphoffload.SequenceParallel(group=mesh["sp"]),
                                        data_parallel=graphoffload.ZeRO(stage=2, group=mesh["dp"]))
    dp_rank = mesh["dp"].get_local_rank()
    step.compile(fresh, fresh_opt, {k: v[2 * dp_rank:2 * dp_rank + 2] for k, v in _batches(2)[0].items()})
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    loaded = _state(fresh, fresh_opt)
    assert loaded.keys() == saved.keys()
    for part in saved:
        for name, value in saved[part].items():
            if part == "params":
                assert torch.equal(loaded[part][name], value), (rank, name)
            else:
                assert loaded[part][name].keys() == value.keys()
                assert all(torch.equal(loaded[part][name][k], v) for k, v in value.items()), (rank, name)


K = 2   # accumulation_steps


def _accumulates_as_eager(rank, mesh, stage, offload=None, step_fn=hf_step):
    """accumulation_steps=K: each rank's running sums are its partial sums over its sequence part
    of its micro-batches; the updating call reduces them over both groups, once per update, and
    the accumulating calls run no gradient collective (their only one: the loss's, over sp).
    With `offload=` too (ZeRO-Offload), the updating call updates the rank's chunks on the host.
    With `Offload(accumulate_on="host")` every call reduces its gradients over both groups (per
    bucket a reduce-scatter over dp, then an all-reduce of this rank's part over sp) and adds
    this rank's chunk into its host sum, so no call holds a sum on the device ("auto": where the
    step's one choice, the `sum_choice` note, puts them). With `_penalized_hf_step` (host sums only:
    with device sums ring attention refuses a whole gradient added into a partial sum) lm_head's
    gradient is whole over sp on every call, sent by sp rank 0 alone."""
    penalized = step_fn is _penalized_hf_step
    dp_rank = mesh["dp"].get_local_rank()
    eager = _llama().double()
    model = copy.deepcopy(eager)
    opt_e, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (eager, model))
    step = graphoffload.offload_compile(step_fn, accumulation_steps=K, offload=offload,
                                        sequence_parallel=graphoffload.SequenceParallel(group=mesh["sp"]),
                                        data_parallel=graphoffload.ZeRO(stage=stage, group=mesh["dp"],
                                                                        bucket_numel=8192))
    for i, batch in enumerate(_batches(2) + _batches(2)[::-1]):   # two windows
        mine = {k: v[2 * dp_rank:2 * dp_rank + 2] for k, v in batch.items()}
        with torch.no_grad():   # this dp rank's micro-batch's loss, from the parameters every rank holds
            own = eager(**mine).loss + (_penalty(eager) if penalized else 0)
        ((eager(**batch).loss + (_penalty(eager) if penalized else 0)) / K).backward()
        if i % K == K - 1:
            opt_e.step()
            opt_e.zero_grad()
        got = step(model, opt, mine)
        assert torch.allclose(got, own, rtol=RTOL, atol=0), (rank, stage, offload, i, got, own)
        final = step.last.stages["final"]
        targets = [n.target for n in final.graph.nodes]
        gradient_collectives = sum(targets.count(t) for t in (c10d.reduce_scatter_tensor.default,
                                                              c10d.all_reduce_coalesced.default))
        choice = final.notes_of("zero", "sum_choice")
        host = (choice[0].fields["where"] if choice else offload.accumulate_on if offload else "device") == "host"
        if host:   # this call's collectives by group: per bucket dp then sp, and the loss's over sp
            (sums,) = final.notes_of("zero", "host_sums")
            (two,) = final.notes_of("zero", "two_dimensions")
            (deferred,) = final.notes_of("ring_attention", "deferred_gradients")
            whole = two.fields["whole_over_sequence_parallel"]
            assert sums.fields["update"] == (i % K == K - 1) and whole == (("lm_head.weight",) if penalized else ())
            # the gradients ring attention left partial, and the whole one: those the update reads, on both calls
            assert len(deferred.fields["gradients"]) + len(whole) == sums.fields["sums"] > 1, (i, deferred.fields)
            assert not any(s.kind == "grad_sum" and not s.host for s in final.signature.inputs)
            groups = {two.fields["data_parallel_group"]: "dp", two.fields["sequence_parallel_group"]: "sp"}
            by_group: dict = {}
            for n in final.graph.nodes:
                if n.op == "call_function" and n.target in (c10d.all_reduce_coalesced.default, c10d.all_reduce.default,
                                                            c10d.reduce_scatter_tensor.default):
                    key = (n.target, groups[n.args[-1]])
                    by_group[key] = by_group.get(key, 0) + 1
            buckets = sums.fields["buckets"]
            # (penalized: lm_head's sequence part summed over sp where the penalty's gradient meets it)
            assert buckets > 1 and by_group == {(c10d.reduce_scatter_tensor.default, "dp"): buckets,
                                                (c10d.all_reduce.default, "sp"): buckets + 1 + penalized}, (i, by_group)
        else:   # the loss's all-reduce over sp every call; the updating call's per bucket: stage 1 one
            # all_reduce_coalesced over both groups, stages 2-3 a reduce-scatter over dp, then an all-reduce over sp
            update = i % K == K - 1
            assert (gradient_collectives > 0) == update, (i, gradient_collectives)
            assert targets.count(c10d.all_reduce.default) == 1 + (gradient_collectives if update and stage != 1 else 0)
            assert targets.count(c10d.all_reduce_coalesced.default) == (gradient_collectives if stage == 1 else 0)
    assert (offload is not None) == any(s.host for s in step.last.stages["final"].signature.inputs)   # state on the host
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        err = ((_full(p) - q).abs().max() / q.abs().max()).item()
        assert err <= (FP64_RTOL if offload is None else RTOL), \
            f"rank {rank} stage {stage} accumulating {offload}: {name} is {err:.3g} from eager"
        for key in ("exp_avg", "exp_avg_sq"):   # the moments, gathered
            want = opt_e.state[q][key]
            err = ((_full(opt.state[p][key]) - want).abs().max() / want.abs().max()).item()
            assert err <= (FP64_RTOL if offload is None else RTOL), \
                f"rank {rank} stage {stage} accumulating {offload}: {key} of {name} is {err:.3g} from eager"
    return step


def _accumulates_as_eager_choosing_the_sums(rank, mesh):
    """ZeRO-Offload with accumulation_steps on the mesh, stage 2: `accumulate_on="auto"` under a
    budget above both trial peaks (device sums, as `"device"`), explicit host sums (with a parameter
    read off the split sequence too: its gradient whole over sp), and "auto" under
    a budget between the two peaks (host sums). Each peak is the max over all four ranks, so every
    rank makes the same choice; each run trains two windows as eager (`_accumulates_as_eager`)."""
    def choice(budget):
        step = _accumulates_as_eager(rank, mesh, 2, offload=graphoffload.Offload(accumulate_on="auto",
                                                                                  gpu_memory_budget=budget))
        notes = [v.graph.notes_of("zero", "sum_choice") for v in step._variants.values()]
        assert len(notes) == 2 and notes[0] == notes[1], notes   # both variants carry the one choice
        return notes[0][0].fields

    above = choice(1 << 40)
    assert above["where"] == "device" and above["host_peak"] < above["device_peak"], above
    _accumulates_as_eager(rank, mesh, 2, offload=graphoffload.Offload(accumulate_on="host"), step_fn=_penalized_hf_step)
    between = choice((above["device_peak"] + above["host_peak"]) // 2)
    assert between["where"] == "host" and (between["device_peak"], between["host_peak"]) == \
        (above["device_peak"], above["host_peak"]), (between, above)


def _offloads_activations_as_eager(rank, mesh, stage):
    """ZeRO-Offload (all on the CPU path) with `activations="auto"` on the mesh. Under a budget of
    1 TiB nothing moves; its keep-everything peak (the max over the four ranks, so every rank plans
    against the same budget; stage 3's is higher than with activations kept: its backward gathers
    take each bucket whole) times 0.9 is the budget of the run, where the planner must both
    recompute and offload saved activations (stage 2: 8 and 7 of 23 candidates when this was
    written, stage 3: 3 and 7 of 18; a fixed calibration, so the choices do not depend on this
    machine's rates), the plan meets the budget, and the run trains as eager (`_train_and_compare`:
    every call's loss the rank's own, parameters within RTOL, collectives counted per group)."""
    import torch.distributed as dist
    from test_offload_planner import BALANCED

    def offload(budget):
        return graphoffload.Offload(device_updates="never", activations="auto", gpu_memory_budget=budget,
                                    calibration=BALANCED)

    model = _llama().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    unbound = graphoffload.offload_compile(hf_step, offload=offload(1 << 40),
                                           sequence_parallel=graphoffload.SequenceParallel(group=mesh["sp"],
                                                                                           timeout_s=60),
                                           data_parallel=graphoffload.ZeRO(stage=stage, group=mesh["dp"],
                                                                           bucket_numel=8192, timeout_s=60))
    dp_rank = mesh["dp"].get_local_rank()
    unbound.compile(model, opt, {k: v[2 * dp_rank:2 * dp_rank + 2] for k, v in _batches(2)[0].items()})
    fields = unbound.last.stages["final"].notes_of("offload_optimizer", "activations")[0].fields
    assert fields["recompute"] == fields["offload"] == 0, (rank, stage, fields)
    peak = torch.tensor(fields["keep_peak_bytes"])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    budget = int(0.9 * int(peak))
    _, _, step = _train_and_compare(rank, mesh, stage, "full", torch.float64, offload=offload(budget))
    fields = step.last.stages["final"].notes_of("offload_optimizer", "activations")[0].fields
    assert fields["recompute"] > 0 and fields["offload"] > 0 and fields["peak_bytes"] <= budget, \
        f"rank {rank} stage {stage} activations='auto' under {budget} B: {dict(fields)}"
    assert step.memory("final").peak <= budget, (rank, stage, step.memory("final").peak, budget)


def _overlaps_the_next_step(rank, mesh, stage, k=1, where="device"):
    """ZeRO-Offload with `overlap_next_step=True` on the mesh: every CPU-path bucket's upload of this
    rank's rows runs on past the call. Stages 1-2: each update's all-gathers of the updated chunks
    (over dp) move to the start of the next call. Three windows of `k` calls (`accumulation_steps`,
    the running sums `where`), fp64 model (fp32 master weights): after the first `synchronize()`
    gathers every bucket (and the next call then gathers none), after the second none (the third
    window's first call gathers every bucket at its start), after the third `synchronize()` again.
    Stage 3: every call gathers for its forward and backward as without overlap, and synchronize()
    waits for the uploads, gathering nothing. Every call's loss is the rank's own micro-batch's from
    eager's parameters (so the rows it read were the update's); after each synchronize() the
    parameters and the gathered moments are within RTOL of eager (accumulating, with k > 1) on the
    whole batches."""
    from test_zero_offload import _all_gathers

    dp_rank = mesh["dp"].get_local_rank()
    eager = _llama().double()
    model = copy.deepcopy(eager)
    opt_e, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (eager, model))
    offload = graphoffload.Offload(device_updates="never", overlap_next_step=True, accumulate_on=where)
    step = graphoffload.offload_compile(
        hf_step, offload=offload, accumulation_steps=k,
        sequence_parallel=graphoffload.SequenceParallel(group=mesh["sp"], timeout_s=60),
        data_parallel=graphoffload.ZeRO(stage=stage, group=mesh["dp"], bucket_numel=8192, timeout_s=60))
    batches = (_batches(2) * 3)[:3 * k]
    mine = [{key: v[2 * dp_rank:2 * dp_rank + 2] for key, v in batch.items()} for batch in batches]
    step.compile(model, opt, mine[0])   # (compiling issues all-gathers of its own: not counted)
    what = f"rank {rank} stage {stage} overlap_next_step k={k} {where} sums"
    counts = []
    for i, batch in enumerate(batches):
        with torch.no_grad():   # this dp rank's micro-batch's loss, from the parameters every rank holds
            own = eager(**mine[i]).loss
        (eager(**batch).loss / k).backward()
        got, gathers = _all_gathers(lambda: step(model, opt, mine[i]))
        counts.append(gathers)
        assert torch.allclose(got, own, rtol=RTOL, atol=0), (what, i, got, own)
        if i % k < k - 1:
            continue
        opt_e.step()
        opt_e.zero_grad()
        executor = step.last.executor
        assert executor.gathers_pending == (stage != 3) and executor.params_in_flight(), (what, i)
        if i // k == 1:
            continue
        counts.append(_all_gathers(step.synchronize)[1])
        assert not executor.gathers_pending and not executor.params_in_flight(), (what, i)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            err = ((_full(p) - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"{what}, synchronized after call {i}: {name} is {err:.3g} from eager"
            for key in ("exp_avg", "exp_avg_sq"):   # the moments, gathered
                want = opt_e.state[q][key]
                err = ((_full(opt.state[p][key]) - want).abs().max() / want.abs().max()).item()
                assert err <= RTOL, f"{what}, synchronized after call {i}: {key} of {name} is {err:.3g} from eager"
    final = step.last.stages["final"]
    if stage == 3:   # per call forward's and backward's gathers, synchronize() none
        params = final.notes_of("zero", "params")[0].fields
        per_call, per_update, synchronized = len(params["forward_buckets"]) + len(params["backward_buckets"]), 0, 0
        assert not final.notes_of("zero", "deferred_gathers"), what
    else:   # each update's gathers in the next call or synchronize()
        per_call, per_update = 0, final.notes_of("zero", "deferred_gathers")[0].fields["buckets"]
        synchronized = per_update
        assert per_update > 1, what
    want, pending = [], 0
    for w in range(3):
        for _ in range(k):
            want.append(per_call + pending)
            pending = 0
        pending = per_update
        if w != 1:
            want.append(synchronized)
            pending = 0
    if k > 1:   # the first updating call compiles its variant, which gathers on its own: not counted
        want[k - 1] = counts[k - 1]
    assert counts == want, (what, counts, want)
    assert (where == "host") == bool(final.notes_of("zero", "host_sums")), what
    # every CPU-path bucket's upload runs on past the call (all of them: device_updates="never")
    handed = final.notes_of("offload_optimizer", "handed_over")[0].fields["buckets"]
    assert handed == final.notes_of("offload_optimizer", "offloaded")[0].fields["buckets"] >= 1, (what, handed)


POISONED = 1   # the step whose batch is not finite
TOKEN = 63      # embedding row 63: in dp rank 1's chunk (rows 32..63 of 64)


def _poisoned_step(model, batch):
    """Llama's loss plus `offset` (an inf offset makes the loss inf, the gradients finite), its
    token embeddings' gradient multiplied by 1 + `poison` (their values unchanged): a poisoned
    position holding TOKEN overflows embedding row TOKEN's gradient alone, in dp rank 1's chunk."""
    emb = model.get_input_embeddings()(batch["input_ids"])
    emb = emb + batch["poison"][..., None] * (emb - emb.detach())
    return model(inputs_embeds=emb, labels=batch["labels"]).loss + batch["offset"].mean()


plain_step, scaled_step, eager_skipping_step = loss_steps(_poisoned_step)


def _poisoned_batches(key: str, value: float, k: int = 1) -> list[dict]:
    """(STEPS + 1) windows of k whole batches of 2 dp micro-batches; in window POISONED, dp rank 0's
    first row gets `value` in `key`: "poison" at sequence position 0 (sp rank 0's part; its token set
    to TOKEN) in the window's first call (its accumulated gradient carries the overflow to the
    update), "offset" for the row (the loss of dp rank 0's micro-batch, on both its sp ranks) in the
    window's last call, the one that updates."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range((STEPS + 1) * k):
        x = torch.randint(0, TOKEN, (4, 16), generator=g)   # TOKEN only where poisoned
        batch = {"input_ids": x, "labels": x, "offset": torch.zeros(4, dtype=torch.float64),
                 "poison": torch.zeros(4, 16, dtype=torch.float64)}
        if key == "poison" and i == POISONED * k:
            x[0, 0] = TOKEN
            batch["poison"][0, 0] = value
        if key == "offset" and i == POISONED * k + k - 1:
            batch["offset"][0] = value
        out.append(batch)
    return out


def _eager_window(model, optimizer, scaler, window: list[dict]) -> bool:
    """Single-process eager on the whole batches of one window of accumulation: each call's loss
    divided by its length; a GradScaler steps once on the sums, skip_nonfinite (no scaler) skips
    the update when the last call's loss or the accumulated gradients' global norm is not finite."""
    k = len(window)
    for batch in window:
        loss = _poisoned_step(model, batch)
        (scaler.scale(loss / k) if scaler is not None else loss / k).backward()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
        skipped = False
    else:
        skipped = nonfinite_eagerly(loss, model)
        if not skipped:
            optimizer.step()
    optimizer.zero_grad()
    return skipped


def _skips_as_eager(rank, mesh, stage, scaler: bool, k: int = 1, offload=None):
    """A GradScaler (an overflow in dp rank 0's, sp rank 0's part of the gradient of a row dp rank 1
    holds) or skip_nonfinite=True (dp rank 0's loss inf): every rank skips the poisoned step as
    single-process eager on the whole batch does, fp64, with the same scale; the flags are
    combined over dp alone (one scalar all-reduce each), the sp ranks agreeing already. With
    `accumulation_steps=k` each step is a window of k calls (eager: accumulation over the window's
    whole batches), and with `offload=` the rank's chunks update on the host from the combined flag
    (fp32 master weights of the fp64 model: within RTOL)."""
    dp_rank = mesh["dp"].get_local_rank()
    eager = _llama().double()
    model = copy.deepcopy(eager)
    opt_e, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (eager, model))
    sp = graphoffload.SequenceParallel(group=mesh["sp"], timeout_s=60)
    zero = graphoffload.ZeRO(stage=stage, group=mesh["dp"], bucket_numel=8192, timeout_s=60)
    if scaler:
        scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1) for _ in range(2)]
        step = graphoffload.offload_compile(scaled_step, sequence_parallel=sp, data_parallel=zero,
                                            accumulation_steps=k, offload=offload)
        batches = _poisoned_batches("poison", 1e308, k)   # * 2**16 overflows fp64
    else:
        scalers = [None, None]
        step = graphoffload.offload_compile(plain_step, sequence_parallel=sp, data_parallel=zero,
                                            accumulation_steps=k, offload=offload,
                                            config=graphoffload.CompileConfig(skip_nonfinite=True))
        batches = _poisoned_batches("offset", float("inf"), k)
    scales = []
    for i in range(STEPS + 1):
        window = batches[i * k:(i + 1) * k]
        before = _full(model.model.embed_tokens.weight).clone()
        skipped = _eager_window(eager, opt_e, scalers[0], window)
        for batch in window:
            mine = {key: v[2 * dp_rank:2 * dp_rank + 2] for key, v in batch.items()}
            step(model, opt, *scalers[1:] if scaler else (), mine)
        if scaler:
            assert scalers[1].get_scale() == scalers[0].get_scale(), (rank, i, scalers[1].get_scale())
            scales.append(scalers[1].get_scale())
        else:
            assert skipped == (i == POISONED) and step.skipped_steps == int(i >= POISONED), (rank, i)
        if i == POISONED:
            assert torch.equal(_full(model.model.embed_tokens.weight), before), rank   # skipped everywhere
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            err = ((_full(p) - q).abs().max() / q.abs().max()).item()
            assert err <= (FP64_RTOL if offload is None else RTOL), \
                f"rank {rank} stage {stage} scaler={scaler} k={k} {offload} step {i}: {name} is {err:.3g}"
    if scaler:   # grown on each clean step (growth_interval=1), backed off on the poisoned one
        assert scales == [2.0**17, 2.0**16, 2.0**17], scales
    assert all(s["step"].item() == STEPS for s in opt.state.values())   # STEPS + 1 windows, one skipped
    final = step.last.stages["final"]
    assert (offload is not None) == any(s.host for s in final.signature.inputs)   # state in host memory
    (nonfinite,) = final.notes_of("zero", "nonfinite")
    assert (nonfinite.fields["checks"] >= 1) == scaler and nonfinite.fields["skip_nonfinite"] == (not scaler)


def _mesh_2x2(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    # the same group given for both dimensions: refused on every rank before anything is traced
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = graphoffload.offload_compile(hf_step, sequence_parallel=graphoffload.SequenceParallel(group=mesh["sp"]),
                                        data_parallel=graphoffload.ZeRO(stage=2, group=mesh["sp"]))
    with pytest.raises(graphoffload.UnsupportedError, match=r"data-parallel group has ranks \[\d, \d\] and its "
                                                            r"sequence-parallel group ranks \[\d, \d\]: they share"):
        step(model, opt, _batches(1)[0])
    assert not opt.state and step.trace_count == 0
    _silent_fourth_rank(rank, world, mesh)
    # the two ranks of an sp group given different micro-batches (batch="full"): refused on both,
    # the check per sp group (the dp ranks' micro-batches differ in every run below)
    step = graphoffload.offload_compile(hf_step, sequence_parallel=graphoffload.SequenceParallel(group=mesh["sp"]),
                                        data_parallel=graphoffload.ZeRO(stage=2, group=mesh["dp"]))
    with pytest.raises(graphoffload.StateError, match=r"sequence parallelism: rank \d was given another batch"):
        step(model, opt, _batches(2)[rank % 2])
    assert not opt.state and step.trace_count == 0
    _train_and_compare(rank, mesh, 1, "full", torch.float64, _clipped_hf_step)   # clip_grad_norm_ too
    model, opt, _ = _train_and_compare(rank, mesh, 2, "sharded", torch.float64)
    _dcp_round_trip(rank, mesh, model, opt, path)
    _train_and_compare(rank, mesh, 3, "full", torch.float32)
    for stage in (1, 2, 3):   # device sums (stage 1: one all_reduce_coalesced over both groups per bucket)
        _accumulates_as_eager(rank, mesh, stage)
    # ZeRO-Offload, with a parameter read off the split sequence too (its gradient whole over sp)
    _train_and_compare(rank, mesh, 2, "full", torch.float64, _penalized_hf_step, offload=graphoffload.Offload())
    for stage in (2, 3):   # ... activations="auto" under 0.9x of the keep-everything peak
        _offloads_activations_as_eager(rank, mesh, stage)
    for stage in (1, 2, 3):   # ... overlap_next_step (1-2: the all-gathers deferred to the next call or synchronize())
        _overlaps_the_next_step(rank, mesh, stage)
    _overlaps_the_next_step(rank, mesh, 1, K, "device")   # ... with accumulation_steps, device sums
    _overlaps_the_next_step(rank, mesh, 2, K, "host")     # ... and host sums
    _accumulates_as_eager_choosing_the_sums(rank, mesh)   # ... accumulating, device, host and "auto" sums
    for stage in (1, 3):   # host sums at the other stages (stage 2's above), lm_head's gradient whole over sp
        _accumulates_as_eager(rank, mesh, stage, offload=graphoffload.Offload(accumulate_on="host"),
                              step_fn=_penalized_hf_step)
    _skips_as_eager(rank, mesh, 2, scaler=True)    # a GradScaler
    _skips_as_eager(rank, mesh, 2, scaler=False)   # skip_nonfinite=True
    _skips_as_eager(rank, mesh, 1, scaler=True)    # stage 1 with a GradScaler
    _skips_as_eager(rank, mesh, 3, scaler=True, offload=graphoffload.Offload())   # stage 3, GradScaler, offload=
    _skips_as_eager(rank, mesh, 2, scaler=True, k=K)   # a GradScaler with accumulation_steps
    _skips_as_eager(rank, mesh, 2, scaler=False, k=K, offload=graphoffload.Offload())   # skip_nonfinite, both


@pytest.mark.slow   # four processes
def test_zero_with_ring_attention_on_a_2x2_mesh_trains_as_eager_and_refuses_bad_meshes_and_silent_ranks(tmp_path):
    run_ranks(_mesh_2x2, 4, str(tmp_path), deadline_s=500)


def _silent_fourth_rank(rank, world, mesh):
    """Rank 3 never calls: the others raise RankTimeoutError from the first call's check of the
    mesh after timeout_s, nothing traced; then rank 3 answers that gather (a (2, world) int64
    per rank), so the world group is whole again for what follows."""
    import torch.distributed as dist

    gave_up = torch.zeros(1)
    if rank == 3:
        for other in range(3):
            dist.recv(gave_up, other, tag=7)
        dist.all_gather([torch.empty(2, world, dtype=torch.int64) for _ in range(world)],
                        torch.full((2, world), -1, dtype=torch.int64))
        return
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = graphoffload.offload_compile(hf_step,
                                        sequence_parallel=graphoffload.SequenceParallel(group=mesh["sp"], timeout_s=1),
                                        data_parallel=graphoffload.ZeRO(stage=2, group=mesh["dp"], timeout_s=1))
    with pytest.raises(graphoffload.RankTimeoutError, match=rf"rank {rank} of 4 waited 1 s for the other ranks"):
        step(model, opt, _batches(2)[0])
    assert step.trace_count == 0 and not opt.state
    dist.send(gave_up, 3, tag=7)


# ---------------------------------------------------------------- no processes


def test_groups_that_are_not_a_mesh_are_refused_naming_both():
    # 2 x 2 mesh [[0, 1], [2, 3]]: dp groups are the columns, sp groups the rows
    dp = [[0, 2], [1, 3], [0, 2], [1, 3]]
    sp = [[0, 1], [0, 1], [2, 3], [2, 3]]
    check_orthogonal(dp, sp, 4)
    check_orthogonal([[0, 1, 2, 3]] * 4, [[r] for r in range(4)], 4)   # sp of one rank each
    with pytest.raises(graphoffload.UnsupportedError, match=r"rank 0's data-parallel group has ranks \[0, 1\] and "
                                                            r"its sequence-parallel group ranks \[0, 1\]: they share"):
        check_orthogonal(sp, sp, 4)
    with pytest.raises(graphoffload.UnsupportedError, match=r"sizes 2 x 2 are not the world size 8"):
        check_orthogonal(dp + dp, sp + sp, 8)
    with pytest.raises(graphoffload.UnsupportedError, match=r"rank 2 is in it but names data-parallel ranks \[1, 2\]"):
        check_orthogonal([[0, 2], [1, 2], [1, 2], [1, 3]], sp, 4)


def test_a_device_mesh_dimension_is_a_group_and_a_2d_mesh_is_refused(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "sp"))
    zero = graphoffload.ZeRO(group=mesh["dp"])
    assert zero.world_size == 1 and zero.rank == 0 and zero.process_group() is mesh["dp"].get_group()
    with pytest.raises(graphoffload.UnsupportedError, match=r"was given a 2-D DeviceMesh.*pass one dimension of it, "
                                                            r"e.g. mesh\['dp'\]"):
        graphoffload.ZeRO(group=mesh).process_group()



def test_a_failed_collective_names_both_groups(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    from graphoffload.groups import MeshRankFailed

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "sp"))
    failed = MeshRankFailed(graphoffload.ZeRO(group=mesh["dp"], timeout_s=3),
                            graphoffload.SequenceParallel(group=mesh["sp"], timeout_s=4))
    error = failed(RuntimeError("connection closed by peer"), "all_reduce, node all_reduce_1")
    assert isinstance(error, graphoffload.RankTimeoutError)
    message = str(error)
    for part in ("(all_reduce, node all_reduce_1)", "data-parallel global ranks [0] (timing out after ZeRO(timeout_s=3))",
                 "sequence-parallel ranks [0] (SequenceParallel(timeout_s=4))", "connection closed by peer",
                 "restart the job from the last checkpoint"):
        assert part in message, (part, message)
