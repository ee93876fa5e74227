"""PassManager: run an ordered list of passes, check their contracts, verify after each.

A pass is a plain function ``(TrainGraph, PassContext) -> TrainGraph``. Its contract, as
function attributes or through `Pass`: ``requires``, the capabilities (or pass names) that passes
before it must provide, and ``provides``, what it leaves for later passes (it always provides
its own name). The built-in passes are registered in registry.py.

After every pass the manager stamps the nodes the pass created with its name (recorded as they
are created, by fx's node-creation hook, so a pass that copies another node's meta cannot carry
the old name over), fills in ``meta["val"]`` and ``meta["phase"]`` a pass left out (by
fake-tensor propagation and from the node's inputs), recomputes ``meta["val"]`` of nodes whose
arguments the pass edited without updating it (and of their users, as far as a value changes),
verifies the graph, and keeps a snapshot
of it as a stage for inspection, so a broken pass is named in the error and every dump says which
pass made each node.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx

from graphoffload.config import CompileConfig
from graphoffload.errors import GraphOffloadError, PassError
from graphoffload.graph import Stages, TrainGraph, fill_missing_meta, refresh_vals, snapshot_inputs
from graphoffload.passes.verify import Verifier
from graphoffload.torch_private import recording_created_nodes

if TYPE_CHECKING:
    from graphoffload.passes.host_accumulation import StepSums, SumPlacement

# one INFO line per pass with its time, so a long compile shows what it is doing
log = logging.getLogger("graphoffload")

PassFn = Callable[[TrainGraph, "PassContext"], TrainGraph]


@dataclass(frozen=True)
class Pass:
    """A pass function with its name and its contract: the capabilities (or pass names) it
    requires passes before it to provide, and the capabilities it provides to later ones."""

    fn: PassFn
    name: str
    requires: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()

    @staticmethod
    def of(obj: Pass | PassFn) -> Pass:
        if isinstance(obj, Pass):
            return obj
        if not callable(obj):
            raise TypeError(f"a pass must be a callable (TrainGraph, PassContext) -> TrainGraph, got {obj!r}")
        return Pass(obj, getattr(obj, "pass_name", obj.__name__), tuple(getattr(obj, "requires", ())),
                    tuple(getattr(obj, "provides", ())))


@dataclass
class PassContext:
    """What a pass may read besides the graph; no pass keeps state anywhere else."""

    config: CompileConfig
    device: torch.device
    timings: dict[str, float] = field(default_factory=dict)
    # measured seconds of each node of an earlier run (profile-guided planning), by node name
    measured_node_seconds: dict[str, float] | None = None
    # with accumulation_steps and Offload(accumulate_on="auto"): the step's one decision of where
    # each running gradient sum lives, shared by both compiled variants (passes/host_accumulation.py)
    grad_sum_placement: SumPlacement | None = None
    # with data_parallel=, accumulation_steps and Offload(accumulate_on="auto"): the step's one choice
    # of where all running sums live, which `config` already carries as "device" or "host"; the
    # zero pass notes it (passes/host_accumulation.py, StepSums)
    step_sums: StepSums | None = None
    # with data_parallel= and sequence_parallel= (a 2-D mesh): the name of the step's group over
    # both dimensions' ranks, over which ZeRO stage 1 all-reduces the gradients in one collective
    mesh_group: str | None = None


def validate_schedule(passes: Sequence[Pass], known: frozenset[str]) -> None:
    """Check that every pass's requirements are provided by passes scheduled before it. `known`:
    the capabilities some pass could provide (the built-in ones); a requirement outside it and
    outside what the scheduled passes provide names nothing, and the error says so."""
    provided_anywhere = known.union(*({p.name, *p.provides} for p in passes))
    provided: set[str] = set()
    for i, p in enumerate(passes):
        unknown = [r for r in p.requires if r not in provided_anywhere]
        if unknown:
            raise PassError(f"pass {p.name!r} requires {unknown}, which no pass provides and no pass is named; "
                            f"known capabilities and passes: {sorted(provided_anywhere)}")
        missing = [r for r in p.requires if r not in provided]
        if missing:
            raise PassError(f"pass {p.name!r} requires {missing}, which no pass scheduled before it provides "
                            f"(they are disabled or later in the pipeline); scheduled so far: "
                            f"{[q.name for q in passes[:i]]}; whole pipeline: {[q.name for q in passes]}")
        provided |= {p.name, *p.provides}


def _stamp_provenance(graph: TrainGraph, created: list[fx.Node], pass_name: str) -> None:
    # every node the pass created and kept is its own, whatever meta it copied from another node
    live = set(graph.graph.nodes)
    for node in created:
        if node in live:
            node.meta["pass"] = pass_name


class PassManager:
    """Runs built-in passes (minus disabled ones) then user passes, in order, after checking
    the schedule against the passes' contracts. `builtin`: the built-in passes to run (default:
    those a default `CompileConfig` enables, from the registry)."""

    def __init__(self, user_passes: Sequence[Pass | PassFn] = (), disable: Sequence[str] = (),
                 builtin: Sequence[Pass] | None = None):
        from graphoffload.passes import registry   # the registry imports this module (for Pass)

        builtin = list(registry.builtin_schedule(CompileConfig()) if builtin is None else builtin)
        known = set(registry.BUILTIN_PASSES) | {p.name for p in builtin}
        unknown = set(disable) - known
        if unknown:
            raise PassError(f"cannot disable unknown pass(es) {sorted(unknown)}; built-in passes: {sorted(known)}")
        self.passes = [p for p in builtin if p.name not in disable] + [Pass.of(p) for p in user_passes]
        self.builtin_count = len(self.passes) - len(user_passes)
        validate_schedule(self.passes, registry.known_capabilities())

    def run(self, graph: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, Stages]:
        """Run every pass; return the final graph and a snapshot after each stage."""
        verify = Verifier() if ctx.config.verify else None
        if verify is not None:
            verify(graph, "capture")
        stages = Stages()
        stages.record("captured", graph)
        for i, p in enumerate(self.passes):
            start = time.perf_counter()
            if i >= self.builtin_count:
                graph.gm.recompile()   # a user pass may run or print the module it is given
            before = snapshot_inputs(graph)
            try:
                with recording_created_nodes(graph.gm) as created:
                    result = p.fn(graph, ctx)
            except GraphOffloadError:
                raise   # already says what is wrong and what to do
            except Exception as exc:
                raise PassError(f"pass {p.name!r} raised {type(exc).__name__}: {exc}") from exc
            if not isinstance(result, TrainGraph):
                raise PassError(f"pass {p.name!r} returned {type(result).__name__}, expected a TrainGraph")
            graph = result
            _stamp_provenance(graph, created, p.name)
            fill_missing_meta(graph, p.name)
            try:
                refresh_vals(graph, p.name, before)
            except PassError:
                # an edit whose value cannot be inferred broke the graph: verify's error (when on)
                # names what is wrong with it more precisely than the failed inference
                if verify is not None:
                    verify(graph, p.name)
                raise
            if verify is not None:
                verify(graph, p.name)
            ctx.timings[p.name] = time.perf_counter() - start
            log.info("pass %s: %.2f s, %d nodes", p.name, ctx.timings[p.name], len(graph.graph.nodes))
            stages.record(p.name, graph)
        stages.alias("final", self.passes[-1].name if self.passes else "captured")
        if verify is not None:
            log.info("verified %d times: %.3f s (%.3f s CPU)", verify.count, verify.seconds, verify.cpu_seconds)
        # the module's Python code, generated once for the graph the runtime runs (the built-in
        # passes edit the fx graph only; each stage generates its own when first read)
        graph.gm.recompile()
        return graph, stages
