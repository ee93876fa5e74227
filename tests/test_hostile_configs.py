"""Hostile inputs beyond the tiny MLP (issue 17 item 3): the tiny GPT under random schedules
(plain, fused with random bucket sizes, parked gradients, offloaded on the CPU path, hybrid,
handed over to the next step), optimizers and their options (SGD with and without momentum and
Nesterov, Adam with AMSGrad, AdamW with and without weight decay, maximize, and optimizers
graphoffload does not lower), step shapes (clipping, zero_grad first), batch shapes, and
ignored labels. Every call either trains exactly as eager does, or raises a GraphOffloadError
subclass with a message and leaves the model and optimizer as they were. Eager uses the fused
optimizer kernels graphoffload lowers to, so the two agree to the last bit where the order of
operations is the same (the tolerance covers clipping's norm, reduced in another order)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from gpt import GPT
from hypothesis import example, given, settings
from hypothesis import strategies as st
from steps import TINY, clipped_step, train_step, zero_first_step
from test_offload_planner import BALANCED

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, GraphOffloadError, Offload, UnsupportedError

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3, fused=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
    "adamw-maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-3, maximize=True, fused=True),
    # not lowered by graphoffload: a clear UnsupportedError before anything changes
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}
UNSUPPORTED = {"rmsprop", "adagrad"}

SCHEDULES = {
    "plain": lambda bucket: dict(config=CompileConfig(disable_passes=("fuse_optimizer",))),
    "fused": lambda bucket: dict(config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=bucket))),
    "parked": lambda bucket: dict(config=CompileConfig(
        fuse_optimizer=FuseOptimizer(bucket_numel=bucket, park_gradients=True))),
    "offload-cpu": lambda bucket: dict(offload=Offload(device_updates="never"), config=CompileConfig(
        fuse_optimizer=FuseOptimizer(bucket_numel=bucket))),
    "offload-hybrid": lambda bucket: dict(offload=Offload(device_updates=1, calibration=BALANCED),
                                          config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=bucket))),
    "hand-over": lambda bucket: dict(offload=Offload(device_updates="never", overlap_next_step=True)),
}

STEPS = {"train": train_step, "clipped": clipped_step, "zero-first": zero_first_step}


def batches(n: int, rows: int, seq: int, ignored: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, TINY.vocab_size, (rows, seq), generator=g)
        labels = torch.roll(x, -1, dims=1)
        labels[:, :ignored] = -100   # ignored positions, as padding leaves them
        out.append({"input_ids": x, "labels": labels})
    return out


def state_of(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_unchanged(model, opt, before) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[0][name]), f"{name} changed by a refused call"
    after = opt.state_dict()
    assert repr(after["param_groups"]) == repr(before[1]["param_groups"])
    assert after["state"].keys() == before[1]["state"].keys(), "optimizer state created by a refused call"
    for key, entry in after["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(before[1]["state"][key][name])), \
                f"optimizer state {key}.{name} changed by a refused call"


@settings(max_examples=8, deadline=None)
@given(optimizer=st.sampled_from(sorted(OPTIMIZERS)), schedule=st.sampled_from(sorted(SCHEDULES)),
       step_name=st.sampled_from(sorted(STEPS)), bucket=st.sampled_from([512, 4096, 1 << 20]),
       rows=st.integers(1, 2), seq=st.sampled_from([4, 16]), ignored=st.integers(0, 3),
       seed=st.integers(0, 3))
@example(optimizer="adagrad", schedule="offload-cpu", step_name="clipped", bucket=512, rows=1, seq=4, ignored=0, seed=0)
@example(optimizer="adam-amsgrad", schedule="hand-over", step_name="zero-first", bucket=512, rows=2, seq=16,
         ignored=3, seed=1)
def test_random_configurations_train_as_eager_or_refuse_cleanly(optimizer, schedule, step_name, bucket, rows,
                                                                seq, ignored, seed):
    step_fn = STEPS[step_name]
    torch.manual_seed(seed)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = OPTIMIZERS[optimizer](eager.parameters()), OPTIMIZERS[optimizer](compiled.parameters())
    step = graphoffload.offload_compile(step_fn, **SCHEDULES[schedule](bucket))
    for i, batch in enumerate(batches(2, rows, seq, ignored, seed)):
        loss_e = step_fn(eager, opt_e, batch)
        before = state_of(compiled, opt_c)
        try:
            loss_c = step(compiled, opt_c, batch)
        except GraphOffloadError as exc:
            assert str(exc), "a graphoffload error without a message"
            assert_unchanged(compiled, opt_c, before)
            assert optimizer in UNSUPPORTED, f"{optimizer}/{schedule}/{step_name} refused: {exc}"
            assert isinstance(exc, UnsupportedError) and type(opt_c).__name__ in str(exc), str(exc)
            return
        assert optimizer not in UNSUPPORTED, f"{optimizer} is not lowered, yet the step accepted it"
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6, msg=lambda m: f"call {i}: {m}")
    step.synchronize()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(pc, pe, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for pe, pc in zip(eager.parameters(), compiled.parameters()):
        for key, value in opt_e.state.get(pe, {}).items():
            torch.testing.assert_close(torch.as_tensor(opt_c.state[pc][key]).float(),
                                       torch.as_tensor(value).float(), rtol=1e-5, atol=1e-6)


def scaled_loss_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"]) * batch["scale"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("schedule", ["fused", "parked", "offload-cpu", "hand-over"])
def test_nonfinite_calls_under_skip_nonfinite_update_nothing(schedule):
    """A batch whose loss scale is inf (an fp16 overflow upstream leaves the same): with
    skip_nonfinite those calls update nothing on every schedule; the finite calls match eager."""
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-3, fused=True)
    options = SCHEDULES[schedule](4096)
    config = options.pop("config", CompileConfig())
    step = graphoffload.offload_compile(scaled_loss_step, config=dataclasses.replace(config, skip_nonfinite=True),
                                        **options)
    skipped = 0
    for i, batch in enumerate(batches(5, 2, 16, 0, 0)):
        poisoned = i in (1, 3)
        batch["scale"] = torch.tensor(float("inf") if poisoned else 1.0)
        if poisoned:
            before = state_of(compiled, opt_c)
            loss_c = step(compiled, opt_c, batch)
            step.synchronize()
            assert not torch.isfinite(loss_c)
            skipped += 1
            assert step.skipped_steps == skipped
            assert_unchanged(compiled, opt_c, before)
            continue
        loss_e = scaled_loss_step(eager, opt_e, batch)
        loss_c = step(compiled, opt_c, batch)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    step.synchronize()
    assert step.skipped_steps == 2
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(pc, pe, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
