"""Running gradient sums in host memory: `offload_compile(..., accumulation_steps=k,
offload=Offload(accumulate_on="host"))` adds each micro-batch's gradients into fp32 host sums
on the CPU worker instead of keeping a gradient set on the device; it trains like eager
accumulation, its predicted device peak is lower by about the gradients' bytes, and explain()
says where the sums live."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import graphoffload
from graphoffload.errors import UnsupportedError
from graphoffload.timeline import TRACKS

K = 3
OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8))


def step_fn(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def clipped_step_fn(model, optimizer, x, y):
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    optimizer.step()
    optimizer.zero_grad()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)) for _ in range(n)]


def compiled(where: str, fn=step_fn, **offload) -> graphoffload.CompiledStep:
    return graphoffload.offload_compile(fn, accumulation_steps=K,
                                        offload=graphoffload.Offload(accumulate_on=where, **offload))


def grad_sum_specs(step) -> list:
    return [s for s in step.train_graph.signature.inputs if s.kind == "grad_sum"]


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_host_sums_train_like_eager_accumulation(opt):
    eager = mlp()
    model = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS[opt](eager), OPTIMIZERS[opt](model)
    step = compiled("host")
    for i, (x, y) in enumerate(batches(3 * K)):
        before = [p.detach().clone() for p in model.parameters()]
        (torch.nn.functional.mse_loss(eager(x), y) / K).backward()
        if i % K == K - 1:
            opt_e.step()
            opt_e.zero_grad()
        step(model, opt_c, x, y)
        # the running sums are host placeholders in both variants
        assert grad_sum_specs(step) and all(s.host for s in grad_sum_specs(step))
        if i % K != K - 1:
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            assert all(p.grad is None for p in model.parameters())
        else:
            for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
                torch.testing.assert_close(pc.detach(), pe.detach(), rtol=1e-5, atol=1e-7, msg=name)
    assert step.micro_step == 0
    # the accumulating call copies each gradient out and adds it on the host: no device add into a sum
    accumulate = [v for key, v in step._variants.items() if key[0] is False][0].graph.graph
    targets = [n.target for n in accumulate.nodes]
    assert targets.count(torch.ops.graphoffload.host_accumulate_.default) == len(list(model.parameters()))
    assert torch.ops.aten.add_.Tensor not in targets


def test_host_sums_with_uploads_handed_over_to_the_next_call_train_like_eager():
    eager = mlp()
    model = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS["adamw"](eager), OPTIMIZERS["adamw"](model)
    step = graphoffload.offload_compile(step_fn, accumulation_steps=K, offload=graphoffload.Offload(
        accumulate_on="host", overlap_next_step=True), config=graphoffload.CompileConfig(
            fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=3000)))
    for i, (x, y) in enumerate(batches(3 * K)):
        (torch.nn.functional.mse_loss(eager(x), y) / K).backward()
        if i % K == K - 1:
            opt_e.step()
            opt_e.zero_grad()
        step(model, opt_c, x, y)
    step.synchronize()
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(pc.detach(), pe.detach(), rtol=1e-5, atol=1e-7, msg=name)


def test_host_sums_lower_the_predicted_peak_by_about_the_gradients():
    peaks = {}
    for where in ("device", "host"):
        model = mlp()
        step = compiled(where)
        opt = OPTIMIZERS["adamw"](model)
        data = batches(K)
        step(model, opt, *data[0])                      # the accumulating variant
        peaks[where, "accumulate"] = step.memory().peak
        for x, y in data[1:]:
            step(model, opt, x, y)                      # the updating variant
        peaks[where, "update"] = step.memory().peak
    grad_bytes = sum(p.numel() * p.element_size() for p in mlp().parameters())
    n = len(list(mlp().parameters()))
    saved = peaks["device", "accumulate"] - peaks["host", "accumulate"]
    # a gradient set, give or take the allocator's rounding of each tensor (512-byte blocks)
    assert grad_bytes <= saved <= grad_bytes + 512 * n, (saved, grad_bytes)
    assert peaks["host", "update"] < peaks["device", "update"]


def test_explain_names_where_each_buckets_sums_live(tmp_path):
    for where in ("device", "host"):
        model = mlp()
        opt = OPTIMIZERS["sgd"](model)
        step = graphoffload.offload_compile(step_fn, accumulation_steps=K, offload=graphoffload.Offload(
            accumulate_on=where), config=graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(
                bucket_numel=3000)))
        names = {n for n, _ in model.named_parameters()}
        for i, (x, y) in enumerate(batches(K)):
            step(model, opt, x, y)
            graph = step.train_graph
            [summary] = graph.notes_of("offload_optimizer", "grad_sums")
            assert summary.fields["where"] == where and summary.fields["sums"] == len(names)
            per_bucket = graph.notes_of("offload_optimizer", "grad_sum")
            if i < K - 1:
                assert not per_bucket    # no buckets on an accumulating call
                if where == "host":      # the measured timeline shows the copies and the host adds
                    with open(step.timeline(str(tmp_path / "trace.json"))) as f:
                        spans = {(TRACKS[e["tid"]], e["name"]) for e in json.load(f)["traceEvents"]
                                 if e.get("ph") == "X" and e["pid"] == 2}
                    assert {("cpu", "accumulate"), ("d2h", "copy")} <= spans, spans
            else:
                assert len(per_bucket) > 1 and {n.fields["where"] for n in per_bucket} == {where}
                assert {p for n in per_bucket for p in n.fields["params"]} == names
        if where == "host":
            assert graph.notes_of("offload_optimizer", "no_plan")[0].fields["reason"] == "accumulate_on host"
            assert "running gradient sums on the host" in step.explain()


def test_host_sums_refuse_a_step_that_reads_the_accumulated_gradient_on_the_device():
    model = mlp()
    opt = OPTIMIZERS["adamw"](model)
    step = compiled("host", clipped_step_fn)
    data = batches(K)
    for x, y in data[:-1]:
        step(model, opt, x, y)
    with pytest.raises(UnsupportedError, match="accumulate_on='device'"):
        step(model, opt, *data[-1])


def test_host_sums_resume_a_window_from_a_checkpoint():
    data = batches(2 * K)
    reference, resumed = mlp(), mlp()
    opt_r, opt_s = OPTIMIZERS["adamw"](reference), OPTIMIZERS["adamw"](resumed)
    step_r = compiled("host")
    for x, y in data:
        step_r(reference, opt_r, x, y)
    first = compiled("host")
    for x, y in data[:K + 1]:
        first(resumed, opt_s, x, y)
    saved = first.state_dict()
    again = compiled("host")
    again.load_state_dict(saved, optimizers=[opt_s])
    assert again.micro_step == 1
    for x, y in data[K + 1:]:
        again(resumed, opt_s, x, y)
    for a, b in zip(reference.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_accumulate_on_is_validated():
    with pytest.raises(ValueError, match="accumulate_on"):
        graphoffload.Offload(accumulate_on="cpu")
    with pytest.raises(ValueError, match="not implemented yet"):
        graphoffload.Offload(accumulate_on="auto")
    with pytest.raises(ValueError, match="device_updates"):
        graphoffload.Offload(accumulate_on="host", device_updates=2)
