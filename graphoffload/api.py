"""`offload_compile` and the `CompiledStep` it returns: the public face of graphoffload."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import Tensor

from graphoffload import inspection, timeline
from graphoffload.calibration import Calibration
from graphoffload.capture import Accumulation, Capture, StepBindings, capture_step, find_bindings
from graphoffload.checkpoint import keep_offloaded_dtypes, load_optimizer_state_exactly
from graphoffload.config import CompileConfig, Offload
from graphoffload.errors import (HostSumsUnsupportedError, PartialUpdateError, RankFailedMidUpdateError, RankTimeoutError,
                                 StateError, describe)
from graphoffload.graph import TrainGraph
from graphoffload.groups import BrokenGroups, MeshRankFailed, check_mesh, mesh_step_group
from graphoffload.interruption import InterruptionGuard, Snapshot
from graphoffload.optimizer_lowering import first_step_params
from graphoffload.memory import MemoryProfile, analyze_memory
from graphoffload.passes.host_accumulation import StepSums, SumPlacement, choose_step_sums
from graphoffload.passes.manager import Pass, PassContext, PassFn, PassManager
from graphoffload.passes.offload_activation_edits import structure
from graphoffload.passes.offload_optimizer import unseen_device_bytes
from graphoffload.passes.offload_plan_cache import load_step_trials, plan_path, step_trials_key, store_step_trials
from graphoffload.passes.registry import builtin_schedule
from graphoffload.runtime.accumulation import GradSums
from graphoffload.runtime.executor import Executor
from graphoffload.runtime.host_state import HostState
from graphoffload.runtime.shared_runtimes import SharedRuntimes
from graphoffload.sequence_parallel import RankAgreement
from graphoffload.torch_private import pytree

log = logging.getLogger("graphoffload")


@dataclass
class CompiledVariant:
    """One trace of the step (for one cache key) after all passes."""

    capture: Capture
    graph: TrainGraph
    stages: Mapping[str, TrainGraph]   # each stage built when first read (graph.Stages)
    executor: Executor
    timings: dict[str, float]
    step_seconds: list[float] = dataclasses.field(default_factory=list)   # timed steps since the last plan
    replans: int = 0
    completed: bool = False   # a call of it ran to the end (until then its created state is provisional)


def _leaf_key(x: Any) -> Any:
    if isinstance(x, Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type, x.device.index, x.requires_grad)
    if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
        return ("object", id(x))
    try:
        hash(x)
        return ("value", x)
    except TypeError:
        return ("object", id(x))


def _optimizer_key(opt: torch.optim.Optimizer, token: Callable[[Tensor], int] = id) -> Any:
    groups = []
    for g in opt.param_groups:
        options = tuple(sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "lr", "initial_lr")))
        groups.append((options, tuple(token(p) for p in g["params"])))
    return (type(opt), tuple(groups), tuple(token(p) for p in first_step_params(opt)))


@contextlib.contextmanager
def _cycle_collection_paused() -> Iterator[None]:
    """Python's cycle collector off while a step compiles, back on (if it was) afterwards.

    A compile creates a few hundred thousand long-lived objects (fx nodes, their meta, fake
    tensors), so the collector's full collections keep rescanning a heap that only grows: they
    took about a fifth of the 24-layer benchmark GPT's compile. What a compile leaves as cyclic
    garbage is small (about 65,000 objects, 5 MiB there), and the next collection frees it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _sums_at(offload: Offload, where: str) -> Offload:
    """`offload` with the running sums placed `where` ("device" or "host"), as `accumulate_on="auto"`
    under ZeRO chose for the whole step; host sums run every update on the CPU, so a stride of
    device updates (`device_updates=k`) gives way to "never" there, as it does for the buckets
    whose sums "auto" moves to the host without ZeRO."""
    strided = where == "host" and offload.device_updates not in ("auto", "never")
    return dataclasses.replace(offload, accumulate_on=where, device_updates="never" if strided else offload.device_updates)


def _trial_options(offload: Offload) -> Offload:
    """The offload options a trial compile of `accumulate_on="auto"` under ZeRO runs under (and
    its on-disk key names): no budget to fail on, activations kept, nothing cached or re-planned."""
    return dataclasses.replace(offload, gpu_memory_budget=None, activations="keep", plan_cache=False, replan_after=0)


# what a rank whose own trial compile took host sums says when another rank's refused them
_REFUSED_ELSEWHERE = "host sums refused on another rank of the group"


