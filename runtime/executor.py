"""Executor: run a TrainGraph against the user's model and optimizer, updating them in place.

Parameters, buffers and optimizer state enter the graph as the user's own tensors (parameters
as `detach()`ed aliases), so the graph's in-place updates land directly in `model` and
`optimizer`: `model.state_dict()`, `optimizer.state_dict()` and eager code see them at once
and nothing is copied back. Only what the step rebinds rather than mutates is written back
after the run: gradients left on `param.grad`, and buffers the model replaced.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, fx
from torch.distributed.tensor import DTensor

from graphoffload.calibration import host_update_threads
from graphoffload.config import Offload
from graphoffload.data_parallel import ZeRO
from graphoffload.errors import GraphOffloadError, RankTimeoutError, StateError, StepRunError, describe
from graphoffload.graph import TENSOR_SLOT, TrainGraph
from graphoffload.groups import BrokenGroups
from graphoffload.ops.host_transfer import param_of_grad_sum_key
from graphoffload.torch_private import pytree

from graphoffload.runtime.host_offload import OffloadRuntime
from graphoffload.runtime.host_state import HostState
from graphoffload.runtime.profiling import TimingInterpreter
from graphoffload.runtime.sanitizer import Sanitizer, sanitize_requested

if TYPE_CHECKING:
    from graphoffload.capture import Capture


class Executor:
    def __init__(self, graph: TrainGraph, capture: Capture, offload: Offload | None = None,
                 host_state: HostState | None = None, sanitize: bool = False,
                 runtime_for: Callable[[torch.device], OffloadRuntime] | None = None,
                 collective_failed: Callable[[BaseException, str], Exception] | None = None,
                 data_parallel: ZeRO | None = None, broken: BrokenGroups | None = None):
        self.graph = graph
        # a parallel step's groups, shared by the step and all its executors: once one of their
        # collectives failed, nothing runs again (`BrokenGroups.refuse`)
        self.broken = broken if broken is not None else BrokenGroups()
        # a parallel step's: the error for a collective of the graph that failed (another rank
        # failed inside the step, or timed out), from the backend's error and the node
        self.collective_failed = collective_failed
        self.capture = capture
        self.gm = graph.gm
        self.vals = {n.name: n.meta.get("val") for n in graph.graph.nodes if n.op == "placeholder"}
        self.offload_runtime: OffloadRuntime | None = None
        self.host_state: HostState | None = None
        self.skip_flag: Tensor | None = None   # CompileConfig.skip_nonfinite: the last run's flag
        self.device = device = capture.bindings.device
        if any(s.host for s in graph.signature.inputs):
            offload = offload or Offload()
            if runtime_for is not None:   # shared by the variants of a compiled step (shared_runtimes.py)
                self.offload_runtime = runtime_for(device)
            else:
                sanitizer = Sanitizer() if sanitize_requested(sanitize) else None
                self.offload_runtime = OffloadRuntime(device, offload.cpu_workers,
                                                      host_update_threads(offload.cpu_threads), sanitizer)
            # a re-planned graph keeps the host state, whose master weights are authoritative
            # (under ZeRO, of this rank's chunks)
            self.host_state = host_state or HostState(capture.bindings,
                                                      pin_memory=offload.pin_memory and device.type == "cuda",
                                                      zero=data_parallel)
        # uploads a run hands over to the next (Offload.overlap_next_step): key -> parameter names
        param_names = {s.name: s.target for s in graph.signature.inputs if s.kind == "param"}
        hand_overs = [n.args[2] for n in graph.graph.nodes if n.target is torch.ops.graphoffload.hand_over.default]
        self.handed_over = {n.args[2]: [param_names[_viewed(p).name] for p in n.args[1]] for n in graph.graph.nodes
                            if n.target is torch.ops.graphoffload.hand_over.default
                            and param_of_grad_sum_key(n.args[2]) is None}
        # running sums whose CPU adds a run hands over to the next call (Offload.accumulate_on),
        # and those a run waits for itself before it touches them: a switch to this executor
        # from another variant of the step leaves those in flight
        self.hands_over_sums = any(param_of_grad_sum_key(key) is not None for key in hand_overs)
        self.waits_for_sums = frozenset(n.args[1] for n in graph.graph.nodes
                                        if n.target is torch.ops.graphoffload.wait_handed_over.default
                                        and param_of_grad_sum_key(n.args[1]) is not None)
        # device-path write-backs that land after a run returns (Offload.overlap_next_step)
        self.carries_host_writes = any(n.target is torch.ops.graphoffload.carry_host_write.default
                                       for n in graph.graph.nodes)
        # ZeRO stages 1-2 with overlap_next_step: the all-gathers of the updated rows that a run
        # leaves to the start of the next (passes/zero.py), which synchronize() runs in between;
        # a run gathers at its start only while they are pending (`run`), and a failure of them
        # between calls breaks the step for good (`broken`)
        self.deferred_gathers = _deferred_gathers(graph)
        self.gathers_pending = False
        self._without_gathers: fx.GraphModule | None = None

    def place_host_state(self) -> None:
        """Place the offloaded optimizer state and master weights in host memory now, as the
        first run would (fp32 `Shard(0)` DTensors under ZeRO): a checkpoint loaded before that
        run (DCP loads in place) then lands in the very tensors the step updates, in their dtype."""
        if self.host_state is None:
            return
        specs = [s for s in self.graph.signature.inputs if s.host and s.kind != "grad_sum"]
        self.host_state.reserve([(s, self.vals[s.name]) for s in specs])
        in_flight = set(self.params_in_flight())
        for spec in specs:
            self.host_state.tensor(spec, self.vals[spec.name], in_flight)

    def inputs(self, args: tuple, kwargs: dict) -> list[Tensor]:
        b = self.capture.bindings
        leaves = pytree.tree_leaves((args, kwargs))
        batch = [leaves[i] for i in self.capture.batch_positions]
        values: list[Tensor] = []
        in_flight = set(self.params_in_flight())
        if self.host_state is not None:
            self.host_state.reserve([(s, self.vals[s.name]) for s in self.graph.signature.inputs
                                     if s.host and s.kind != "grad_sum"])
        for spec in self.graph.signature.inputs:
            if spec.kind == "grad_sum":   # on the device, or in host memory (Offload.accumulate_on)
                values.append(self.capture.accumulation.sums(spec.target, b.params[spec.target], spec.host,
                                                             self.vals[spec.name].shape))
            elif spec.host:
                values.append(self.host_state.tensor(spec, self.vals[spec.name], in_flight))
            elif spec.kind == "param":
                values.append(self.placed_param(spec.target, self.vals[spec.name]))
            elif spec.kind == "buffer":
                values.append(b.buffer(spec.target))
            elif spec.kind == "state":
                values.append(self.placed_state(spec.target, self.vals[spec.name]))
            elif spec.kind == "lr":
                values.append(torch.tensor(b.lr(*spec.target), dtype=torch.float64))
            elif spec.kind == "scaler":
                values.append(b.scaler_state(*spec.target))
            else:
                values.append(batch[spec.target].detach())
        return values

    def placed_param(self, name: str, like: Tensor) -> Tensor:
        """A parameter as the graph reads it: detached, or, for a DTensor a ZeRO stage 3 step
        sharded, its local rows (writes land in them), which must be what the graph holds."""
        p = self.capture.bindings.params[name]
        if not isinstance(p, DTensor):
            return p.detach()
        local = p.detach().to_local()
        if local.shape != like.shape or local.dtype != like.dtype or local.device != like.device:
            raise StateError(
                f"parameter {name} is a DTensor whose local rows are {local.dtype} of shape {tuple(local.shape)} on "
                f"{local.device}, but the step was compiled for {like.dtype} of shape {tuple(like.shape)} on "
                f"{like.device}: load values into the parameters the step sharded (set_model_state_dict or "
                "torch.distributed.checkpoint), or compile a new step")
        return local

    def placed_state(self, target: tuple[str, str], like: Tensor) -> Tensor:
        """An optimizer-state tensor where the graph was traced to find it. `load_state_dict`
        leaves Adam's step counter on the device the checkpoint had it on (the CPU when torch's
        default implementation saved it): move it back, in the optimizer too, as torch.optim
        moves what it needs itself. Another dtype or shape is an error, not a silent cast. State
        sharded by ZeRO is a DTensor: the graph reads and writes its local chunk."""
        b = self.capture.bindings
        t = b.state(*target)
        name, key = target
        if isinstance(t, DTensor):
            local = t.to_local()   # a view of the DTensor's own local tensor: writes land in it
            if local.device == like.device and local.dtype == like.dtype and local.shape == like.shape:
                return local
            raise StateError(
                f"optimizer state {key!r} of parameter {name} is a DTensor whose local chunk is {local.dtype} of "
                f"shape {tuple(local.shape)} on {local.device}, but the step was compiled for {like.dtype} of "
                f"shape {tuple(like.shape)} on {like.device}; load checkpoints of another world size with "
                "torch.distributed.checkpoint (which reshards them), or compile a new step")
        if t.device == like.device and t.dtype == like.dtype and t.shape == like.shape:
            return t
        if t.dim() and t.shape == b.params[name].shape != like.shape:
            raise StateError(
                f"optimizer state {key!r} of parameter {name} is a plain tensor of the whole parameter's shape "
                f"{tuple(t.shape)}, but this ZeRO step holds this rank's chunk of it ({tuple(like.shape)}), as a "
                "DTensor: load a full optimizer state_dict before the step compiles (it is narrowed then), or "
                "load checkpoints with torch.distributed.checkpoint into the DTensors the step created")
        if t.dtype != like.dtype or t.shape != like.shape:
            raise StateError(
                f"optimizer state {key!r} of parameter {name} is {t.dtype} of shape {tuple(t.shape)}, but "
                f"the step was compiled with {like.dtype} of shape {tuple(like.shape)}; was a state_dict "
                "of another model or precision loaded? Load a matching one, or compile a new step")
        placed = t.to(like.device)
        b.optimizer_of(name).state[b.params[name]][key] = placed
        return placed

    def check_start_state(self) -> None:
        for name, p in self.capture.bindings.params.items():
            if p.grad is not None and name not in self.capture.zeroed_before_backward:
                raise StateError(
                    f"parameter {name} has a .grad left from an earlier step and the compiled step does "
                    "not zero it before backward; a compiled step does not add into gradients left outside "
                    "it: zero it (optimizer.zero_grad() or model.zero_grad()) before calling the step, or "
                    "inside it before backward. To accumulate over calls, compile the step with "
                    "offload_compile(..., accumulation_steps=k)")

    def run(self, args: tuple, kwargs: dict, profile: dict[str, float] | None = None) -> Any:
        """Run one step. With `profile` (a dict), time every node into it instead (slower)."""
        self.broken.refuse("run the step")
        self.check_start_state()
        inputs = self.inputs(args, kwargs)
        gm = self.step_module()
        offload = self.offload_runtime.active() if self.offload_runtime else contextlib.nullcontext()
        with torch.no_grad(), offload:
            try:
                if profile is None:
                    outputs = gm(*inputs)
                else:
                    timer = TimingInterpreter(gm, self.device)
                    outputs = timer.run(*inputs)
                    profile.update(timer.seconds)
            except BaseException as exc:
                error = exc
                failed = self.failed_node(exc)   # found once: both uses below walk the traceback
                if profile is None and not isinstance(exc, GraphOffloadError):
                    if isinstance(exc, torch.OutOfMemoryError):
                        # keeps its type: batch-size finders and retry loops catch it by name
                        exc.add_note(f"graphoffload: {self.run_error(exc, failed)}")
                    elif isinstance(exc, Exception):
                        error = self.run_error(exc, failed)
                self.break_if_past_a_collective(gm, error, failed)
                if error is exc:
                    raise
                raise error from exc
        if self.host_state is not None:
            self.host_state.record_versions(skip=set(self.params_in_flight()))
        self.gathers_pending = self.deferred_gathers is not None
        return self.write_back(outputs)

    def step_module(self) -> fx.GraphModule:
        """The graph this run executes: the step's whole graph while the last run's deferred
        all-gathers are pending (its parameters hold only this rank's updated rows), else the
        same graph without them (`_without_deferred_gathers`): synchronize() gathered the rows
        already, or the parameters are whole as the user gave them (the first run; another
        variant's run, which was synchronized when the step switched to this one). So each
        update's rows are gathered exactly once on every rank: in synchronize() or at the start
        of the next call. Ranks choose alike, as synchronize() is a collective: a rank that
        synchronizes alone times out there (RankTimeoutError, and the step refuses to go on), as
        the other ranks' next call first checks its inputs against every rank's (RankAgreement),
        a collective that rank does not join; its gathers cannot pair with the others' silently."""
        if self.gathers_pending or self.deferred_gathers is None:
            return self.gm
        if self._without_gathers is None:
            self._without_gathers = _without_deferred_gathers(self.graph)
        return self._without_gathers

    def failed_node(self, exc: BaseException) -> fx.Node | None:
        """The graph node whose line of the generated code raised `exc`."""
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<eval_with_key>")]
        code = (frames[-1].line or "") if frames else ""
        name = code.split("=", 1)[0].split(",")[0].strip() if "=" in code else ""
        return next((n for n in self.graph.graph.nodes if n.name == name), None)

    def break_if_past_a_collective(self, gm: fx.GraphModule, error: BaseException, failed: fx.Node | None) -> None:
        """Break the step's groups (`broken`, recording `error`) if the failure raised while `gm`
        ran (any: an op's error, KeyboardInterrupt, SystemExit) at node `failed` (`failed_node`;
        None: not found) stopped this rank after the graph's first collective, or where it
        cannot tell: the other ranks went on into later collectives, which a retry's would pair
        with wrongly (other ops, other buffers). A failure before the first collective leaves the
        groups as they were (a retry is safe, as for a graph without collectives); a
        `RankTimeoutError` the step breaks them with itself."""
        if isinstance(error, RankTimeoutError):
            return
        nodes = list(gm.graph.nodes)
        first = next((i for i, n in enumerate(nodes) if _communicates(n)), None)
        if first is None:
            return
        at = next((i for i, n in enumerate(nodes) if failed is not None and n.name == failed.name), None)
        if at is not None and at < first:
            return
        where = (f"at node {failed.name} ({failed.target}), after the step's first collective (node "
                 f"{nodes[first].name})" if at is not None else
                 "at a point of the graph it cannot locate (so perhaps after some of its collectives)")
        self.broken.break_with(error, f" (this rank stopped inside the step {where}, between collectives its peers "
                                      "went on with: they are inside, or past, later collectives of the step, "
                                      "with which a retry's would pair)")

    def run_error(self, exc: Exception, node: fx.Node | None) -> Exception:
        """`exc`, raised by an op (`node`, `failed_node`'s) while the graph ran, as an error that
        names the op and the user's source line it came from (as capture errors do); raised by a
        collective of a parallel step, as the parallel config's `RankTimeoutError`."""
        from graphoffload.diagnostics import user_line_of_stack_trace

        if node is not None and self.collective_failed is not None and \
                getattr(node.target, "namespace", None) == "_c10d_functional":
            return self.collective_failed(exc, f"{node.target}, node {node.name}")
        if node is None:
            return StepRunError(f"the compiled step failed while it ran: {describe(exc)}")
        where = user_line_of_stack_trace(node.meta.get("stack_trace"))
        hint = "check the values of the step's inputs there"
        if node.target is torch.ops.aten.embedding.default:
            rows = node.args[0].meta["val"].shape[0]
            hint = (f"an index given to this embedding is outside its {rows} rows (token ids beyond the "
                    "vocabulary, or a sequence longer than a position table?): check the batch")
        return StepRunError(
            f"{describe(exc)}, raised by {node.target} (node {node.name}, {node.meta.get('phase', '?')})"
            + (f" at {where}" if where else "") + f", while the compiled step ran: {hint}")

    def params_in_flight(self) -> list[str]:
        """Parameters whose upload an earlier run handed over and nobody has waited for yet."""
        if self.offload_runtime is None:
            return []
        return [name for key in self.offload_runtime.carried for name in self.handed_over.get(key, ())]

    def synchronize(self, keep: frozenset[str] = frozenset()) -> None:
        """Wait for the uploads the last run handed over and its carried write-backs
        (Offload.overlap_next_step), and the CPU adds into running sums it handed over
        (Offload.accumulate_on), except those in `keep` (hand-over keys the next run waits for)."""
        self.broken.refuse("synchronize")
        if self.offload_runtime is not None and self.offload_runtime.in_flight:
            self.offload_runtime.synchronize(keep)
            self.host_state.record_versions()
        if self.gathers_pending:
            self.run_deferred_gathers()

    def run_deferred_gathers(self) -> None:
        """Run the all-gathers the last run left to the next call (ZeRO stages 1-2 with
        Offload.overlap_next_step), once its uploads have landed: every rank's parameters are then
        the whole updated ones. A collective: every rank synchronizes alike. The next run then
        skips the gathers at its start (`step_module`). A failure (a rank that does not answer)
        breaks the step for good (`broken`), rather than leaving the gathers pending for a retry
        that would time out again or pair with other collectives: the parameters hold this rank's
        updated rows and the others' old ones, and the group that would gather them is gone (a rank
        did not answer), or this rank stopped part-way through the buckets."""
        gm, names = self.deferred_gathers
        params = [self.placed_param(name, self.vals[placeholder]) for placeholder, name in names]
        try:
            with torch.no_grad():
                gm(*params)
        except BaseException as exc:
            error = exc
            if isinstance(exc, Exception) and self.collective_failed is not None:
                error = self.collective_failed(exc, "the all-gathers of the updated parameters that "
                                                    "synchronize() runs (with ZeRO stages 1-2 and "
                                                    "Offload(overlap_next_step=True), synchronize(), the model's "
                                                    "forward and state_dict() between calls are collectives: "
                                                    "every rank of the group must call them alike)")
            self.broken.break_with(error, ": the all-gathers of the updated parameters that synchronize() "
                                          "ran between calls failed, so each parameter holds this rank's updated "
                                          "rows and the other ranks' rows from before the last update")
            if error is exc:
                raise
            raise error from exc
        self.gathers_pending = False
        if self.host_state is not None:
            self.host_state.record_versions()

    def write_back(self, outputs: list[Tensor]) -> Any:
        b = self.capture.bindings
        for i in self.capture.stepped_optimizers:
            # torch's contract with lr schedulers: their step() checks that the optimizer stepped
            b.optimizers[i]._opt_called = True
        for name in self.capture.zeroed:
            b.params[name].grad = None
        user: list[Tensor] = []
        for spec, value in zip(self.graph.signature.outputs, outputs):
            if spec.kind == "user":
                user.append(value)
            elif spec.kind == "skipped":
                self.skip_flag = value
            elif spec.kind == "grad":
                b.params[spec.target].grad = value
            else:
                module, attr = b.buffers[spec.target]
                module._buffers[attr] = value
        it = iter(user)
        leaves = [next(it) if c is TENSOR_SLOT else c for c in self.capture.out_constants]
        return pytree.tree_unflatten(leaves, self.capture.out_spec)


def _deferred_gathers(graph: TrainGraph) -> tuple[fx.GraphModule, list[tuple[str, str]]] | None:
    """The nodes `zero` tagged `meta["deferred_gather"]` (each bucket's packing of this rank's
    rows, its all-gather and the copies into the whole parameters), copied into a graph of their
    own whose inputs are the parameters they read, with those parameters' (placeholder, name):
    the same nodes the step runs at its start, so synchronize() gathers exactly as it does."""
    nodes = [n for n in graph.graph.nodes if "deferred_gather" in n.meta]
    if not nodes:
        return None
    param_names = {s.name: s.target for s in graph.signature.inputs if s.kind == "param"}
    tagged = set(nodes)
    inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in tagged))
    if any(i.op != "placeholder" or i.name not in param_names for i in inputs):
        raise GraphOffloadError(f"the deferred all-gathers read {[i.name for i in inputs]}, not parameters alone: "
                                "a pass moved or rewired them; report this with the step")
    sub = fx.Graph()
    env = {i: sub.placeholder(i.name) for i in inputs}
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(None)
    return fx.GraphModule(torch.nn.Module(), sub), [(i.name, param_names[i.name]) for i in inputs]


