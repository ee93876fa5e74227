"""Loading optimizer state without moving it: what offloaded training needs to resume exactly.

`torch.optim.Optimizer.load_state_dict` casts every state tensor to its parameter's device
(and floating state to its dtype), which would put all offloaded fp32 state on the GPU, in
bf16 for mixed precision. This loader keeps each tensor's device and dtype as saved; the next
compiled step places it where its graph expects it. An offloading step also hooks
`load_state_dict` itself (`keep_offloaded_dtypes`), so that DCP's `set_optimizer_state_dict`,
which goes through it, does not round the fp32 master weights and moments of a bf16 model.
"""

from __future__ import annotations

from collections.abc import Callable, Set as AbstractSet
from typing import Any

import torch
from torch import Tensor


def load_optimizer_state_exactly(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = [i for g in state["param_groups"] for i in g["params"]]
    # per group: equal totals split differently would give groups each other's hyper-parameters
    here = [len(g["params"]) for g in opt.param_groups]
    there = [len(g["params"]) for g in state["param_groups"]]
    if here != there:
        raise ValueError(f"{type(opt).__name__} state does not match the optimizer: saved param groups "
                         f"of {there} parameters, here of {here}")
    for group, saved_group in zip(opt.param_groups, state["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    opt.state.clear()
    for saved_id, param in zip(saved, params):
        if saved_id in state["state"]:
            opt.state[param] = {k: v.clone() if isinstance(v, Tensor) else v
                                for k, v in state["state"][saved_id].items()}


def keep_offloaded_dtypes(opt: torch.optim.Optimizer, offloaded: Callable[[], AbstractSet[int]]) -> list[Any]:
    """Hook `opt.load_state_dict` so that the floating state of each parameter whose id is in
    `offloaded()` (asked once per load, so a load is linear in the parameters) keeps the dtype it
    was saved in: it puts back the saved tensor wherever the load cast it
    to the parameter's dtype (an offloading step keeps fp32 master weights and moments for a bf16
    model; cast, their low bits would be gone). The step then places the tensor in its host
    memory, as after `load_optimizer_state_exactly`; a tensor already there (DCP loads in place
    into the state a compiled step placed) is kept as it is. Returns the two hooks' handles."""
    loading: dict[str, Any] = {}

    def remember(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        loading["state_dict"] = state_dict

    def restore(optimizer: torch.optim.Optimizer) -> None:
        state_dict = loading.pop("state_dict", None)
        if state_dict is None:
            return
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        ids = offloaded()
        for saved_id, param in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is None or id(param) not in ids:
                continue
            state = optimizer.state[param]
            for key, value in saved.items():
                if (key != "step" and isinstance(value, Tensor) and value.is_floating_point()
                        and isinstance(state.get(key), Tensor) and state[key].dtype != value.dtype):
                    state[key] = value

    return [opt.register_load_state_dict_pre_hook(remember), opt.register_load_state_dict_post_hook(restore)]
