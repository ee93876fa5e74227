"""A compiled step that is dropped lets go of everything it attached to the user's objects: the
hooks on the model and the optimizer (a step whose uploads run into the next step synchronizes
before outside reads through them) are removed, and nothing keeps the step alive."""

from __future__ import annotations

import gc
import weakref

import torch
import graphoffload


def _hook_counts(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, ...]:
    return (len(model._forward_pre_hooks), len(model._state_dict_pre_hooks),
            len(model._load_state_dict_pre_hooks), len(opt._optimizer_state_dict_pre_hooks),
            len(opt._optimizer_load_state_dict_pre_hooks))


def test_dropping_the_step_removes_its_hooks_and_frees_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _hook_counts(model, opt)

    def loss_step(model, opt, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    overlapping = graphoffload.Offload(device_updates="never", overlap_next_step=True)
    step = graphoffload.offload_compile(loss_step, offload=overlapping)
    for _ in range(2):
        step(model, opt, torch.randn(4, 8))
    assert _hook_counts(model, opt) != before   # the step hooked the model and the optimizer
    ref = weakref.ref(step)
    del step
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())
    assert _hook_counts(model, opt) == before
    model(torch.randn(2, 8))                    # the model still works, with no dangling hook
    opt.state_dict()


def test_one_step_compiled_twice_for_the_same_objects_hooks_them_once():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = len(model._forward_pre_hooks)

    def loss_step(model, opt, x):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = graphoffload.offload_compile(loss_step, offload=graphoffload.Offload(device_updates="never",
                                                                               overlap_next_step=True))
    step(model, opt, torch.randn(2, 4))
    step(model, opt, torch.randn(3, 4))   # another shape: a second variant, the same objects
    assert len(model._forward_pre_hooks) == before + 1
