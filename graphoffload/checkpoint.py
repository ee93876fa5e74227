"""Loading optimizer state without moving it: what offloaded training needs to resume exactly.

`torch.optim.Optimizer.load_state_dict` casts every state tensor to its parameter's device
(and floating state to its dtype), which would put all offloaded fp32 state on the GPU, in
bf16 for mixed precision. This loader keeps each tensor's device and dtype as saved; the next
compiled step places it where its graph expects it.
"""

from __future__ import annotations

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