def _without_deferred_gathers(graph: TrainGraph) -> fx.GraphModule:
    """The step's graph without the nodes `zero` tagged `meta["deferred_gather"]`, for a run whose
    parameters are whole already. Nothing else reads those nodes (their copies write into the
    parameters, which the step's readers take from the placeholders, ordered by position); the
    kept nodes are copied with their names and meta, so errors and profiles name them as the whole
    graph's."""
    tagged = {n for n in graph.graph.nodes if "deferred_gather" in n.meta}
    readers = {u.name for n in tagged for u in n.users if u not in tagged}
    if readers:
        raise GraphOffloadError(f"nodes {sorted(readers)} read the deferred all-gathers' results: a pass rewired "
                                "them, and a run after synchronize() could not leave them out; report this with "
                                "the step")
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.graph.nodes:
        if n not in tagged:
            env[n] = sub.node_copy(n, env.__getitem__)
    return fx.GraphModule(graph.gm, sub)


def _communicates(node: fx.Node) -> bool:
    """Whether `node` exchanges data with the other ranks: an op taking a process group by name
    (`group_name`): the functional collectives (all-reduce, reduce-scatter, all-gather) and ring
    attention's exchanges, forward and backward (a sequence-parallel step's first ones)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.name == "group_name" for a in schema.arguments)


def _viewed(node: fx.Node) -> fx.Node:
    """The placeholder a node views (ZeRO stages 1-2 upload into `slice` views of this rank's rows)."""
    while node.op != "placeholder":
        node = node.args[0]
    return node
