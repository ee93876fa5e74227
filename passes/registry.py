"""The built-in passes, registered once: name, function, when the config enables it, and the
capabilities each requires and provides.

A capability names what a pass leaves in the graph that a later pass builds on ("buckets":
the optimizer updates are grouped into per-bucket fused kernels inside backward), so a contract
reads as what is needed rather than which pass happens to make it today. Every pass also
provides its own name, so a user pass may still require a pass by name. The order of
`BUILTIN_PASS_SPECS` is the pipeline's order; `PassManager` checks a schedule against the
contracts (see `validate_schedule` in manager.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphoffload.config import CompileConfig
from graphoffload.passes.eliminate_dead_code import eliminate_dead_code
from graphoffload.passes.fuse_optimizer import fuse_optimizer
from graphoffload.passes.manager import Pass, PassFn
from graphoffload.passes.offload_optimizer import offload_optimizer
from graphoffload.passes.park_gradients import park_gradients
from graphoffload.passes.ring_attention import ring_attention
from graphoffload.passes.zero import zero


@dataclass(frozen=True)
class PassSpec:
    """A built-in pass: what it is, when it runs, and its contract."""

    name: str
    fn: PassFn
    enabled: Callable[[CompileConfig], bool]
    requires: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    why: str = ""

    def as_pass(self) -> Pass:
        return Pass(self.fn, self.name, self.requires, self.provides)


def _always(config: CompileConfig) -> bool:
    return True


BUILTIN_PASS_SPECS: tuple[PassSpec, ...] = (
    PassSpec("ring_attention", ring_attention, lambda c: c.sequence_parallel is not None,
             provides=("sequence_split",),
             why="split the sequence first: later passes see local shapes"),
    PassSpec("zero", zero, lambda c: c.data_parallel is not None,
             provides=("sharded_updates",),
             why="shard updates and gradients before fusion moves the (fewer) updates into backward"),
    PassSpec("fuse_optimizer", fuse_optimizer, _always,
             provides=("buckets",),
             why="updates move into backward, grouped in buckets; offload's transfers then start during backward"),
    PassSpec("park_gradients", park_gradients, lambda c: c.fuse_optimizer.park_gradients,
             requires=("buckets",), provides=("parked_gradients",),
             why="parks the gradients of waiting buckets in host memory"),
    PassSpec("offload_optimizer", offload_optimizer, lambda c: c.offload is not None,
             provides=("host_state",),
             why="optimizer state in host memory, per bucket on the CPU or the device"),
    PassSpec("eliminate_dead_code", eliminate_dead_code, _always,
             why="runs last, to drop what the others leave"),
)

BUILTIN_PASSES: tuple[str, ...] = tuple(spec.name for spec in BUILTIN_PASS_SPECS)


def builtin_schedule(config: CompileConfig) -> list[Pass]:
    """The built-in passes the config enables, in pipeline order (before `disable_passes`)."""
    return [spec.as_pass() for spec in BUILTIN_PASS_SPECS if spec.enabled(config)]


def known_capabilities() -> frozenset[str]:
    """Every capability a built-in pass provides, and every built-in pass's name."""
    return frozenset(BUILTIN_PASSES).union(*(spec.provides for spec in BUILTIN_PASS_SPECS))
