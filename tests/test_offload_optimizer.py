"""offload_optimizer on the CPU path: the whole schedule (copies into separate host buffers,
updates on the worker thread, uploads, waits) runs with CPU tensors and must match eager."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from gpt import GPT
from steps import TINY, clipped_step, token_batches, train_step

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload



def batches(n: int):
    return token_batches(n)


def offloaded(step_fn=train_step, **fuse):
    config = CompileConfig(fuse_optimizer=FuseOptimizer(**fuse)) if fuse else None
    return graphoffload.offload_compile(step_fn, config=config, offload=Offload())


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=0.01, amsgrad=True, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("step_fn", [train_step, clipped_step], ids=["plain", "clip"])
def test_offloaded_fp32_training_matches_eager_bit_for_bit(opt_name, step_fn):
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS[opt_name](eager.parameters()), OPTIMIZERS[opt_name](compiled.parameters())
    step = offloaded(step_fn, bucket_numel=4096)   # several buckets, so several host updates in flight
    for b in batches(10):
        assert step_fn(eager, opt_e, b).item() == step(compiled, opt_c, b).item()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), name
        for key, value in opt_e.state[pe].items():
            assert torch.equal(value.cpu(), opt_c.state[pc][key]), (name, key)
    ops = {getattr(n.target, "name", lambda: "")().split("::")[-1] for n in step.train_graph.graph.nodes}
    assert {"copy_to_host", "copy_to_device", "wait_device"} <= ops
    assert len([n for n in step.train_graph.graph.nodes if n.meta["phase"] == "transfer"]) >= 3 * 2


def test_offloaded_state_lives_in_host_memory_and_leaves_the_device_peak():
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = OPTIMIZERS["adamw"](model.parameters())
    plain = graphoffload.offload_compile(train_step)
    twin = copy.deepcopy(model)
    plain(twin, OPTIMIZERS["adamw"](twin.parameters()), batches(1)[0])
    step = offloaded()
    step(model, opt, batches(1)[0])
    signature = step.train_graph.signature
    host = [s for s in signature.inputs if s.host]
    assert {s.target[1] for s in host if s.kind == "state"} == {"exp_avg", "exp_avg_sq", "step", "master_param"}
    assert all(s.kind in ("state", "host_scratch") for s in host)
    for p in model.parameters():
        assert set(opt.state[p]) == {"exp_avg", "exp_avg_sq", "step", "master_param"}
        assert opt.state[p]["master_param"].dtype == torch.float32
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    # exp_avg and exp_avg_sq (2 x 4 bytes a parameter) no longer count on the device
    assert plain.memory().resident - step.memory().resident >= 2 * param_bytes


def test_clipped_gradients_leave_the_device_inside_backward():
    # clip_grad_norm_ scales every gradient after backward; the host update does that scaling,
    # so each gradient is copied out (unscaled) as soon as it is final and the device frees it
    from gpt import GPTConfig
    cfg = GPTConfig(vocab_size=256, seq_len=8, n_layer=8, n_head=4, d_model=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = OPTIMIZERS["adamw"](model.parameters())
    batch = token_batches(1, cfg.vocab_size, cfg.seq_len, batch=1)[0]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    plain, clipped = offloaded(train_step), offloaded(clipped_step)
    plain.compile(model, opt, batch)
    clipped.compile(model, opt, batch)
    assert clipped.memory("final").peak <= plain.memory("final").peak + 0.1 * grad_bytes
    nodes = list(clipped.train_graph.graph.nodes)
    last_backward = max(i for i, n in enumerate(nodes) if n.meta["phase"] == "backward")
    copies = [i for i, n in enumerate(nodes) if n.target is torch.ops.graphoffload.copy_to_host.default
              and n.args[0] and n.args[0][0].meta["val"].dim() > 0]
    assert len(copies) == len(list(model.parameters()))
    assert sum(i < last_backward for i in copies) >= len(copies) - 1
    assert not any(n.target is torch.ops.aten.mul_.Tensor and n.meta["phase"] == "optimizer" for n in nodes)
    assert any("wait past backward" in line for line in clipped.train_graph.notes["offload_optimizer"])


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip"])
def test_mixed_precision_matches_eager_bf16_params_with_fp32_master(clip):
    torch.manual_seed(0)
    base = GPT(TINY)
    compiled = copy.deepcopy(base).to(torch.bfloat16)
    eager = copy.deepcopy(base).to(torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_() for p in eager.parameters()]
    opt_master = torch.optim.AdamW(master, lr=3e-3, weight_decay=0.1, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=3e-3, weight_decay=0.1)
    step = offloaded(clipped_step if clip else train_step, bucket_numel=4096)
    for b in batches(10):
        loss_e = eager(b["input_ids"], labels=b["labels"])
        loss_e.backward()
        if clip:   # on the bf16 gradients, as clipped_step does
            torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
        for m, p in zip(master, eager.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        opt_master.step()
        opt_master.zero_grad()
        with torch.no_grad():
            for m, p in zip(master, eager.parameters()):
                p.copy_(m)
        loss_c = step(compiled, opt_c, b)
        torch.testing.assert_close(loss_c.float(), loss_e.float(), rtol=1e-2, atol=1e-2)
    for (name, pe), pc, m in zip(eager.named_parameters(), compiled.parameters(), master):
        assert pc.dtype == torch.bfloat16
        # same kernels on the same fp32 master: identical up to bf16 rounding of the upload
        torch.testing.assert_close(pc, pe, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(opt_c.state[pc]["master_param"], m.detach(), rtol=0, atol=0)
        assert opt_c.state[pc]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("dtype,make_opt", [
    (torch.float32, OPTIMIZERS["adamw"]),
    # loading the bf16 parameters moves their version counters; the loaded master weights
    # (which the parameters equal once rounded) must not be replaced by the bf16 values
    (torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1)),
], ids=["fp32", "bf16-keeps-fp32-master"])
def test_checkpoint_round_trip_resumes_bit_identically(dtype, make_opt):
    torch.manual_seed(0)
    model = GPT(TINY).to(dtype)
    eager = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    step = offloaded()
    data = batches(6)
    for b in data[:3]:
        step(model, opt, b)
    saved_model = copy.deepcopy(model.state_dict())
    saved_state = copy.deepcopy(step.state_dict())
    for b in data[3:]:
        step(model, opt, b)

    resumed = GPT(TINY).to(dtype)
    resumed.load_state_dict(saved_model)
    resumed_opt = make_opt(resumed.parameters())
    resumed_step = offloaded()
    resumed_step.load_state_dict(saved_state, optimizers=[resumed_opt])
    for b in data[3:]:
        resumed_step(resumed, resumed_opt, b)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], resumed_opt.state[q][key]), (name, key)
    if dtype == torch.float32:
        # and the resumed run is eager's uninterrupted training, bit for bit (in bf16 the offloaded
        # step keeps fp32 master weights that eager bf16 AdamW does not: compared in
        # test_mixed_precision_matches_eager_bf16_params_with_fp32_master)
        eager_opt = make_opt(eager.parameters())
        for b in data:
            train_step(eager, eager_opt, b)
        for (name, p), q in zip(eager.named_parameters(), resumed.parameters()):
            assert torch.equal(p, q), name
            for key, value in eager_opt.state[p].items():
                assert torch.equal(value, resumed_opt.state[q][key]), (name, key)


def test_optimizer_state_loaded_before_compile_with_rounded_master_weights_is_refused():
    """optimizer.load_state_dict before the step compiles casts the fp32 master weights of a bf16
    model to bf16 (the step's dtype-keeping hook is not there yet): refused with what to do, before
    anything is trained from the rounded values."""
    torch.manual_seed(0)
    model = GPT(TINY).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = offloaded()
    data = batches(3)
    for b in data[:2]:
        step(model, opt, b)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    resumed = GPT(TINY).to(torch.bfloat16)
    resumed.load_state_dict(saved_model)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=3e-3)
    resumed_opt.load_state_dict(saved_opt)   # before the step exists: the master weights become bf16
    before = [p.detach().clone() for p in resumed.parameters()]
    resumed_step = offloaded()
    with pytest.raises(graphoffload.StateError, match=r"master weights .* rounded.*step\.load_state_dict"):
        resumed_step(resumed, resumed_opt, data[2])
    assert all(torch.equal(p, q) for p, q in zip(before, resumed.parameters()))
    # what the error says to do: the exact load, then the step resumes the uninterrupted run
    resumed_step.load_state_dict({"optimizers": [saved_opt]}, optimizers=[resumed_opt])
    resumed_step(resumed, resumed_opt, data[2])
    step(model, opt, data[2])
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_param_changed_between_steps_refreshes_its_master_copy():
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["sgd"](eager.parameters()), OPTIMIZERS["sgd"](compiled.parameters())
    step = offloaded()
    data = batches(3)
    train_step(eager, opt_e, data[0])
    step(compiled, opt_c, data[0])
    with torch.no_grad():   # e.g. the user re-initialises or loads weights between steps
        for p, q in zip(eager.parameters(), compiled.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    for b in data[1:]:
        train_step(eager, opt_e, b)
        step(compiled, opt_c, b)
    for p, q in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(p, q)


def test_budget_too_small_fails_at_compile_time_with_the_minimum():
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = OPTIMIZERS["adamw"](model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    step = graphoffload.offload_compile(train_step, offload=Offload(gpu_memory_budget="1KiB"))
    with pytest.raises(graphoffload.UnsupportedError,
                       match=r"1KiB cannot be met.*at least [0-9.]+ KiB \([0-9,]+ bytes\)") as failed:
        step(model, opt, batches(1)[0])
    minimum = int(re.search(r"\(([0-9,]+) bytes\)", str(failed.value)).group(1).replace(",", ""))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(not opt.state[p] for p in model.parameters())   # the state compiling created is dropped

    # a budget just above the reported minimum is met, so the minimum is what the plan reaches
    budget = minimum + minimum // 50
    fits = graphoffload.offload_compile(train_step, offload=Offload(gpu_memory_budget=f"{budget}B"))
    fits(model, opt, batches(1)[0])
    assert fits.memory().peak <= budget


def test_offload_options_are_validated():
    with pytest.raises(ValueError, match="cannot read"):
        Offload(gpu_memory_budget="lots")
    with pytest.raises(ValueError, match="cpu_workers"):
        Offload(cpu_workers=0)
    assert Offload(gpu_memory_budget="1.5 GiB").budget_bytes() == int(1.5 * 2**30)


def test_param_groups_scheduler_and_dropout_with_hybrid_offload_match_eager():
    import dataclasses
    import warnings

    from test_offload_planner import BALANCED

    cfg = dataclasses.replace(TINY, dropout=0.1)

    def make_opt(model):
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                  {"params": vectors, "weight_decay": 0.0, "lr": 1e-2}], lr=3e-3, fused=True)

    torch.manual_seed(0)
    eager = GPT(cfg)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = make_opt(eager), make_opt(compiled)
    sched_e = torch.optim.lr_scheduler.StepLR(opt_e, 2, 0.5)
    sched_c = torch.optim.lr_scheduler.StepLR(opt_c, 2, 0.5)
    step = graphoffload.offload_compile(train_step, config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=3000)),
                                        offload=Offload(device_updates=2, calibration=BALANCED))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # e.g. the scheduler's "lr_scheduler.step() before optimizer.step()"
        for b in batches(6):
            torch.manual_seed(1)
            loss_e = train_step(eager, opt_e, b)
            torch.manual_seed(1)    # the same dropout masks
            assert step(compiled, opt_c, b).item() == loss_e.item()
            sched_e.step()
            sched_c.step()
    assert step.trace_count == 1    # the lr is a graph input: the schedule needs no re-trace
    for pe, pc in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(pe, pc)


@pytest.mark.parametrize("step_fn", [train_step, clipped_step], ids=["plain", "clip"])
def test_uploads_handed_over_to_the_next_step_keep_training_exact(step_fn):
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["adamw"](eager.parameters()), OPTIMIZERS["adamw"](compiled.parameters())
    step = graphoffload.offload_compile(step_fn, offload=Offload(overlap_next_step=True),
                                        config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=4096)))
    probe = batches(1)[0]["input_ids"]
    for i, b in enumerate(batches(8)):
        assert step_fn(eager, opt_e, b).item() == step(compiled, opt_c, b).item()
        if i == 3:   # the model's own forward between steps sees the uploaded parameters
            with torch.no_grad():
                assert torch.equal(compiled(probe), eager(probe))
        if i == 5:   # and so does the optimizer's state_dict
            saved = opt_c.state_dict()["state"]
            for j, pe in enumerate(eager.parameters()):
                assert torch.equal(saved[j]["master_param"], pe)
    assert step.last.executor.params_in_flight()   # the last call's uploads were handed over
    step.synchronize()
    assert not step.last.executor.params_in_flight()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(pe, pc), name

    graph = step.train_graph.graph
    nodes = list(graph.nodes)
    waits = [n for n in nodes if n.target is torch.ops.graphoffload.wait_handed_over.default]
    assert len(waits) == len([n for n in nodes if n.target is torch.ops.graphoffload.hand_over.default]) > 1
    assert not any(n.target is torch.ops.graphoffload.wait_device.default for n in nodes)
    for wait in waits:   # each waits right before the first node that reads its parameters
        first = min((u for p in wait.args[0] for u in p.users if u is not wait), key=nodes.index)
        assert nodes.index(wait) < nodes.index(first) and first.meta["phase"] == "forward"


def test_bf16_steps_of_two_input_shapes_share_the_fp32_master_weights():
    # each shape is a graph of its own; each uploads the parameters the other one reads
    torch.manual_seed(0)
    base = GPT(TINY)
    compiled, eager = copy.deepcopy(base).to(torch.bfloat16), copy.deepcopy(base).to(torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_() for p in eager.parameters()]
    opt_master = torch.optim.AdamW(master, lr=3e-3, weight_decay=0.1, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=3e-3, weight_decay=0.1)
    step = offloaded()
    long, short = token_batches(3, seq=16), token_batches(3, seq=8, seed=1)
    for b in [b for pair in zip(long, short) for b in pair]:
        eager(b["input_ids"], labels=b["labels"]).backward()
        for m, p in zip(master, eager.parameters()):
            m.grad, p.grad = p.grad.float(), None
        opt_master.step()
        with torch.no_grad():
            for m, p in zip(master, eager.parameters()):
                p.copy_(m)
        step(compiled, opt_c, b)
    assert step.trace_count == 2
    for (name, pe), pc, m in zip(eager.named_parameters(), compiled.parameters(), master):
        assert torch.equal(opt_c.state[pc]["master_param"], m.detach()), name
        assert torch.equal(pc, pe), name
    # one host state for both graphs: each records the versions the other's uploads leave
    assert len({id(v.executor.host_state) for v in step._variants.values()}) == 1


def test_checkpoint_of_differently_split_param_groups_is_refused():
    torch.manual_seed(0)
    model = GPT(TINY)
    params = list(model.parameters())

    def split_at(k):
        return torch.optim.AdamW([{"params": params[:k]}, {"params": params[k:], "lr": 1e-4}], lr=3e-3)

    opt = split_at(2)
    step = offloaded()
    step(model, opt, batches(1)[0])
    other = split_at(3)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match="param groups"):
        step.load_state_dict(step.state_dict(), optimizers=[other])
    assert other.state_dict() == before
