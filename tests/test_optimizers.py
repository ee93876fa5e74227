"""The lowered optimizer update equals torch.optim's: bit for bit against fused=True, within
1e-5 against the single-tensor and foreach implementations, with lr schedulers and several param groups."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_training_matches, eager_and_compiled, run_steps, tiny_gpt, token_batches, train_step

import graphoffload

FUSED = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, fused=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=3e-3, weight_decay=0.01, fused=True),
    "adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=3e-3, amsgrad=True, fused=True),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, fused=True),
    "sgd-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                              weight_decay=0.01, fused=True),
    "sgd-dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.8, dampening=0.3,
                                               weight_decay=0.02, fused=True),
}
# SGD with momentum copies the gradient into its buffer on the first step only: that step has
# a graph of its own
TRACES = {"sgd-nesterov": 2, "sgd-dampening": 2}


def cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_compiled_step_is_bit_identical_to_fused_torch_optimizer_under_a_scheduler(name):
    eager, opt_e, losses_e, compiled, opt_c, losses_c, step = eager_and_compiled(
        tiny_gpt(), FUSED[name], token_batches(10), make_scheduler=cosine)
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    # the scheduler moved lr every step; lr is a graph input, so no step was re-traced for it
    assert opt_c.param_groups[0]["lr"] == opt_e.param_groups[0]["lr"] != FUSED[name](tiny_gpt()).defaults["lr"]
    assert step.trace_count == TRACES.get(name, 1)


# foreach=None is the default, which on the CPU is the single-tensor path: both are named explicitly
FOREACH = {
    "adamw": lambda m, fused=None, foreach=None: torch.optim.AdamW(
        m.parameters(), lr=3e-3, weight_decay=0.1, fused=fused, foreach=foreach),
    "adam": lambda m, fused=None, foreach=None: torch.optim.Adam(
        m.parameters(), lr=3e-3, weight_decay=0.01, fused=fused, foreach=foreach),
    "sgd-nesterov": lambda m, fused=None, foreach=None: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, fused=fused, foreach=foreach),
}


def _max_param_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("foreach", [False, True], ids=["single-tensor", "foreach"])
@pytest.mark.parametrize("name", sorted(FOREACH))
def test_compiled_step_matches_unfused_torch_optimizer(name, foreach):
    make = lambda m: FOREACH[name](m, foreach=foreach)  # noqa: E731
    eager, opt_e, losses_e, compiled, opt_c, losses_c, _ = eager_and_compiled(
        tiny_gpt(), make, token_batches(10), make_scheduler=cosine)
    assert opt_e.defaults["foreach"] is foreach
    for le, lc in zip(losses_e, losses_c):
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=0)
    # Adam divides by sqrt(v) + eps, which turns last-bit differences of near-zero gradients
    # into visible ones: torch's own fused and foreach AdamW drift apart by ~2.4e-5 on this
    # model in 10 steps. The compiled step must be no further from foreach than that, and
    # within 1e-5 wherever torch's two implementations agree that closely (SGD).
    reference = tiny_gpt()
    opt_r = FOREACH[name](reference, fused=True)
    run_steps(train_step, reference, opt_r, token_batches(10), cosine(opt_r))
    torch_drift = _max_param_diff(reference, eager)
    assert _max_param_diff(compiled, eager) <= max(torch_drift, 1e-6)
    atol = max(torch_drift, 1e-6)
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=False, rtol=1e-5, atol=atol)


def two_groups(opt_cls, **fused):
    """Matrices decay, vectors do not; different lr, betas/momentum per group."""
    def make(model):
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        if opt_cls is torch.optim.SGD:
            groups = [{"params": matrices, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
                      {"params": vectors, "lr": 0.02, "momentum": 0.5, "nesterov": True}]
        else:
            groups = [{"params": matrices, "lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)},
                      {"params": vectors, "lr": 1e-3, "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6}]
        return opt_cls(groups, **fused)
    return make


def per_group_schedule(opt):
    # each group decays at its own rate: both lr inputs of the graph must follow
    return torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.9 ** s, lambda s: 1.0 / (1 + s)])


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD],
                         ids=["adamw", "adam", "sgd"])
def test_param_groups_with_different_hyperparameters_match_fused_torch(opt_cls):
    eager, opt_e, losses_e, compiled, opt_c, losses_c, step = eager_and_compiled(
        tiny_gpt(), two_groups(opt_cls, fused=True), token_batches(10), make_scheduler=per_group_schedule)
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    lrs = [g["lr"] for g in opt_c.param_groups]
    assert lrs[0] != lrs[1]
    assert step.trace_count == (2 if opt_cls is torch.optim.SGD else 1)


def _vectors(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.dim() < 2]


def test_sgd_param_group_added_later_starts_its_momentum_while_the_others_keep_theirs():
    # torch.optim decides the first momentum step per parameter: the new group's buffers start
    # from its gradients, the old group's keep accumulating
    def make(model):
        model.requires_grad_(False)
        matrices = [p.requires_grad_() for p in model.parameters() if p.dim() >= 2]
        return torch.optim.SGD(matrices, lr=0.05, momentum=0.9, fused=True)

    def add_vectors(model, opt):
        opt.add_param_group({"params": [p.requires_grad_() for p in _vectors(model)], "lr": 0.02})

    eager, compiled = tiny_gpt(), tiny_gpt()
    opt_e, opt_c = make(eager), make(compiled)
    step = graphoffload.offload_compile(train_step)
    losses_e, losses_c = [], []
    for i, b in enumerate(token_batches(6)):
        if i == 3:
            add_vectors(eager, opt_e)
            add_vectors(compiled, opt_c)
        losses_e.append(train_step(eager, opt_e, b).detach())
        losses_c.append(step(compiled, opt_c, b).detach())
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)


# fused SGD cannot run a group in which only some parameters have a momentum buffer: that case
# is checked against the default (foreach) implementation
@pytest.mark.parametrize("make_opt,exact", [
    (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3), False),
    (lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, fused=True), True),
], ids=["sgd-dampening", "adamw"])
def test_frozen_params_get_no_state_and_start_afresh_when_unfrozen(make_opt, exact):
    eager, compiled = tiny_gpt(), tiny_gpt()
    opt_e, opt_c = make_opt(eager.parameters()), make_opt(compiled.parameters())
    for model in (eager, compiled):
        for p in _vectors(model):
            p.requires_grad_(False)
    step = graphoffload.offload_compile(train_step)
    losses_e, losses_c = [], []
    for i, b in enumerate(token_batches(6)):
        if i == 3:
            for p in _vectors(eager) + _vectors(compiled):
                p.requires_grad_(True)
        losses_e.append(train_step(eager, opt_e, b).detach())
        losses_c.append(step(compiled, opt_c, b).detach())
        if i == 0:   # torch.optim creates no state for a parameter without a gradient
            assert not any(opt_c.state.get(p) for p in _vectors(compiled))
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=exact)


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_a_parameter_without_gradient_gets_no_state_as_in_torch_optim(name):
    """A layer the forward never uses keeps requires_grad=True but never gets a gradient:
    torch.optim skips it and creates no state for it, so the compiled step must too."""
    model = tiny_gpt()
    model.spare = torch.nn.Linear(4, 4)
    eager, opt_e, losses_e, compiled, opt_c, losses_c, step = eager_and_compiled(
        model, FUSED[name], token_batches(4))
    assert not opt_c.state.get(compiled.spare.weight) and not opt_c.state.get(compiled.spare.bias)
    assert len(opt_c.state_dict()["state"]) == len(opt_e.state_dict()["state"])
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
