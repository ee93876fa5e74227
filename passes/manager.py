"""PassManager: run an ordered list of passes, check their contracts, verify after each.

A pass is a plain function ``(TrainGraph, PassContext) -> TrainGraph``. It may carry
``requires`` (names of passes that must run before it) as a function attribute or through
`Pass`. After every pass the manager stamps the nodes the pass created with its name, fills in
``meta["val"]`` and ``meta["phase"]`` a pass left out (by fake-tensor propagation and from the
node's inputs), verifies the graph, and keeps a snapshot of it as a stage for inspection, so a
broken pass is named in the error and every dump says which pass made each node.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from graphoffload.config import CompileConfig
from graphoffload.errors import GraphOffloadError, PassError
from graphoffload.graph import TrainGraph, fill_missing_meta
from graphoffload.passes.eliminate_dead_code import eliminate_dead_code
from graphoffload.passes.fuse_optimizer import fuse_optimizer
from graphoffload.passes.offload_optimizer import offload_optimizer
from graphoffload.passes.park_gradients import park_gradients
from graphoffload.passes.ring_attention import ring_attention
from graphoffload.passes.verify import verify_train_graph

# one INFO line per pass with its time, so a long compile shows what it is doing
log = logging.getLogger("graphoffload")

PassFn = Callable[[TrainGraph, "PassContext"], TrainGraph]


@dataclass(frozen=True)
class Pass:
    """A pass function with its name and the passes it requires to have run before it."""

    fn: PassFn
    name: str
    requires: tuple[str, ...] = ()

    @staticmethod
    def of(obj: Pass | PassFn) -> Pass:
        if isinstance(obj, Pass):
            return obj
        if not callable(obj):
            raise TypeError(f"a pass must be a callable (TrainGraph, PassContext) -> TrainGraph, got {obj!r}")
        return Pass(obj, getattr(obj, "pass_name", obj.__name__), tuple(getattr(obj, "requires", ())))


@dataclass
class PassContext:
    """What a pass may read besides the graph; no pass keeps state anywhere else."""

    config: CompileConfig
    device: torch.device
    timings: dict[str, float] = field(default_factory=dict)
    # measured seconds of each node of an earlier run (profile-guided planning), by node name
    measured_node_seconds: dict[str, float] | None = None


def builtin_passes(config: CompileConfig) -> list[Pass]:
    """The built-in pipeline for a config, in order. Offload works on fusion's buckets, so its
    transfers start during backward; dead-code elimination runs last to drop what they leave."""
    passes = [Pass(fuse_optimizer, "fuse_optimizer")]
    if config.fuse_optimizer.park_gradients:
        passes.append(Pass(park_gradients, "park_gradients", ("fuse_optimizer",)))
    if config.sequence_parallel is not None:   # split the sequence first: later passes see local shapes
        passes.insert(0, Pass(ring_attention, "ring_attention"))
    if config.offload is not None:
        passes.append(Pass(offload_optimizer, "offload_optimizer"))
    passes.append(Pass(eliminate_dead_code, "eliminate_dead_code"))
    return passes


BUILTIN_PASSES: tuple[str, ...] = ("ring_attention", "fuse_optimizer", "park_gradients", "offload_optimizer",
                                   "eliminate_dead_code")


class PassManager:
    """Runs built-in passes (minus disabled ones) then user passes, in order."""

    def __init__(self, user_passes: Sequence[Pass | PassFn] = (), disable: Sequence[str] = (),
                 builtin: Sequence[Pass] | None = None):
        builtin = list(builtin_passes(CompileConfig()) if builtin is None else builtin)
        known = set(BUILTIN_PASSES) | {p.name for p in builtin}
        unknown = set(disable) - known
        if unknown:
            raise PassError(f"cannot disable unknown pass(es) {sorted(unknown)}; built-in passes: {sorted(known)}")
        self.passes = [p for p in builtin if p.name not in disable] + [Pass.of(p) for p in user_passes]
        seen: set[str] = set()
        for p in self.passes:
            missing = [r for r in p.requires if r not in seen]
            if missing:
                raise PassError(f"pass {p.name!r} requires {missing} to run before it; they are disabled "
                                f"or later in the pipeline {[q.name for q in self.passes]}")
            seen.add(p.name)

    def run(self, graph: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, dict[str, TrainGraph]]:
        """Run every pass; return the final graph and a snapshot after each stage."""
        if ctx.config.verify:
            verify_train_graph(graph, "capture")
        stages = {"captured": graph.copy()}
        for p in self.passes:
            start = time.perf_counter()
            try:
                result = p.fn(graph, ctx)
            except GraphOffloadError:
                raise   # already says what is wrong and what to do
            except Exception as exc:
                raise PassError(f"pass {p.name!r} raised {type(exc).__name__}: {exc}") from exc
            if not isinstance(result, TrainGraph):
                raise PassError(f"pass {p.name!r} returned {type(result).__name__}, expected a TrainGraph")
            graph = result
            fill_missing_meta(graph, p.name)
            graph.gm.recompile()
            if ctx.config.verify:
                verify_train_graph(graph, p.name)
            ctx.timings[p.name] = time.perf_counter() - start
            log.info("pass %s: %.2f s, %d nodes", p.name, ctx.timings[p.name], len(graph.graph.nodes))
            stages[p.name] = graph.copy()
        stages["final"] = stages[self.passes[-1].name] if self.passes else stages["captured"]
        return graph, stages
