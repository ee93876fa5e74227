"""CompileConfig(skip_nonfinite=True): a call whose loss or global gradient norm is not finite
updates nothing and is counted in `skipped_steps`; every other call trains exactly as eager
(issue 17 item 4)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_training_matches, nonfinite_eagerly, tiny_gpt, token_batches

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload


def poisoned_step(model, optimizer, batch):
    """`scale` (inf or NaN) poisons the loss; `z` = 0 keeps the loss finite but makes a
    gradient NaN (d sqrt(|z w|)/dw at z = 0 is 0 * inf)."""
    loss = model(batch["input_ids"], labels=batch["labels"]) * batch["scale"]
    loss = loss + (batch["z"] * model.head.weight[:2]).abs().sqrt().sum() * 1e-3
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def eager_skipping_step(model, optimizer, batch):
    """What skip_nonfinite does, eagerly: the same flag, and no step() when it is set."""
    loss = model(batch["input_ids"], labels=batch["labels"]) * batch["scale"]
    loss = loss + (batch["z"] * model.head.weight[:2]).abs().sqrt().sum() * 1e-3
    loss.backward()
    skipped = nonfinite_eagerly(loss, model)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad()
    return loss, skipped


def batches() -> list[dict]:
    # clean, inf loss, clean, NaN gradient with a finite loss, NaN loss, clean, clean
    kinds = [(1.0, 1.0), (float("inf"), 1.0), (1.0, 1.0), (1.0, 0.0), (float("nan"), 1.0), (1.0, 1.0), (1.0, 1.0)]
    out = []
    for b, (scale, z) in zip(token_batches(len(kinds)), kinds):
        out.append({**b, "scale": torch.tensor(scale), "z": torch.tensor(z)})
    return out


CASES = {
    "adamw-fused-into-backward": (lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1), {}),
    "adamw-unfused": (lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
                      {"disable_passes": ("fuse_optimizer",)}),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), {}),
    "adamw-offloaded": (lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
                        {"offload": Offload(device_updates="never")}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nonfinite_calls_update_nothing_and_the_others_match_eager_exactly(case):
    make_opt, config = CASES[case]
    eager = tiny_gpt()
    compiled = copy.deepcopy(eager)
    fused = {"fused": True} if "sgd" not in case else {}
    opt_e = type(make_opt([torch.zeros(1, requires_grad=True)]))(eager.parameters(), **{
        k: v for k, v in make_opt([torch.zeros(1, requires_grad=True)]).defaults.items()
        if k in ("lr", "weight_decay", "momentum")}, **fused)
    opt_c = make_opt(compiled.parameters())
    step = graphoffload.offload_compile(poisoned_step, config=CompileConfig(
        skip_nonfinite=True, fuse_optimizer=FuseOptimizer(bucket_numel=4096), **config))
    losses_e, losses_c, skips = [], [], []
    for b in batches():
        before = copy.deepcopy(compiled.state_dict())
        loss_e, skipped = eager_skipping_step(eager, opt_e, b)
        loss_c = step(compiled, opt_c, b)
        # NaN != NaN: compare a NaN loss as a marker value (torch.equal is exact otherwise)
        losses_e.append(torch.nan_to_num(loss_e.detach(), nan=-7.0))
        losses_c.append(torch.nan_to_num(loss_c.detach(), nan=-7.0))
        skips.append(skipped)
        if skipped:   # nothing changed
            for name, value in compiled.state_dict().items():
                assert torch.equal(value, before[name]), f"{name} changed in a skipped call"
        assert all(p.grad is None for p in compiled.parameters())
    assert skips == [False, True, False, True, True, False, False]
    assert step.skipped_steps == 3
    assert step.trace_count == (2 if "sgd" in case else 1)   # SGD's first step (momentum init) is its own variant
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True,
                            offloaded="offloaded" in case)
    if "sgd" not in case:
        assert all(opt_c.state[p]["step"].item() == 4 for p in compiled.parameters())


def test_off_by_default_a_nan_loss_updates_as_eager_does():
    step = graphoffload.offload_compile(poisoned_step)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = batches()[4]
    step(model, opt, b)
    assert step.skipped_steps == 0
    assert not all(torch.isfinite(p).all() for p in model.parameters())
