"""Dropout inside a compiled step draws from torch's generator at run time, like eager."""

from __future__ import annotations

import copy

import torch
from helpers import assert_training_matches, run_steps, tiny_gpt, token_batches
from steps import train_step

import graphoffload


def test_dropout_draws_a_new_mask_every_step():
    model = tiny_gpt(dropout=0.1)
    frozen = torch.optim.SGD(model.parameters(), lr=0.0, fused=True)   # parameters never move
    step = graphoffload.offload_compile(train_step)
    batch = token_batches(1)[0]
    losses = run_steps(step, model, frozen, [batch] * 3)
    assert len({loss.item() for loss in losses}) == 3
    model.eval()   # no dropout: the compiled loss is eager's, bit for bit, every time
    reference = copy.deepcopy(model)
    eager_loss = run_steps(train_step, reference, torch.optim.SGD(reference.parameters(), lr=0.0, fused=True),
                           [batch])[0].item()
    assert [loss.item() for loss in run_steps(step, model, frozen, [batch] * 2)] == [eager_loss] * 2


def test_dropout_from_the_same_seed_matches_eager_exactly():
    eager = tiny_gpt(dropout=0.1)
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=3e-3, fused=True)
    step = graphoffload.offload_compile(train_step)
    batches = token_batches(6)
    torch.manual_seed(123)
    losses_e = run_steps(train_step, eager, opt_e, batches)
    torch.manual_seed(123)
    losses_c = run_steps(step, compiled, opt_c, batches)   # the first call also traces
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    # and the generator ends where eager leaves it: tracing drew nothing from it
    torch.manual_seed(7)
    run_steps(train_step, eager, opt_e, batches[:1])
    after_eager = torch.rand(4)
    torch.manual_seed(7)
    run_steps(step, compiled, opt_c, batches[:1])
    assert torch.equal(torch.rand(4), after_eager)
