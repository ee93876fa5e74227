"""A step interrupted part-way through backward, after the last layer's fused update ran.

A custom op sits after the first layer; its backward raises at run time (not while tracing)
when armed, so the second layer's fused AdamW update has already written its parameters and
state. The step must say what it changed, refuse to run again until the model and optimizer are
restored or the partial update is accepted, and an error before any update must change nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_unchanged, snapshot

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload, PartialUpdateError, StateError

ARMED = {"backward": None, "forward": None}   # phase -> the exception type its op raises, at run time


@torch.library.custom_op("go_test_interrupt::fail_if_armed", mutates_args=())
def fail_if_armed(x: torch.Tensor, phase: str) -> torch.Tensor:
    if ARMED[phase] is not None:
        raise ARMED[phase](f"injected failure in {phase}")
    return x.clone()


@fail_if_armed.register_fake
def _(x, phase):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return fail_if_armed(grad, "backward"), None


fail_if_armed.register_autograd(_backward)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.last = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = fail_if_armed(torch.relu(self.first(x)), "forward")
        return self.last(h).pow(2).mean()


def train_step(model, optimizer, x):
    loss = model(x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def make(seed=0):
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


# one fused update per layer, so the last layer's runs before the first layer's backward
SMALL_BUCKETS = CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=9))


def compiled(offload=None):
    return graphoffload.offload_compile(train_step, config=SMALL_BUCKETS, offload=offload)


OFFLOADS = {"fused": None, "offload-cpu": Offload(device_updates="never")}


@pytest.fixture(autouse=True)
def disarm():
    yield
    ARMED.update(backward=None, forward=None)


def batch(i):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("offload", OFFLOADS.values(), ids=OFFLOADS.keys())
def test_failure_in_backward_names_updated_and_refuses(offload):
    model, opt = make()
    step = compiled(offload)
    step(model, opt, batch(0))
    good_model, good_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    ARMED["backward"] = RuntimeError
    with pytest.raises(PartialUpdateError, match=r"interrupted part-way.*last\.weight") as info:
        step(model, opt, batch(1))
    assert "first.weight" not in str(info.value).split("changed")[1].split(";")[0]
    assert isinstance(root_cause(info.value), RuntimeError)
    # the last layer really moved, the first did not: the error told the truth
    assert not torch.equal(model.last.weight, good_model["last.weight"])
    assert torch.equal(model.first.weight, good_model["first.weight"])
    ARMED["backward"] = None
    with pytest.raises(StateError, match="refusing to run"):
        step(model, opt, batch(1))
    # restoring only the model is not enough: the optimizer state moved too
    model.load_state_dict(good_model)
    with pytest.raises(StateError, match="refusing to run"):
        step(model, opt, batch(1))
    opt.load_state_dict(good_opt)
    loss = step(model, opt, batch(1))

    # the retried step equals an uninterrupted one
    ref_model, ref_opt = make()
    ref = compiled(offload)
    ref(ref_model, ref_opt, batch(0))
    ref_loss = ref(ref_model, ref_opt, batch(1))
    assert torch.equal(loss, ref_loss)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_step_load_state_dict_and_accept_partial_update():
    model, opt = make()
    step = compiled()
    step(model, opt, batch(0))
    good_model, good_step = copy.deepcopy(model.state_dict()), copy.deepcopy(step.state_dict())
    ARMED["backward"] = RuntimeError
    with pytest.raises(PartialUpdateError):
        step(model, opt, batch(1))
    ARMED["backward"] = None
    step.load_state_dict(good_step)          # the optimizers, through the step
    with pytest.raises(StateError):
        step(model, opt, batch(1))
    model.load_state_dict(good_model)
    step(model, opt, batch(1))

    ARMED["backward"] = RuntimeError
    with pytest.raises(PartialUpdateError):
        step(model, opt, batch(2))
    ARMED["backward"] = None
    step.accept_partial_update()
    step(model, opt, batch(2))


def test_keyboard_interrupt_stays_keyboard_interrupt_but_refuses_after():
    model, opt = make()
    step = compiled()
    step(model, opt, batch(0))
    ARMED["backward"] = KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt) as info:
        step(model, opt, batch(1))
    assert any("last.weight" in note for note in info.value.__notes__)
    ARMED["backward"] = None
    with pytest.raises(StateError, match="KeyboardInterrupt"):
        step(model, opt, batch(1))


@pytest.mark.parametrize("offload", OFFLOADS.values(), ids=OFFLOADS.keys())
def test_failure_in_forward_changes_nothing(offload):
    model, opt = make()
    step = compiled(offload)
    step(model, opt, batch(0))
    snap = snapshot(model, opt)
    ARMED["forward"] = RuntimeError
    # not a PartialUpdateError: the replay error names the op and the user's line, nothing more
    with pytest.raises(graphoffload.StepRunError, match="injected failure in forward") as info:
        step(model, opt, batch(1))
    assert not isinstance(info.value, PartialUpdateError)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert_unchanged(model, opt, snap)
    ARMED["forward"] = None
    step(model, opt, batch(1))    # nothing changed: retrying needs no restore


@pytest.mark.parametrize("offload", OFFLOADS.values(), ids=OFFLOADS.keys())
def test_out_of_memory_keeps_its_type_so_retry_loops_catch_it(offload):
    # batch-size finders catch torch.OutOfMemoryError by name: before any update it comes
    # through as it is (with a note naming the op), after some updates as the cause
    model, opt = make()
    step = compiled(offload)
    step(model, opt, batch(0))
    snap = snapshot(model, opt)
    ARMED["forward"] = torch.OutOfMemoryError
    with pytest.raises(torch.OutOfMemoryError, match="injected failure in forward") as info:
        step(model, opt, batch(1))
    assert any("graphoffload" in note for note in getattr(info.value, "__notes__", []))
    assert_unchanged(model, opt, snap)
    ARMED["forward"] = None
    ARMED["backward"] = torch.OutOfMemoryError
    with pytest.raises(PartialUpdateError) as partial:
        step(model, opt, batch(1))
    assert isinstance(root_cause(partial.value), torch.OutOfMemoryError)


def root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def test_failure_in_the_cpu_worker_names_updated_and_refuses(monkeypatch):
    """The offload worker thread fails on its second host update, after the last layer's update
    has landed: the error reaches the caller from the worker thread as a PartialUpdateError
    naming what changed, later calls refuse, and a restored model retries exactly."""
    from graphoffload.runtime import host_offload

    model, opt = make()
    step = compiled(Offload(device_updates="never"))
    step(model, opt, batch(0))
    good_model, good_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    calls = {"n": 0}
    scale = host_offload._scale_host_grads

    def failing_second_update(grads, multiplier):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure in the CPU worker")
        scale(grads, multiplier)

    monkeypatch.setattr(host_offload, "_scale_host_grads", failing_second_update)
    with pytest.raises(PartialUpdateError, match=r"interrupted part-way.*last\.weight") as info:
        step(model, opt, batch(1))
    step.synchronize()
    assert "injected failure in the CPU worker" in str(root_cause(info.value))
    assert not torch.equal(model.last.weight, good_model["last.weight"])
    # every parameter whose value moved is named (a bucket written with unchanged values may be
    # named too: the report errs on the side of restoring)
    named = str(info.value).split("changed")[1].split(";")[0]
    for name, value in model.state_dict().items():
        if not torch.equal(value, good_model[name]):
            assert name in named, f"{name} changed but the error does not say so"
    monkeypatch.setattr(host_offload, "_scale_host_grads", scale)
    with pytest.raises(StateError, match="refusing to run"):
        step(model, opt, batch(1))
    model.load_state_dict(good_model)
    opt.load_state_dict(good_opt)
    loss = step(model, opt, batch(1))
    ref_model, ref_opt = make()
    ref = compiled(Offload(device_updates="never"))
    ref(ref_model, ref_opt, batch(0))
    assert torch.equal(loss, ref(ref_model, ref_opt, batch(1)))
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
