"""Steps graphoffload cannot compile fail with a graphoffload error that says why and where,
and leave the model and optimizer exactly as they were."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import assert_unchanged, snapshot, tiny_gpt, token_batches
from steps import train_step, zero_first_step
from torch import nn

import graphoffload
from graphoffload import CaptureError, StateError, UnsupportedError


def line_of(marker: str) -> int:
    """Line number in this file of the line ending with `# <marker>`."""
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# {marker}"):
                return i
    raise AssertionError(marker)


def compile_and_fail(step_fn, error: type, model=None, opt=None, batch=None):
    """Call the compiled step, expect `error`, check nothing was modified; return the message."""
    model = model or tiny_gpt()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    before = snapshot(model, opt)
    with pytest.raises(error) as info:
        graphoffload.offload_compile(step_fn)(model, opt, token_batches(1)[0] if batch is None else batch)
    assert_unchanged(model, opt, before)
    return str(info.value)


def item_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    print("loss", loss.item())  # item-line
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def branch_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    if loss > 0:  # branch-line
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("step_fn,marker", [(item_step, "item-line"), (branch_step, "branch-line")],
                         ids=["item", "if-tensor"])
def test_data_dependent_python_is_a_capture_error_naming_the_user_line(step_fn, marker):
    message = compile_and_fail(step_fn, CaptureError)
    assert f"{os.path.basename(__file__)}:{line_of(marker)}" in message
    assert ".item()" in message


@torch.library.custom_op("graphoffload_tests::no_fake_kernel", mutates_args=())
def no_fake_kernel(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class ModelWithOpaqueOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return no_fake_kernel(self.lin(x)).pow(2).mean()


def opaque_step(model, optimizer, batch):
    loss = model(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_op_without_fake_kernel_is_unsupported_naming_the_op():
    model = ModelWithOpaqueOp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    message = compile_and_fail(opaque_step, UnsupportedError, model, opt, torch.randn(3, 4))
    assert "graphoffload_tests::no_fake_kernel" in message
    assert "register_fake" in message


def test_unsupported_optimizer_names_the_supported_ones():
    model = tiny_gpt()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    message = compile_and_fail(train_step, UnsupportedError, model, opt)
    assert "RMSprop" in message
    for name in ("torch.optim.AdamW", "torch.optim.Adam", "torch.optim.SGD"):
        assert name in message


def test_parameter_held_by_two_optimizers_is_unsupported_naming_it():
    model = tiny_gpt()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sgd = torch.optim.SGD([model.pos.weight], lr=0.1, momentum=0.9)

    def two_optimizer_step(model, optimizer, batch):
        loss = train_step(model, optimizer, batch)
        sgd.step()
        sgd.zero_grad()
        return loss

    message = compile_and_fail(two_optimizer_step, UnsupportedError, model, adamw)
    assert "pos.weight" in message
    assert not sgd.state


def forward_only_step(model, optimizer, batch):
    return model(batch["input_ids"], labels=batch["labels"])


def test_step_without_backward_is_a_capture_error():
    message = compile_and_fail(forward_only_step, CaptureError)
    assert "backward" in message


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_scheduler_step_inside_the_step_is_a_capture_error():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step_with_scheduler(model, optimizer, batch):
        loss = train_step(model, optimizer, batch)
        scheduler.step()
        return loss

    lr_before = opt.param_groups[0]["lr"]
    message = compile_and_fail(step_with_scheduler, CaptureError, model, opt)
    assert "scheduler.step()" in message
    assert opt.param_groups[0]["lr"] == lr_before


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_scheduler_step_inside_the_step_leaves_every_param_group_lr_as_it_was():
    model = tiny_gpt()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": matrices}, {"params": vectors, "lr": 1e-3}], lr=1e-2, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step_with_scheduler(model, optimizer, batch):
        loss = train_step(model, optimizer, batch)
        scheduler.step()
        return loss

    compile_and_fail(step_with_scheduler, CaptureError, model, opt)
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3]


def step_zeroing_after(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    optimizer.step()
    return loss


def test_leftover_grad_without_zero_grad_before_backward_is_a_state_error():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = graphoffload.offload_compile(step_zeroing_after)
    batch = token_batches(1)[0]
    step(model, opt, batch)   # leaves its gradients on .grad
    assert all(p.grad is not None for p in model.parameters())
    grads = [p.grad.clone() for p in model.parameters()]
    before = snapshot(model, opt)
    with pytest.raises(StateError, match="zero_grad"):
        step(model, opt, batch)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before["model"][name]), name
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    opt.zero_grad()
    step(model, opt, batch)   # fine once the gradients are cleared


def test_a_gradient_no_zero_grad_clears_is_refused_not_overwritten():
    # ln_f.bias is in no optimizer: optimizer.zero_grad() leaves its .grad, which eager then
    # accumulates into; the compiled step says so instead of silently starting it afresh
    eager = tiny_gpt()
    compiled = copy.deepcopy(eager)
    make_opt = lambda m: torch.optim.AdamW([p for n, p in m.named_parameters() if n != "ln_f.bias"], lr=1e-2)
    opt_e, opt_c = make_opt(eager), make_opt(compiled)
    step = graphoffload.offload_compile(zero_first_step)
    batch = token_batches(1)[0]
    assert step(compiled, opt_c, batch).item() == zero_first_step(eager, opt_e, batch).item()
    assert torch.equal(compiled.ln_f.bias.grad, eager.ln_f.bias.grad)   # kept, as eager keeps it
    with pytest.raises(StateError, match="ln_f.bias has a .grad left"):
        step(compiled, opt_c, batch)
    compiled.ln_f.bias.grad = None
    step(compiled, opt_c, batch)


def test_optimizer_state_of_another_precision_is_a_state_error_before_any_update():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = graphoffload.offload_compile(train_step)
    batch = token_batches(1)[0]
    step(model, opt, batch)
    # as if a state_dict saved in float64 had been put into the optimizer's state by hand
    weight = next(model.parameters())
    opt.state[weight]["exp_avg"] = opt.state[weight]["exp_avg"].double()
    before = snapshot(model, opt)
    with pytest.raises(StateError, match="exp_avg.*torch.float64.*compiled with torch.float32"):
        step(model, opt, batch)
    assert_unchanged(model, opt, before)