def _with_sums(config: CompileConfig, sums: StepSums | None) -> CompileConfig:
    """`config` with `accumulate_on="auto"` resolved to `sums`, the step's choice under ZeRO: the one
    place it is resolved, for the capture's config and the passes' alike."""
    if sums is None:
        return config
    return dataclasses.replace(config, offload=_sums_at(config.offload, sums.where))


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class CompiledStep:
    """A train step compiled by graphoffload. Call it like the original function.

    The first call (and any call with new input shapes, dtypes, devices, train/eval mode or
    optimizer settings) traces the step and runs the pass pipeline; later calls run the cached
    graph. Inspection: `graphs`, `explain()`, `print_graph()`, `draw()`, `dump()`,
    `memory()`.
    """

    def __init__(self, fn: Callable, passes: Sequence[Pass | PassFn] = (), config: CompileConfig | None = None,
                 offload: Offload | None = None, sequence_parallel: Any = None,
                 accumulation_steps: int | None = None, data_parallel: Any = None):
        self.fn = fn
        shorthands = {"offload": offload, "sequence_parallel": sequence_parallel,
                      "accumulation_steps": accumulation_steps, "data_parallel": data_parallel}
        # one replace, so the config checks the combination once, as given
        self.config = dataclasses.replace(config or CompileConfig(),
                                          **{k: v for k, v in shorthands.items() if v is not None})
        k = self.config.accumulation_steps
        self._grad_sums = GradSums()
        # the two variants of an accumulating step: add into the running sums; add and update
        self._accumulation = {update: Accumulation(k, update, self._grad_sums.tensor, self._grad_sums.discard)
                              for update in (False, True)} if k > 1 else None
        self._micro_step = 0     # micro-batches of the current accumulation window done so far
        # Offload(accumulate_on="auto"): where each running sum lives, one decision per input
        # signature that both variants read (passes/host_accumulation.py)
        self._sum_placements: dict[Any, SumPlacement] = {}
        # the same under ZeRO (data_parallel=): one choice for all sums, per input signature (`_step_sums_for`)
        self._step_sums: dict[Any, StepSums] = {}
        self.pass_manager = PassManager(passes, disable=self.config.disable_passes,
                                        builtin=builtin_schedule(self.config))
        self._variants: dict[Any, CompiledVariant] = {}
        self._last: CompiledVariant | None = None
        self._ran: Executor | None = None     # the executor of the last run, whose uploads may be in flight
        # the user's modules and optimizers this step hooked, and the hooks' handles, which are
        # removed when the step is dropped (the objects outlive it; their hooks must not)
        self._hooked: weakref.WeakSet = weakref.WeakSet()
        self._keeping_dtypes: weakref.WeakSet = weakref.WeakSet()   # optimizers whose loads keep offloaded dtypes
        self._hook_handles: list[Any] = []
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        self._host_states: dict[Any, HostState] = {}
        # one offload runtime (worker pool, copy streams) per device for every variant, shut down
        # when this step is garbage-collected: a runtime per variant leaked a thread per re-trace
        self._runtimes = SharedRuntimes(self, self.config.offload, self.config.sanitize)
        # made on the first call of a step over a process group (sequence or data parallel; with
        # both, one per group: the batch is checked over the sequence-parallel group, shapes over both)
        self._rank_agreements: list[RankAgreement] | None = None
        # the group the graph's collectives run over (`OverGroup.step_group`), held weakly:
        # torch keeps it until destroy_process_group(), after which a step must not keep it
        # alive (gloo's threads abort the process when it is freed at interpreter exit)
        self._step_groups: list[weakref.ref] = []   # one per parallel config, in `_pass_config`'s order
        # once a collective of the step (or its input check, or synchronize()'s gathers) failed or
        # timed out, its groups are not used again: every later call, synchronize() and
        # state_dict() refuse at once, before any collective (groups.BrokenGroups)
        self._broken = BrokenGroups()
        # ZeRO stage 3: the DTensor parameters the step made (by name, held weakly), which every
        # later call must find in the model (`_check_sharded_params`)
        self._sharded_params: dict[str, weakref.ref] = {}
        self._replaced: dict[int, int] = {}   # id of such a parameter -> id of the one it replaced
        self.trace_count = 0
        self._skipped: Tensor | None = None   # sum of the skip flags (skip_nonfinite), on the device
        self._interruption = InterruptionGuard()
        self._before: Snapshot | None = None   # the running call's snapshot of what its update may write
        functools.update_wrapper(self, fn)

    @property
    def micro_step(self) -> int:
        """With `accumulation_steps=k`: micro-batches of the current window done (0 .. k-1);
        the next call updates when it is k-1. Always 0 without accumulation. It counts the calls
        that returned and does not wait for the CPU adds into host sums they may have left
        running (`Offload(accumulate_on="host")`): a loop that reads it every call keeps them
        overlapping the next call; an add that failed raises at the next call or sync point."""
        return self._micro_step

    def _next_accumulation(self) -> Accumulation | None:
        if self._accumulation is None:
            return None
        return self._accumulation[self._micro_step == self.config.accumulation_steps - 1]

    def _key(self, args: tuple, kwargs: dict, bindings: StepBindings | None = None) -> Any:
        # the models and optimizers are found once per call (`__call__` passes what it found)
        bindings = bindings if bindings is not None else find_bindings(self.fn, args, kwargs)
        accumulation = self._next_accumulation()
        # a variant that does not update depends on neither the optimizers' settings nor first steps
        # a parameter ZeRO stage 3 sharded keys variants as the one it replaced (compiled before)
        token = (lambda p: self._replaced.get(id(p), id(p))) if self._replaced else id
        optimizers = tuple(id(o) for o in bindings.optimizers) if accumulation is not None and not accumulation.update \
            else tuple(_optimizer_key(o, token) for o in bindings.optimizers)
        return (
            None if accumulation is None else accumulation.update,
            tuple(_leaf_key(x) for x in pytree.tree_leaves((args, kwargs))),
            tuple((n, tuple(p.shape), p.dtype, p.device, p.requires_grad, token(p)) for n, p in bindings.params.items()),
            tuple((n, tuple(t.shape), t.dtype, t.device) for n in bindings.buffers for t in [bindings.buffer(n)]),
            tuple(m.training for model in bindings.modules for m in model.modules()),
            optimizers,
            tuple((id(sc), sc.get_growth_factor(), sc.get_backoff_factor(), sc.get_growth_interval())
                  for sc in bindings.scalers),
            torch.is_grad_enabled(),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
        )

    def _sum_placement(self, key: Any) -> SumPlacement | None:
        offload = self.config.offload
        if self._accumulation is None or offload is None or offload.accumulate_on != "auto" \
                or self.config.data_parallel is not None:   # (under ZeRO: `_step_sums_for`)
            return None
        return self._sum_placements.setdefault((key[1], key[2]), SumPlacement(offload.budget_bytes()))

    def _step_sums_for(self, key: Any, args: tuple, kwargs: dict) -> StepSums | None:
        """Under ZeRO with `accumulation_steps` and `Offload(accumulate_on="auto")`: where every
        running sum of the step lives, chosen once per input signature, before its first compile
        (on every rank at the same call, as compiles are). With a budget this compiles the
        accumulating variant twice as trials (`_trial_peaks`)."""
        offload = self.config.offload
        if self._accumulation is None or offload is None or offload.accumulate_on != "auto" \
                or self.config.data_parallel is None:
            return None
        inputs = (key[1], key[2])
        if inputs not in self._step_sums:
            budget = offload.budget_bytes()
            device_peak, host_peak, refused = (None, None, None) if budget is None else self._trial_peaks(args, kwargs)
            planned = offload.activations == "auto"   # (the trials keep the activations; the planner may fit)
            choice = choose_step_sums(budget, device_peak, host_peak, refused, planned)
            if choice.where == "host":   # (on every rank alike: the peaks are their max over the ranks)
                # the updating call must take host sums too, or "auto" keeps them on the device
                choice = choose_step_sums(budget, device_peak, host_peak, self._host_sums_refusal(args, kwargs),
                                          planned)
            self._step_sums[inputs] = choice
            log.info("%s: %s", self._name, choice.describe())
        return self._step_sums[inputs]

    def _trial_peaks(self, args: tuple, kwargs: dict) -> tuple[int, int | None, str | None]:
        """The accumulating variant's predicted device peak (graph liveness plus what the CUDA
        allocator holds beside it) with every running sum on the device and with every sum on the
        host: one capture, the passes run on two copies of it under trial options (no budget to
        fail on, activations kept, nothing cached), then dropped with the state the capture made.
        Each is the max over the ranks (and both mesh dimensions), so every rank chooses alike. The
        third value says why host sums are refused (`HostSumsUnsupportedError` on some rank; its
        host peak is then None), else None. A restarted job reads this rank's two trials from the
        on-disk plan cache (`_trials_key`) instead of compiling them, and still takes the max."""
        capture = capture_step(self.fn, args, kwargs, self.config, self._accumulation[False])
        device = capture.bindings.device

        def run() -> tuple[list[int], str | None]:
            peaks, refused = [], None
            for where in ("device", "host"):
                graph, why = self._trial_compile(capture.graph.copy(), device, where)
                refused = why or refused
                peaks.append(-1 if graph is None else
                             analyze_memory(graph).peak + sum(unseen_device_bytes(graph.graph, device).values()))
            return peaks, refused
        peaks, refused = self._trials(capture, "the accumulating variant's trials, sums on the device and on the host",
                                      run, with_peaks=True)
        # every rank takes the max, cached or not: a rank whose entry is missing ran its own trials
        device_peak, host_peak, any_refused = self._max_over_ranks([*peaks, refused is not None], device)
        if any_refused:
            return device_peak, None, refused or _REFUSED_ELSEWHERE
        return device_peak, host_peak, None

    def _host_sums_refusal(self, args: tuple, kwargs: dict) -> str | None:
        """Why the updating variant refuses host sums (`HostSumsUnsupportedError`, as the
        `Offload(accumulate_on="host")` compile of this step would raise on its updating call), on
        any rank of the group, else None: one trial compile of it with every sum on the host
        (`_trial_compile`), dropped with the state its capture made."""
        capture = capture_step(self.fn, args, kwargs, _with_sums(self.config, StepSums("host", None)),
                               self._accumulation[True])
        _, refused = self._trials(capture, "the updating variant's trial, sums on the host",
                                  lambda: (None, self._trial_compile(capture.graph, capture.bindings.device, "host")[1]),
                                  with_peaks=False)
        (any_refused,) = self._max_over_ranks([refused is not None], capture.bindings.device)
        return (refused or _REFUSED_ELSEWHERE) if any_refused else None

    def _trials(self, capture: Capture, what: str, run: Callable[[], tuple[list[int] | None, str | None]],
                with_peaks: bool) -> tuple[list[int] | None, str | None]:
        """What this rank's trial compiles of `capture` (`what`) found: `run()`'s peaks (None where
        the trial only asks whether host sums are refused: `with_peaks` False) and why host sums
        are refused (None: they are not), stored in the on-disk plan cache; or, for a restarted
        job, what it stored there (`_trials_key`). The state the capture made is dropped either way."""
        try:
            key = self._trials_key(capture.graph, capture.bindings.device, what)
            cached = load_step_trials(key) if key is not None else None
            if cached is not None and (cached["peaks"] is not None) == with_peaks:
                log.info("%s: accumulate_on='auto': %s reused from the on-disk plan cache (%s)", self._name, what,
                         plan_path(key, "stepsums"))
                return cached["peaks"], cached["refused"]
            peaks, refused = run()
            if key is not None:
                store_step_trials(key, peaks, refused)
            return peaks, refused
        finally:
            capture.discard_created_state()

    def _trials_key(self, graph: TrainGraph, device: torch.device, what: str) -> str | None:
        """The on-disk plan cache's key of `what` this rank's trial compiles of the captured
        `graph` find (offload_plan_cache.step_trials_key), or None where none is kept:
        plan_cache off, or a pass of the user's in the pipeline (its code is not in the key).
        The key holds the user's config less the budget (the step's own groups are made anew by
        every job) and this rank's place in the world and in each of the step's groups."""
        offload = self.config.offload
        if not offload.plan_cache or len(self.pass_manager.passes) != self.pass_manager.builtin_count:
            return None
        places = [(dist.get_rank(g), dist.get_world_size(g)) for g in (ref() for ref in self._step_groups)
                  if g is not None]
        if dist.is_available() and dist.is_initialized():   # (ranks may share one cache directory)
            places.insert(0, (dist.get_rank(), dist.get_world_size()))
        cal = offload.calibration or Calibration.load_or_measure(device, threads=offload.cpu_threads)
        # the options the trials compile under (`_trial_compile`; no budget: another finds the same entry)
        config = dataclasses.replace(self.config, offload=_trial_options(offload))
        return step_trials_key(structure(graph), cal, f"{what}: {config!r} on {device}, this rank in its "
                               f"groups (rank, size): {places}")

    def _trial_compile(self, graph: TrainGraph, device: torch.device, where: str) -> tuple[TrainGraph | None, str | None]:
        """The passes run on `graph` (a trial's capture) with every running sum `where`, under trial
        offload options (no budget to fail on, activations kept, nothing cached or re-planned):
        the graph, or None and why, when host sums are refused (`HostSumsUnsupportedError`)."""
        trial = _trial_options(_sums_at(self.config.offload, where))
        try:
            graph, _ = self.pass_manager.run(graph, self._pass_context(device, offload=trial))
        except HostSumsUnsupportedError as e:
            return None, describe(e)
        return graph, None

    def _max_over_ranks(self, values: list[int], device: torch.device) -> list[int]:
        """`values`, each the max over the ranks of the step's group (the data-parallel group, or
        the mesh's over both dimensions): a collective, so every rank calls it at the same point."""
        groups = [ref() for ref in self._step_groups]
        group = groups[-1] if groups else None
        if group is None or dist.get_world_size(group) == 1:
            return [int(v) for v in values]
        on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        both = torch.tensor([int(v) for v in values], dtype=torch.int64, device=on)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in both.tolist()]

    def _probe(self, args: tuple, kwargs: dict, update: bool, placement: SumPlacement | None,
               sums: StepSums | None = None) -> None:
        """Compile the other variant of an accumulating step only for its predicted peaks under
        each candidate placement of the running sums (recorded in `placement`); its graph is
        dropped, and the optimizer state its capture created with it, so nothing changes."""
        capture = capture_step(self.fn, args, kwargs, _with_sums(self.config, sums), self._accumulation[update])
        try:
            self.pass_manager.run(capture.graph, self._pass_context(capture.bindings.device, sums=sums,
                                                                    grad_sum_placement=placement))
        finally:
            capture.discard_created_state()

    def _host_sums_read(self, accumulation: Accumulation | None, graph: TrainGraph, offload: Offload | None) -> bool:
        """Whether an accumulating variant with running sums on the host (`accumulate_on="host"`)
        belongs to a step whose own code reads the gradients after backward (capture's
        `grad_reads` note), so its updating variant must be checked before the first call runs."""
        return offload is not None and offload.accumulate_on == "host" and accumulation is not None \
            and not accumulation.update \
            and bool(graph.notes_of("capture", "grad_reads"))

    def _compile(self, args: tuple, kwargs: dict, placement: SumPlacement | None = None,
                 sums: StepSums | None = None) -> CompiledVariant:
        with _cycle_collection_paused():
            return self._trace_and_transform(args, kwargs, placement, sums)

    def _trace_and_transform(self, args: tuple, kwargs: dict, placement: SumPlacement | None,
                             sums: StepSums | None = None) -> CompiledVariant:
        start = time.perf_counter()
        accumulation = self._next_accumulation()
        if placement is not None and placement.host is None and placement.budget is not None:
            # the decision needs both variants' peaks and the updating variant's buckets: probe it first
            # (and the accumulating one too when the updating call is the first to compile)
            self._probe(args, kwargs, True, placement)
            if accumulation.update:
                self._probe(args, kwargs, False, placement)
        config = _with_sums(self.config, sums)
        capture = capture_step(self.fn, args, kwargs, config, accumulation)
        log.info("captured %s: %.2f s, %d nodes", self._name, time.perf_counter() - start,
                 len(capture.graph.graph.nodes))
        self.trace_count += 1
        if self.trace_count == self.config.retrace_warning_after:
            warnings.warn(
                f"graphoffload traced {self._name} {self.trace_count} times: each new input shape, "
                "dtype, train/eval mode or optimizer setting re-traces the step. Pad inputs to fixed "
                "shapes to avoid it.", stacklevel=3)
        ctx = self._pass_context(capture.bindings.device, sums=sums, grad_sum_placement=placement)
        try:
            graph, stages = self.pass_manager.run(capture.graph, ctx)
            if self._host_sums_read(accumulation, graph, config.offload):
                # the step reads gradients after backward (seen as None here): host sums serve
                # clip_grad_norm_ only, which the updating variant's graph shows, so compile that
                # now as a probe, and refuse any other read on this first call, before anything runs
                self._probe(args, kwargs, True, None, sums)
            if self.config.data_parallel is not None:   # state for this rank's chunks only
                capture.create_deferred_state(graph, self.config.data_parallel, self.config.offload is not None)
                # stage 3: the parameters too (DTensors of this rank's rows, as FSDP2 keeps them)
                before = dict(capture.bindings.params)
                sharded = capture.shard_parameters(graph, self.config.data_parallel)
                self._sharded_params.update((n, weakref.ref(p)) for n, p in sharded.items())
                self._replaced.update((id(p), id(before[n])) for n, p in sharded.items() if p is not before[n])
                self._refuse_stale_variants({n: before[n] for n, p in sharded.items() if p is not before[n]})
                if any(p is not before[n] for n, p in sharded.items()):
                    # what this call's update writes now: the new parameters' rows (and their state)
                    self._before = Snapshot.take(capture.bindings)
        except BaseException:
            capture.discard_created_state()
            raise
        # every variant over the same parameters and optimizers shares one host state, so the
        # versions it records after each run stay right whichever variant ran last
        bindings = capture.bindings
        owner = (tuple(id(p) for p in bindings.params.values()), tuple(id(o) for o in bindings.optimizers))
        executor = Executor(graph, capture, self.config.offload, host_state=self._host_states.get(owner),
                            sanitize=self.config.sanitize, runtime_for=self._runtimes.get,
                            collective_failed=self._collective_failed(), data_parallel=self.config.data_parallel,
                            broken=self._broken)
        if executor.host_state is not None:
            self._host_states.setdefault(owner, executor.host_state)
        return CompiledVariant(capture, graph, stages, executor, dict(ctx.timings))

    def _refuse_stale_variants(self, replaced: dict[str, Tensor]) -> None:
        """ZeRO stage 3: a variant compiled before this one must not still bind a parameter this
        one's sharding just replaced (it would read, and write, the old whole tensor from now on,
        silently). Every variant shards the same parameters (an accumulating one those its window's
        update updates), so this is a library bug, reported rather than trained through."""
        for variant in self._variants.values():
            stale = sorted(n for n, old in replaced.items() if variant.capture.bindings.params.get(n) is old)
            if stale:
                raise StateError(
                    f"internal error in {self._name}: ZeRO stage 3 sharded {', '.join(stale)} on this call, but a "
                    "variant of the step compiled earlier holds them whole and would keep reading the replaced "
                    "tensors; please report it with the step's code. Until then use ZeRO(stage=2) for this step")

    def _pass_context(self, device: torch.device, sums: StepSums | None = None, offload: Offload | None = None,
                      **kwargs: Any) -> PassContext:
        """What the passes read: `_pass_config`'s config (with `sums`, the step's choice of where the
        running sums live under ZeRO, resolved into it; `offload`: these options instead) and, with
        both `data_parallel=` and `sequence_parallel=`, the name of the step's group over both
        dimensions' ranks."""
        config = _with_sums(self._pass_config(), sums)
        if offload is not None:
            config = dataclasses.replace(config, offload=offload)
        mesh = self._step_groups[2]() if len(self._step_groups) == 3 else None
        return PassContext(config, device, mesh_group=None if mesh is None else mesh.group_name, step_sums=sums,
                           **kwargs)

    def _pass_config(self) -> CompileConfig:
        """The config the passes see. A parallel step's collectives run over a group of its own
        (`OverGroup.step_group`: the same ranks, the config's `timeout_s`), so a rank that fails
        inside the step makes the others fail within `timeout_s`; it is made on the first
        compile, on every rank of the group at once (each compiles on its first call). With both
        `sequence_parallel=` and `data_parallel=` (a 2-D mesh) a third group spans both
        dimensions' ranks (`groups.mesh_step_group`), for ZeRO stage 1's one gradient all-reduce."""
        # both: the sequence-parallel group's first, on every rank, then the data-parallel one's, then the mesh's
        fields = [f for f in ("sequence_parallel", "data_parallel") if getattr(self.config, f) is not None]
        if not fields or not dist.is_available() or not dist.is_initialized():
            return self.config   # one process, or (for inspection) a config that needs no group
        groups = [ref() for ref in self._step_groups]
        wanted = 3 if len(fields) == 2 else 1
        if len(groups) != wanted or any(g is None for g in groups):
            groups = [getattr(self.config, f).step_group() for f in fields]
            if len(fields) == 2:
                groups.append(mesh_step_group(self.config.data_parallel, self.config.sequence_parallel))
            self._step_groups = [weakref.ref(g) for g in groups]
        return dataclasses.replace(self.config, **{f: dataclasses.replace(getattr(self.config, f), group=g)
                                                   for f, g in zip(fields, groups)})

    def _collective_failed(self) -> Callable[[BaseException, str], Exception] | None:
        """What the executor raises when a collective of the graph fails (the config's
        `rank_failed`; not a method of the step, which the executor must not keep alive)."""
        dp, sp = self.config.data_parallel, self.config.sequence_parallel
        if dp is not None and sp is not None:
            return MeshRankFailed(dp, sp)
        parallel = sp or dp
        return None if parallel is None else parallel.rank_failed

    def _check_sharded_params(self, bindings: StepBindings) -> None:
        """ZeRO stage 3: the model must still hold the DTensor parameters the step made (their
        local rows are what the graph binds); refused before anything runs otherwise."""
        from torch.distributed.tensor import DTensor

        dp = self.config.data_parallel
        if dp is None or dp.stage != 3:
            return
        for name, param in bindings.params.items():
            ref = self._sharded_params.get(name)
            ours = ref is not None and ref() is param
            if ours or (ref is None and not isinstance(param, DTensor)):
                continue
            now = f"a DTensor the step did not make ({getattr(param, 'placements', '?')})" \
                if isinstance(param, DTensor) else f"a plain {type(param).__name__} of shape {tuple(param.shape)}"
            raise StateError(
                f"parameter {name} is {now}, but this ZeRO stage 3 step " + (
                    "sharded it into a Shard(0) DTensor parameter when it compiled, and the model no longer holds "
                    "that one: load new values into the parameters the step made (set_model_state_dict, "
                    "torch.distributed.checkpoint, or param.to_local().copy_(...)) instead of replacing them, or "
                    "compile a new step for the new parameters" if ref is not None else
                    "shards plain parameters itself: pass the model's parameters unsharded (not fully_shard'ed)"))

    def _variant(self, args: tuple, kwargs: dict,
                 bindings: StepBindings | None = None) -> tuple[Any, CompiledVariant]:
        bindings = bindings if bindings is not None else find_bindings(self.fn, args, kwargs)
        self._check_sharded_params(bindings)
        key = self._key(args, kwargs, bindings)
        variant = self._variants.get(key)
        if variant is None:
            self.synchronize()   # tracing reads the parameters
            variant = self._variants[key] = self._compile(args, kwargs, self._sum_placement(key),
                                                          self._step_sums_for(key, args, kwargs))
            executor = variant.executor
            if executor.handed_over or executor.carries_host_writes or executor.hands_over_sums \
                    or executor.deferred_gathers is not None:
                self._synchronize_before_outside_access(variant.capture.bindings)
            if executor.host_state is not None:
                self._keep_offloaded_dtypes_on_load(variant.capture.bindings)
        self._last = variant
        return key, variant

    def synchronize(self) -> None:
        """Wait until the last call's parameter uploads have landed. Only needed with
        `Offload(overlap_next_step=True)`, before reading or changing parameters between calls
        in ways the step does not see (it synchronizes itself before the model's forward and
        before `state_dict()`/`load_state_dict()` of the model, the optimizer or the step).
        Under ZeRO stages 1-2 it also runs the all-gathers of the updated rows the last call left
        to the next (which then does not gather them again): a collective, so call it on every rank
        alike. If they fail (a rank did not answer), or any collective of the step did, the step
        refuses every later call, synchronize() and state_dict(): restart the job from the last
        checkpoint."""
        self._broken.refuse(f"synchronize {self._name}")
        if self._ran is not None:
            try:
                self._ran.synchronize()
            except RankTimeoutError as exc:
                self._broken.break_with(exc)
                raise

    def _synchronize_before_outside_access(self, bindings: Any) -> None:
        # public hooks, held weakly: the model and optimizer do not keep the step alive
        ref = weakref.ref(self)

        def sync(*_: Any) -> None:
            step = ref()
            if step is not None:
                step.synchronize()
        for obj in (*bindings.modules, *bindings.optimizers):
            if obj in self._hooked:
                continue
            self._hooked.add(obj)
            self._hook_handles += [obj.register_state_dict_pre_hook(sync), obj.register_load_state_dict_pre_hook(sync)]
            if isinstance(obj, torch.nn.Module):
                self._hook_handles.append(obj.register_forward_pre_hook(sync))

    def _keep_offloaded_dtypes_on_load(self, bindings: Any) -> None:
        """`optimizer.load_state_dict` (and DCP's `set_optimizer_state_dict`, which calls it) keeps
        the dtype of the state this step offloads (graphoffload/checkpoint.py)."""
        ref = weakref.ref(self)

        def offloaded() -> set[int]:   # the ids of the parameters whose state the step offloads now
            step = ref()
            if step is None or step._last is None:
                return set()
            return {id(p) for p in step._last.capture.bindings.params.values()}

        for opt in bindings.optimizers:
            if opt in self._keeping_dtypes:
                continue
            self._keeping_dtypes.add(opt)
            self._hook_handles += keep_offloaded_dtypes(opt, offloaded)

    def compile(self, *args: Any, **kwargs: Any) -> TrainGraph:
        """Trace and transform the step for these arguments without running it (so its graphs,
        memory and plan can be inspected first; models on the meta device work too). With
        `offload=`, a model's real parameters also get their host state placed, as the first call
        would place it (fp32 master weights and moments): a checkpoint loaded before the first
        call (the DCP recipe) loads into it in its own dtype."""
        self._broken.refuse(f"compile {self._name}")
        if self.config.sequence_parallel is not None:   # per-rank batch shards -> full sequence
            args, kwargs = self.config.sequence_parallel.prepare_inputs(args, kwargs)
        variant = self._variant(args, kwargs)[1]
        executor = variant.executor
        if executor.host_state is not None and not any(
                p.is_meta for p in variant.capture.bindings.params.values()):
            executor.place_host_state()
        return variant.graph

    def compile_variants(self, *args: Any, **kwargs: Any) -> dict[str, TrainGraph]:
        """`compile` every variant the step's calls run for these arguments, without running it:
        with `accumulation_steps=k`, the accumulating calls' ("accumulate") and the k-th, updating
        call's ("update"), whose peak (the update's own memory included) is the one to check a
        budget against before training; otherwise the one ("step"). Variants the optimizer's
        state selects (SGD's first momentum step) are compiled by the call that needs them, as
        ever. `micro_step` is left as it was, and `last` (what `memory()`, `explain()` and
        `train_graph` show) is the variant the next call runs."""
        if self._accumulation is None:
            return {"step": self.compile(*args, **kwargs)}
        graphs: dict[str, TrainGraph] = {}
        variants: dict[str, CompiledVariant] = {}
        micro_step, update_at = self._micro_step, self.config.accumulation_steps - 1
        try:
            for name, at in (("accumulate", 0), ("update", update_at)):
                self._micro_step = at
                graphs[name] = self.compile(*args, **kwargs)
                variants[name] = self._last
        finally:
            self._micro_step = micro_step
        self._last = variants["update" if micro_step == update_at else "accumulate"]   # the next call's
        return graphs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # first: before the call's first collective (RankAgreement's), and whatever else a
        # restore or accept_partial_update() cleared, the groups stay broken
        self._broken.refuse(f"run {self._name}")
        self._interruption.check(self._name)
        self._refuse_incomplete_sums("run")
        bindings = find_bindings(self.fn, args, kwargs)
        self._before = Snapshot.take(bindings)
        try:
            result = self._call(args, kwargs, bindings)
        except BaseException as exc:
            updated = self._before.changed()
            if not updated:
                # a rank timeout (in the input check at the start, or a collective of the graph)
                # breaks the step's groups even though nothing changed; any other failure that
                # changed nothing (bad input) leaves the step retryable, unless the executor broke
                # the groups because it came after the graph's first collective
                if isinstance(exc, RankTimeoutError):
                    self._broken.break_with(exc)
                self._forget_unrun_variant()
                raise
            message = self._interruption.interrupted(exc, updated, bindings, self._name)
            if isinstance(exc, RankTimeoutError):   # the group is gone: say so first
                error = RankFailedMidUpdateError(
                    f"{exc} Before it failed, this rank's step (its fused optimizer updates, or the all-gathers "
                    "of the parameters' updated rows it runs when switching between its compiled variants) had "
                    f"changed {self._interruption.shown()}, and not the rest: restore the model and optimizer from "
                    "that checkpoint in the restarted job (in this process, every later call, synchronize() and "
                    "state_dict() of this step refuse)")
                self._broken.break_with(error)
                raise error from exc
            if isinstance(exc, Exception):
                raise PartialUpdateError(message) from exc
            exc.add_note("graphoffload: " + message)   # KeyboardInterrupt, SystemExit stay what they are
            raise
        self.last.completed = True
        if self._accumulation is not None:
            self._micro_step = (self._micro_step + 1) % self.config.accumulation_steps
        flag, self._ran.skip_flag = self._ran.skip_flag, None
        if flag is not None:   # summed where it is, so counting costs no synchronization
            self._skipped = flag.clone() if self._skipped is None else self._skipped + flag.to(self._skipped.device)
        return result

    def _refuse_incomplete_sums(self, what: str) -> None:
        """After a handed-over CPU add into a running sum failed (it surfaced as a StateError at
        a call or a sync point), every call and step.state_dict() refuse with that error until
        step.load_state_dict(...) resets the window: the sums miss a micro-batch."""
        failed = self._runtimes.failed_sums()
        if failed is not None:
            raise StateError(f"refusing to {what} {self._name}: {failed}") from failed.__cause__

    @property
    def skipped_steps(self) -> int:
        """With `CompileConfig(skip_nonfinite=True)`: how many calls skipped their update because
        their loss or global gradient norm was not finite (reading it waits for the device)."""
        return 0 if self._skipped is None else int(self._skipped.item())

    def _forget_unrun_variant(self) -> None:
        """The first call of a new variant failed before changing anything: drop the optimizer
        state its capture created (eager would have none after a failed first step, and SGD's
        next first step would skip its momentum initialisation) and the variant with it, so the
        next call traces afresh."""
        variant = self._last
        if variant is None or variant.completed:
            return
        variant.capture.discard_created_state()
        self._variants = {k: v for k, v in self._variants.items() if v is not variant}
        self._last = next(reversed(self._variants.values()), None)
        if self._ran is variant.executor:
            self._ran = None

    def accept_partial_update(self) -> None:
        """After a `PartialUpdateError`: train on from the partly updated model and optimizer
        (instead of restoring them from a checkpoint)."""
        self._interruption.clear()

    def _call(self, args: tuple, kwargs: dict, bindings: StepBindings) -> Any:
        parallels = [p for p in (self.config.sequence_parallel, self.config.data_parallel) if p is not None]
        if self._rank_agreements is None and parallels:
            if len(parallels) == 2:   # two dimensions of a mesh: checked once, before anything is traced
                check_mesh(self.config.data_parallel, self.config.sequence_parallel)
            self._rank_agreements = [RankAgreement(p) for p in parallels]
        for agreement in self._rank_agreements or ():
            agreement.check(args, kwargs)
        if self.config.sequence_parallel is not None:   # per-rank batch shards -> full sequence
            args, kwargs = self.config.sequence_parallel.prepare_inputs(args, kwargs)
        key, variant = self._variant(args, kwargs, bindings)
        if self._ran is not variant.executor:
            # only the executor that handed uploads over knows where its next run waits for them;
            # running sums' adds are named alike by every variant, so those the new one waits for
            # before it touches them stay in flight
            if self._ran is not None:
                self._ran.synchronize(keep=variant.executor.waits_for_sums)
            self._ran = variant.executor
        offload = self.config.offload
        if variant.graph.schedule is None or offload is None or not offload.replan_after or variant.replans >= 3:
            return variant.executor.run(args, kwargs)
        if len(variant.step_seconds) < offload.replan_after:
            return self._timed_run(variant, args, kwargs)
        measured = statistics.median(variant.step_seconds)
        predicted = variant.graph.schedule.step_seconds
        if abs(measured - predicted) <= offload.replan_threshold * predicted:
            variant.replans = 3    # the plan holds: stop timing steps
            return variant.executor.run(args, kwargs)
        node_seconds: dict[str, float] = {}
        result = variant.executor.run(args, kwargs, profile=node_seconds)
        self._replan(key, variant, node_seconds, measured)
        return result

    def _timed_run(self, variant: CompiledVariant, args: tuple, kwargs: dict) -> Any:
        device = variant.executor.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = variant.executor.run(args, kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        variant.step_seconds.append(time.perf_counter() - start)
        return result

    def _replan(self, key: Any, old: CompiledVariant, node_seconds: dict[str, float], measured: float) -> None:
        """Run the passes again on the captured graph with measured node times."""
        ctx = self._pass_context(old.executor.device, sums=self._step_sums.get((key[1], key[2])),
                                 measured_node_seconds=node_seconds, grad_sum_placement=self._sum_placement(key))
        graph, stages = self.pass_manager.run(old.stages["captured"].copy(), ctx)
        for g in {id(graph): graph, id(stages["final"]): stages["final"]}.values():
            g.note("offload_optimizer", f"re-planned from measured node times: the last plan predicted "
                   f"{old.graph.schedule.step_seconds * 1e3:.3g} ms a step, {measured * 1e3:.3g} ms were measured")
        executor = Executor(graph, old.capture, self.config.offload, host_state=old.executor.host_state,
                            sanitize=self.config.sanitize, runtime_for=self._runtimes.get,
                            collective_failed=self._collective_failed(), data_parallel=self.config.data_parallel,
                            broken=self._broken)
        new = CompiledVariant(old.capture, graph, stages, executor, dict(ctx.timings), replans=old.replans + 1)
        self._variants[key] = new    # `last` stays the variant that ran until the next call

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The state of every optimizer the step drives, as `optimizer.state_dict()` gives it:
        offloaded state (fp32 master weights, moments) stays in host memory. Refused (`StateError`)
        once a collective of the step failed or timed out."""
        self.synchronize()
        self._refuse_incomplete_sums("save the window of")
        state: dict[str, Any] = {"optimizers": [opt.state_dict() for opt in self.last.capture.bindings.optimizers]}
        if self._accumulation is not None:
            # mid-window, the micro-batches done so far live only in the running sums
            state["accumulation"] = {"steps": self.config.accumulation_steps, "micro_step": self._micro_step,
                                     "grad_sums": self._grad_sums.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any],
                        optimizers: Sequence[torch.optim.Optimizer] | None = None) -> None:
        """Load what `state_dict()` returned, exactly: tensors keep their dtype and stay where they
        were saved (unlike `optimizer.load_state_dict`, which casts state to each parameter's
        device and dtype, so offloaded fp32 state would land on the GPU in bf16). Before the
        step's first call, pass the optimizers it will drive. Refused once a collective of the step
        failed or timed out: the job restarts from the checkpoint instead."""
        self._broken.refuse(f"load a checkpoint into {self._name}")
        try:
            self.synchronize()
        except StateError:
            if self._runtimes.failed_sums() is None:
                raise
            # a failed CPU add into a running sum: this load resets the sums it left incomplete
        if optimizers is None:
            optimizers = self.last.capture.bindings.optimizers
        saved = state["optimizers"]
        if len(saved) != len(optimizers):
            raise ValueError(f"the checkpoint holds {len(saved)} optimizers, the step drives {len(optimizers)}")
        window = state.get("accumulation")
        k = self.config.accumulation_steps
        if window is not None and window["micro_step"] and window["steps"] != k:
            raise StateError(f"the checkpoint was taken after micro-batch {window['micro_step']} of an accumulation "
                             f"window of {window['steps']}, but this step accumulates {k}: load it into a step "
                             f"with accumulation_steps={window['steps']}, or take the checkpoint at an update")
        if window is None and self._micro_step:
            raise StateError(f"this step is after micro-batch {self._micro_step} of {k} of an accumulation window "
                             "and the checkpoint holds no window: load it at an update boundary (step.micro_step == 0)")
        for opt, opt_state in zip(optimizers, saved):
            load_optimizer_state_exactly(opt, opt_state)
        if window is not None and k > 1:
            self._grad_sums.load_state_dict(window["grad_sums"] if window["micro_step"] else {})
            self._micro_step = window["micro_step"]
        elif self._runtimes.failed_sums() is not None:
            self._grad_sums.load_state_dict({})   # at an update boundary: no sums yet
        self._runtimes.forget_failed_sums()
        self._interruption.restored_optimizers(optimizers)

    # ------------------------------------------------------------------ inspection

    def timeline(self, path: str = "timeline.json") -> str:
        """Write a Chrome/Perfetto trace of the last step: the offload planner's predicted
        timeline beside the measured spans of the last run, one track per stream and CPU worker.

        On a GPU the copy-stream tracks count from when the GPU reached the step's start, the
        CPU tracks from when the CPU did: they line up for a step started on an idle GPU
        (call `torch.cuda.synchronize()` before the step you want to look at). With a planned
        schedule, a `recompute` track shows activation checkpointing's recomputed regions at
        their predicted times (each span's args: region, source line, nodes)."""
        runtime = self.last.executor.offload_runtime
        schedule = self.last.graph.schedule
        return timeline.write_chrome_trace(path, schedule, runtime.measured_spans() if runtime else [],
                                           timeline.timed_recompute_spans(self.last.stages, schedule))

    def plot(self, path: str = "schedule.png") -> str:
        """Write a PNG of the step's schedule above the device memory over the step: the planned
        schedule when there is one, else the measured spans of the last run (CPU update, copies)
        above the device memory at each node of the final graph. The memory panel draws the
        compiled step's predicted memory beside the same step without recompute (every
        activation kept) and without offload, where the step has them, and shades the
        recomputed regions."""
        schedule = self.last.graph.schedule
        runtime = self.last.executor.offload_runtime
        measured = runtime.measured_spans() if runtime is not None and schedule is None else []
        if schedule is None and runtime is not None and not measured:
            raise StateError(f"{self._name} has not run yet, and has no planned schedule to draw: call the step "
                             "once before plot() (a schedule is planned with Offload(device_updates='auto' or k) "
                             "on a GPU or with an explicit calibration)")
        return timeline.plot(path, schedule, measured, timeline.step_picture(self.last.stages, schedule), self._name)

    @property
    def _name(self) -> str:
        fn = getattr(self.fn, "func", self.fn)   # a functools.partial names its function
        return getattr(fn, "__name__", type(fn).__name__)

    @property
    def last(self) -> CompiledVariant:
        if self._last is None:
            raise RuntimeError("the step has not been called yet: call it once to capture its graph")
        return self._last

    @property
    def graphs(self) -> dict[str, torch.fx.GraphModule]:
        """Stage name (``captured``, each pass, ``final``) -> GraphModule, for the last call."""
        return {name: g.gm for name, g in self.last.stages.items()}

    @property
    def train_graph(self) -> TrainGraph:
        return self.last.graph

    def memory(self, stage: str = "final") -> MemoryProfile:
        """Liveness analysis of a stage: bytes live at each node and the predicted peak."""
        return analyze_memory(self.last.stages[stage])

    def explain(self, file: Any = None) -> str:
        """Per stage: node counts by phase, nodes added/removed, predicted peak; pass notes."""
        return inspection.explain(self.last.stages, self.last.timings, file=file)

    def print_graph(self, stage: str = "final", file: Any = None) -> str:
        """Readable code of a stage: shapes, dtypes, phase, creating pass, user source line."""
        return inspection.format_graph(self.last.stages[stage], stage, file=file)

    def draw(self, stage: str = "final", path: str = "graph.dot") -> str:
        """Write DOT (and SVG beside it when graphviz's `dot` is installed), nodes coloured by phase."""
        return inspection.draw(self.last.stages[stage], stage, path)

    def dump(self, directory: str) -> list[str]:
        """Write every stage as readable text and as a re-runnable Python module."""
        return inspection.dump(self.last.stages, directory)


@overload
def offload_compile(fn: Callable, *, passes: Sequence[Pass | PassFn] = ...,
                    config: CompileConfig | None = ..., offload: Offload | None = ...,
                    sequence_parallel: Any = ..., accumulation_steps: int | None = ...,
                    data_parallel: Any = ...) -> CompiledStep: ...
@overload
def offload_compile(fn: None = ..., *, passes: Sequence[Pass | PassFn] = ...,
                    config: CompileConfig | None = ...,
                    offload: Offload | None = ...,
                    sequence_parallel: Any = ...,
                    accumulation_steps: int | None = ...,
                    data_parallel: Any = ...) -> Callable[[Callable], CompiledStep]: ...


def offload_compile(fn: Callable | None = None, *, passes: Sequence[Pass | PassFn] = (),
                    config: CompileConfig | None = None, offload: Offload | None = None,
                    sequence_parallel: Any = None, accumulation_steps: int | None = None,
                    data_parallel: Any = None):
    """Compile a train step (forward, ``loss.backward()``, ``optimizer.step()``) into one graph.

    Use as ``@offload_compile`` or ``offload_compile(train_step, passes=[...], config=...)``.

    Args:
        fn: the train step. The model(s) and optimizer(s) it uses are found among its arguments
            and closure; tensors among its arguments are the batch.
        passes: extra passes ``(TrainGraph, PassContext) -> TrainGraph`` run after the built-in ones.
        config: a `CompileConfig`.
        offload: keep optimizer state in host memory and update on the CPU (`Offload`);
            shorthand for ``config.offload``.
        sequence_parallel: split the sequence across the ranks of a process group
            (`graphoffload.SequenceParallel`); shorthand for ``config.sequence_parallel``.
        accumulation_steps: k > 1 makes each call one micro-batch; every k-th call updates with
            the mean of the k gradients; shorthand for ``config.accumulation_steps``.
        data_parallel: ZeRO data parallelism over a process group (`graphoffload.ZeRO`): each
            rank passes its own micro-batch; shorthand for ``config.data_parallel``.
    """
    if fn is None:
        return lambda f: CompiledStep(f, passes, config, offload, sequence_parallel, accumulation_steps, data_parallel)
    return CompiledStep(fn, passes, config, offload, sequence_parallel, accumulation_steps, data_parallel)
