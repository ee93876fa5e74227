"""The comparison helpers reject the wrong training they exist to catch (issue 20 item 4): the
bf16-autocast GPU test (test_cuda.py) used rtol 2e-2, atol 2e-3 on the parameters, which passed a
LayerNorm weight never updated and a halved `exp_avg_sq`. helpers.assert_movement_and_state_close
is run here, on the CPU, against exactly those mutations of an eager run."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_movement_and_state_close, run_steps, tiny_gpt, token_batches
from steps import train_step

RTOL = 0.1   # test_cuda.py's bf16-autocast bound
STEPS = 4    # as few as the old tolerance needs to miss a frozen LayerNorm (lr 3e-3: 0.012 < 0.02)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _frozen_layernorm_step(model, optimizer, batch):
    ln = next(m for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    before = ln.weight.detach().clone()
    loss = train_step(model, optimizer, batch)
    with torch.no_grad():
        ln.weight.copy_(before)
    return loss


def _run(step_fn, halve_exp_avg_sq=False):
    model = tiny_gpt()
    opt = _adamw(model)
    losses = run_steps(step_fn, model, opt, token_batches(STEPS))
    if halve_exp_avg_sq:
        for state in opt.state.values():
            state["exp_avg_sq"].mul_(0.5)
    return model, opt, losses


@pytest.mark.parametrize("mutant", ["layernorm-never-updated", "exp_avg_sq-halved"])
def test_movement_and_state_comparison_rejects_what_the_old_tolerance_passed(mutant):
    start = [p.detach().double().clone() for p in tiny_gpt().parameters()]
    eager, opt_e, losses_e = _run(train_step)
    wrong, opt_w, losses_w = _run(_frozen_layernorm_step if mutant == "layernorm-never-updated" else train_step,
                                  halve_exp_avg_sq=mutant == "exp_avg_sq-halved")
    with pytest.raises(AssertionError, match="away from"):
        assert_movement_and_state_close(eager, opt_e, wrong, opt_w, start, RTOL)
    # the parameters alone, at test_cuda.py's old tolerance, let it through
    for pe, pw in zip(eager.parameters(), wrong.parameters()):
        torch.testing.assert_close(pw, pe, rtol=2e-2, atol=2e-3)


def test_movement_and_state_comparison_accepts_a_small_difference():
    # under autocast the parameters and state stay fp32; bf16 enters through the gradients: here
    # every movement 2% longer and every state tensor rounded once to bf16 (2^-9 relative)
    start = [p.detach().double().clone() for p in tiny_gpt().parameters()]
    eager, opt_e, _ = _run(train_step)
    other = copy.deepcopy(eager)
    opt_o = _adamw(other)
    opt_o.load_state_dict(opt_e.state_dict())
    with torch.no_grad():
        for p, p0 in zip(other.parameters(), start):
            p.copy_(p0 + 1.02 * (p.double() - p0))
        for state in opt_o.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].to(torch.bfloat16))
    assert_movement_and_state_close(eager, opt_e, other, opt_o, start, RTOL)
