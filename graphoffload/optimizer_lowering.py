"""Lower `optimizer.step()` to graph nodes: one rule per supported optimizer class.

graphoffload emits the update itself, per *subgroup* of parameters, on the fused kernels
`torch.optim` uses with ``fused=True`` (``_fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``),
so a compiled step matches ``fused=True`` bit for bit and later passes can move, place and
offload each subgroup's update on its own. The learning rate of every param group is a graph
input (a float64 scalar tensor), so an lr scheduler changes it without a re-trace; every other
hyper-parameter is a constant of the graph and part of the trace cache key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import Tensor

from graphoffload.bucketing import greedy_buckets
from graphoffload.errors import StateError, UnsupportedError


@dataclass
class TracedUpdate:
    """What a rule sees of one param group while the step is traced."""

    group: dict[str, Any]
    names: list[str]            # parameter names, in group order, only those with a gradient
    params: list[Tensor]        # traced parameters (mutated in place by the update)
    grads: list[Tensor]
    state: Callable[[int, str], Tensor]   # (index in params, state key) -> traced state tensor
    lr: Tensor                  # traced float64 scalar
    grad_scale: Tensor | None = None   # from GradScaler: the kernel unscales the gradients...
    found_inf: Tensor | None = None    # ...and skips the update when they overflowed


def _adam_state_keys(group: dict[str, Any]) -> tuple[str, ...]:
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())


def _sgd_state_keys(group: dict[str, Any]) -> tuple[str, ...]:
    return ("momentum_buffer",) if group["momentum"] != 0 else ()


def _zeros_like(p: Tensor, where: StatePlacement | None) -> Tensor:
    if where is None:
        return torch.zeros_like(p, memory_format=torch.preserve_format)
    return torch.zeros_like(p, device=where.device, pin_memory=where.pin, memory_format=torch.preserve_format)


def _init_adam_state(p: Tensor, group: dict[str, Any], state: dict[str, Any], where: StatePlacement | None) -> None:
    # Same tensors torch.optim creates on its first step; the step counter lives on the
    # parameter's device as torch's fused path keeps it.
    state["step"] = torch.zeros((), dtype=torch.float32, device=where.device if where else p.device)
    state["exp_avg"] = _zeros_like(p, where)
    state["exp_avg_sq"] = _zeros_like(p, where)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = _zeros_like(p, where)


def _init_sgd_state(p: Tensor, group: dict[str, Any], state: dict[str, Any], where: StatePlacement | None) -> None:
    if group["momentum"] != 0:
        # Overwritten with the gradient by the first update (is_first_step=True), as torch does.
        state["momentum_buffer"] = _zeros_like(p, where)


def state_like(p: Tensor, key: str) -> Tensor:
    """An empty tensor placed as torch.optim keeps the state `key` of parameter `p` (call it
    under a fake mode, to trace against state that really lives elsewhere)."""
    if key == "step":
        return torch.empty((), dtype=torch.float32, device=p.device)
    # from p's metadata alone: under a fake mode an op on the real p would be refused
    return torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)


def _lr_for(u: TracedUpdate) -> Tensor:
    """The lr tensor the fused kernel of this device reads: the CPU kernels read a double (and
    the graph's lr input is float64, so results match a Python float lr bit for bit); the CUDA
    kernels read a float on the device, the precision they compute the update in anyway."""
    device = u.params[0].device
    # non_blocking: a blocking copy from host memory synchronizes the stream, which would stop
    # the CPU from queueing this step's work while the GPU finishes the last one's
    return u.lr if device.type == "cpu" else u.lr.to(device=device, dtype=torch.float32, non_blocking=True)


def _steps_on(steps: list[Tensor], device: torch.device) -> list[Tensor]:
    return [s if s.device == device else s.to(device) for s in steps]


def _lower_adam_family(u: TracedUpdate, decoupled: bool) -> None:
    g = u.group
    beta1, beta2 = (float(b) for b in g["betas"])
    steps = [u.state(i, "step") for i in range(len(u.params))]
    torch._foreach_add_(steps, 1)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    lr = _lr_for(u)
    kernel(
        u.params, u.grads,
        [u.state(i, "exp_avg") for i in range(len(u.params))],
        [u.state(i, "exp_avg_sq") for i in range(len(u.params))],
        [u.state(i, "max_exp_avg_sq") for i in range(len(u.params))] if g["amsgrad"] else [],
        _steps_on(steps, u.params[0].device),
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=float(g["weight_decay"]), eps=float(g["eps"]),
        amsgrad=bool(g["amsgrad"]), maximize=bool(g["maximize"]), grad_scale=u.grad_scale, found_inf=u.found_inf)
    if u.found_inf is not None:   # a skipped step does not count, as in torch.optim
        torch._foreach_sub_(steps, [u.found_inf.to(steps[0].device)] * len(steps))


def _lower_adamw(u: TracedUpdate, first_step: bool) -> None:
    _lower_adam_family(u, decoupled=True)


def _lower_adam(u: TracedUpdate, first_step: bool) -> None:
    _lower_adam_family(u, decoupled=bool(u.group.get("decoupled_weight_decay", False)))


def _lower_sgd(u: TracedUpdate, first_step: bool) -> None:
    g = u.group
    momentum = float(g["momentum"])
    buffers = [u.state(i, "momentum_buffer") for i in range(len(u.params))] if momentum else []
    torch._fused_sgd_(
        u.params, u.grads, buffers, weight_decay=float(g["weight_decay"]), momentum=momentum,
        lr=_lr_for(u), dampening=float(g["dampening"]), nesterov=bool(g["nesterov"]),
        maximize=bool(g["maximize"]), is_first_step=first_step, grad_scale=u.grad_scale, found_inf=u.found_inf)


@dataclass(frozen=True)
class StatePlacement:
    """Where new optimizer state is created when not on its parameter's device."""

    device: torch.device
    pin: bool = False


@dataclass(frozen=True)
class OptimizerRule:
    state_keys: Callable[[dict[str, Any]], tuple[str, ...]]
    init_state: Callable[[Tensor, dict[str, Any], dict[str, Any], StatePlacement | None], None]
    lower: Callable[[TracedUpdate, bool], None]   # (update, is it its parameters' first update)
    # whether the first update differs from later ones (SGD copies the gradient into its
    # momentum buffer), so the first step gets a graph of its own
    first_step_differs: bool = False
    # group options that would change the math and that the fused kernels do not implement
    rejected_options: tuple[str, ...] = ("differentiable",)


OPTIMIZER_RULES: dict[type, OptimizerRule] = {
    torch.optim.AdamW: OptimizerRule(_adam_state_keys, _init_adam_state, _lower_adamw),
    torch.optim.Adam: OptimizerRule(_adam_state_keys, _init_adam_state, _lower_adam),
    torch.optim.SGD: OptimizerRule(_sgd_state_keys, _init_sgd_state, _lower_sgd, first_step_differs=True),
}


def rule_for(optimizer: torch.optim.Optimizer) -> OptimizerRule:
    rule = OPTIMIZER_RULES.get(type(optimizer))
    if rule is None:
        supported = ", ".join(f"torch.optim.{t.__name__}" for t in OPTIMIZER_RULES)
        raise UnsupportedError(
            f"optimizer {type(optimizer).__module__}.{type(optimizer).__qualname__} is not supported "
            f"by graphoffload; supported optimizers: {supported}. Use one of them or run this "
            "optimizer eagerly outside the compiled step.")
    for group in optimizer.param_groups:
        for option in rule.rejected_options:
            if group.get(option):
                raise UnsupportedError(f"{type(optimizer).__name__}({option}=True) is not supported")
        if isinstance(group["lr"], Tensor) and group["lr"].numel() != 1:
            raise UnsupportedError("a param group's lr must be a number or a one-element tensor")
    return rule


def first_step_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The parameters whose next update is their first and differs from later ones (SGD copies
    the gradient into a momentum buffer it has not created yet). torch.optim decides this per
    parameter, so a param group added later, or a parameter unfrozen later, starts afresh while
    the others keep their momentum."""
    rule = rule_for(optimizer)
    if not rule.first_step_differs:
        return []
    return [p for g in optimizer.param_groups if rule.state_keys(g) for p in g["params"]
            if p.requires_grad and not optimizer.state.get(p)]


def prepare_state(optimizer: torch.optim.Optimizer, where: StatePlacement | None = None,
                  only: list[Tensor] | None = None, like: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
    """Create any missing optimizer state the way torch.optim would on its first step. Frozen
    parameters (requires_grad=False) get none, as in torch.optim, which creates state only for
    parameters with a gradient. `where`: create it there instead of on each parameter's device
    (offloaded state is made in host memory: it may not fit on the device even once). `only`:
    create it for these parameters alone. `like`: shape each new tensor like `like(p)` instead
    of `p` (ZeRO: this rank's chunk of it).

    Returns `first_step_params(optimizer)` as it was before the state was created."""
    rule = rule_for(optimizer)
    first = first_step_params(optimizer)
    for group in optimizer.param_groups:
        keys = rule.state_keys(group)
        for p in group["params"]:
            if not (keys and p.requires_grad) or (only is not None and not any(p is q for q in only)):
                continue
            state = optimizer.state[p]
            missing = [k for k in keys if k not in state]
            if len(missing) == len(keys):
                rule.init_state(p if like is None else like(p), group, state, where)
            elif missing:
                raise StateError(f"optimizer state of a parameter lacks {missing}; was it loaded "
                                 "from a different optimizer's state_dict?")
    return first


def lower_step(optimizer: torch.optim.Optimizer, updates: list[TracedUpdate], first_step: set[str],
               subgroup_numel: int, subgroup_base: int) -> int:
    """Emit the update of every param group, one annotated chunk of nodes per subgroup.
    `first_step`: names of the parameters whose update is their first (see `first_step_params`);
    a subgroup holds only such parameters or none, as the kernels take one flag for all.

    Returns the number of subgroups emitted."""
    rule = rule_for(optimizer)
    count = 0
    for u in updates:
        keys = [(p.device, p.dtype, n in first_step) for p, n in zip(u.params, u.names)]
        for idx in greedy_buckets(range(len(u.params)), lambda i: u.params[i].numel(), subgroup_numel,
                                  key=keys.__getitem__):
            part = TracedUpdate(u.group, [u.names[i] for i in idx], [u.params[i] for i in idx],
                                [u.grads[i] for i in idx],
                                lambda j, key, idx=idx, u=u: u.state(idx[j], key), u.lr, u.grad_scale, u.found_inf)
            meta = {"phase": "optimizer", "subgroup": subgroup_base + count, "param": tuple(part.names)}
            with fx_traceback.annotate(meta):
                rule.lower(part, part.names[0] in first_step)
            count += 1
    return count
