"""The random-number generator's state as graph values, so a recompute can replay its draws.

`graphoffload.rng_state(device)` reads the state of the generator that random ops on `device`
draw from; `graphoffload.swap_rng_state(state, device)` installs `state` and returns the one it
replaced. Capture puts them around the random ops of a checkpointed region and its recompute
(graphoffload/recompute.py), as `torch.utils.checkpoint` stashes and restores the state
eagerly. States are CPU byte tensors, as `torch.get_rng_state()` and
`torch.cuda.get_rng_state()` return them. `swap_rng_state` is tagged as a random op, so dead-code
elimination keeps it even when the state it returns is unread.
"""

from __future__ import annotations

import torch
from torch import Tensor

def draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether `node`'s op draws from a generator (dropout's `bernoulli_`, `rand`, ...): a
    recompute must replay its draws."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


_CPU_STATE_BYTES = 5056    # torch.get_rng_state(): the mt19937 state
_CUDA_STATE_BYTES = 16     # torch.cuda.get_rng_state(): philox seed and offset


def _get(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _fake_state(device: torch.device) -> Tensor:
    n = _CUDA_STATE_BYTES if device.type == "cuda" else _CPU_STATE_BYTES
    return torch.empty(n, dtype=torch.uint8, device="cpu")


@torch.library.custom_op("graphoffload::rng_state", mutates_args=())
def rng_state(device: torch.device) -> Tensor:
    """The state of the generator random ops on `device` draw from (a copy)."""
    return _get(device)


@rng_state.register_fake
def _rng_state_fake(device):
    return _fake_state(device)


@torch.library.custom_op("graphoffload::swap_rng_state", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def swap_rng_state(state: Tensor, device: torch.device) -> Tensor:
    """Install `state` in the generator of `device`; returns the state it had."""
    before = _get(device)
    _set(state, device)
    return before


@swap_rng_state.register_fake
def _swap_rng_state_fake(state, device):
    return _fake_state(device)
