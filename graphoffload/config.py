"""Configuration objects of `offload_compile`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from graphoffload.calibration import Calibration


@dataclass(frozen=True)
class FuseOptimizer:
    """Options of the `fuse_optimizer` pass (updates run inside backward).

    The pass never changes results. With global-norm clipping in the step, updates must wait
    for every gradient: only the per-gradient norms move into backward, and by default the
    gradients stay on the device until their update after backward (the memory cost of exact
    clipping). `park_gradients=True` recovers that memory at a time cost instead.

    Attributes:
        bucket_numel: most elements one fused update kernel covers. Smaller buckets free
            gradients sooner; larger ones launch fewer kernels. None: 1/32 of all parameters,
            clamped to [64K, 16M] elements.
        park_gradients: gradients whose update must wait past backward (global-norm
            clipping) wait in pinned host memory: copied out as soon as they are final, back one
            bucket ahead of their update (the `park_gradients` pass). Results stay exact; the
            device peak falls by about those gradients' bytes; each crosses the host link twice,
            and the copy back (gradient bytes / host-to-device bandwidth) lengthens the step.
    """

    bucket_numel: int | None = None
    park_gradients: bool = False

    def __post_init__(self) -> None:
        if self.bucket_numel is not None and self.bucket_numel <= 0:
            raise ValueError(f"bucket_numel must be positive, got {self.bucket_numel}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size: int | str) -> int:
    """`20GiB`, `512 MB`, `1e9` or an int -> bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(f"cannot read {size!r} as a size: use bytes or a number with one of "
                         "KiB, MiB, GiB, TiB, KB, MB, GB, TB")
    return int(float(number) * _UNITS[unit])


@dataclass(frozen=True)
class Offload:
    """Keep optimizer state in host memory and update on the CPU (the `offload_optimizer` pass).

    fp32 master weights and optimizer moments live in pinned host memory; parameters stay on
    the device in their own dtype (e.g. bf16 for mixed precision).

    Attributes:
        gpu_memory_budget: most device memory the step may use (bytes or "20GiB"); compiling
            fails with the minimum needed when the predicted peak exceeds it. None: no check.
            On a GPU the check adds to the predicted peak what the CUDA allocator holds outside
            the graph's tensors, as modelled terms: cuBLAS workspaces (64 MiB), attention
            backward's fp32 accumulator, and blocks kept by record_stream until their copy to
            the host ends (`passes/offload_optimizer.unseen_device_bytes`; explain() lists them).
        cpu_workers: threads that run host updates (each update kernel also uses torch's
            intra-op threads, so one is usually right).
        cpu_threads: intra-op threads each host update uses. None (default): every core the
            process may run on but two (at least one), left to the thread that launches the
            graph's kernels and to the communication libraries' threads. The calibration
            measures the CPU update with the same count.
        pin_memory: allocate host state in pinned memory (needed for asynchronous copies).
        device_updates: which buckets update on the device instead of the CPU. "auto" (default):
            chosen per bucket by the performance model from a calibration of this machine (on a
            machine without a GPU every bucket takes the CPU path unless a calibration is given);
            "never": all on the CPU (ZeRO-Offload); an int k: one bucket in every k on the device
            (Deep Optimizer States' fixed schedule).
        calibration: rates for the performance model; None measures this machine once and
            caches the result (see `Calibration.load_or_measure`).
        overlap_next_step: let the CPU path's last updates and uploads finish while the next
            call's forward runs: that call waits for each bucket's parameters right before its
            forward first reads them, instead of this call waiting for all of them at its end.
            Device-path buckets likewise do not block the host for their state's write-back:
            it lands after the call returns, and the next call's prefetch of that state waits
            for it in stream order.
            Between calls parameters may then still be in flight: the step synchronizes itself
            before the model's forward or `state_dict()`/`load_state_dict()` of the model, the
            optimizer or the step run; anything else that reads or writes parameters or
            `optimizer.state` between calls (another compiled step on the same model too) must
            call `step.synchronize()` first (under ZeRO stage 3 that includes `full_tensor()` of a
            parameter). Under ZeRO stages 1-2 each bucket's all-gather of the updated rows moves
            to the start of the next call (right before forward first reads the bucket), so a
            CPU-path upload of this rank's rows is handed over as stage 3's is; between calls
            each rank's parameters then hold only its own updated rows, and `synchronize()`
            (the model's forward, `state_dict()`) runs the pending gathers: a collective, so
            every rank must do it alike. Off by default.
        plan_cache: keep each offload plan on disk beside the calibration
            (`$XDG_CACHE_HOME/graphoffload/plans/`), keyed by everything the planner reads (the
            step's predicted costs, the calibration, the budget), so a restarted job with the
            same model, shapes and calibration skips planning. A reused plan is the plan
            planning again would make. False: always plan.
        activations: what happens to the activations forward saves for backward. "keep"
            (default): they stay on the device, as eagerly. "auto" (needs `gpu_memory_budget`):
            while the predicted device peak is over the budget, the saved activations live at
            the peak are, one at a time and most bytes per second of added cost first,
            recomputed in backward from values on the device anyway (a short chain of ops;
            random ops replay the forward's draws) or copied to pinned host memory after their
            last forward read and prefetched back before their first backward read. Costs come
            from the same calibration as the optimizer-state plan, and with a planned schedule
            the activation copies take the gaps its transfers leave on each link (one
            timeline; the bucket plan is made first). explain() lists each choice.
            Results are unchanged. When nothing more can move, compiling fails with the least
            peak reached.
        replan_after: with a planned schedule, time this many steps after each plan; if their
            median drifts from the prediction by more than `replan_threshold` (a fraction),
            profile the next step node by node and plan again from the measured times (at most
            three times). 0 turns this off.
        accumulate_on: where the running gradient sums of `accumulation_steps=k` live.
            "device" (default): on the device, in the gradients' dtype (one gradient set of
            device memory for the whole window). "host": in pinned host memory, in fp32: on an
            accumulating call each gradient is copied to the host as soon as it is final and
            added there on the CPU worker, so the device frees it at once and holds no sums (the
            predicted peak falls by about a gradient set); the updating call copies the last
            micro-batch's gradients as usual and the host adds the sums before its update. Every
            bucket then takes the CPU path, and the step must not read the accumulated gradient
            on the device besides its update (`clip_grad_norm_`, a GradScaler's inf checks):
            such a step is refused on its first call, before anything runs; use "device" there.
            "auto": per bucket, sums stay on the device while the predicted peaks of both
            compiled variants fit `gpu_memory_budget`, and move to the host (buckets in backward
            order) until they fit; all on the device without a budget; sums the step reads after
            backward stay on the device. The peaks are predicted with the saved activations kept:
            with activations="auto" a budget no placement meets so is left to the activation
            planner, with the placement of least need (under ZeRO the lesser trial peak). Ignored without `accumulation_steps`. Under ZeRO
            (`data_parallel=`) "device" sums are each rank's whole partial sums, reduced over the
            group once per update; "host" sums are this rank's chunks: every call reduce-scatters
            its gradients and adds this rank's chunk into the host sum (no sums on the device, a
            collective per micro-batch); "auto" is one choice for the whole step: device sums when the
            accumulating call's predicted peak with them (a trial compile) fits `gpu_memory_budget`
            (or there is no budget), else host sums (zero note `sum_choice`), unless a trial
            compile of either call with host sums refuses them (`skip_nonfinite=True`, say): then
            device sums, the budget perhaps not met. With
            `sequence_parallel=` too, host sums reduce every call's chunks over both mesh
            dimensions, and "auto" takes its trial peaks as the max over all the mesh's ranks.
    """

    gpu_memory_budget: int | str | None = None
    cpu_workers: int = 1
    cpu_threads: int | None = None
    pin_memory: bool = True
    device_updates: Literal["auto", "never"] | int = "auto"
    calibration: Calibration | None = None
    overlap_next_step: bool = False
    plan_cache: bool = True
    replan_after: int = 3
    replan_threshold: float = 0.25
    accumulate_on: Literal["device", "host", "auto"] = "device"
    activations: Literal["keep", "auto"] = "keep"

    def __post_init__(self) -> None:
        self.budget_bytes()   # validate early
        if self.accumulate_on not in ("device", "host", "auto"):
            raise ValueError(f"accumulate_on must be 'device', 'host' or 'auto', got {self.accumulate_on!r}")
        if self.accumulate_on == "host" and self.device_updates not in ("auto", "never"):
            raise ValueError(f"accumulate_on='host' runs every update on the CPU, which device_updates="
                             f"{self.device_updates!r} contradicts: leave device_updates at 'auto' (or 'never'), "
                             "or accumulate on the device")
        if self.cpu_workers < 1:
            raise ValueError("cpu_workers must be at least 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1 (or None: all cores but two), got {self.cpu_threads}")
        if self.device_updates not in ("auto", "never") and not (
                isinstance(self.device_updates, int) and self.device_updates >= 1):
            raise ValueError(f"device_updates must be 'auto', 'never' or a stride k >= 1, got {self.device_updates!r}")

        if self.activations not in ("keep", "auto"):
            raise ValueError(f"activations must be 'keep' or 'auto', got {self.activations!r}")
        if self.activations == "auto" and self.gpu_memory_budget is None:
            raise ValueError("activations='auto' plans the saved activations against gpu_memory_budget: "
                             "set a budget (e.g. Offload(gpu_memory_budget='20GiB', activations='auto')), "
                             "or keep activations='keep'")

    def budget_bytes(self) -> int | None:
        return None if self.gpu_memory_budget is None else parse_bytes(self.gpu_memory_budget)


@dataclass(frozen=True)
class CompileConfig:
    """Options of a compiled train step.

    Attributes:
        subgroup_numel: the optimizer update is emitted per subgroup of parameters holding at
            most this many elements (a tensor is never split), so later passes can move, place
            and offload each subgroup on its own.
        disable_passes: names of built-in passes to skip (e.g. ``("fuse_optimizer",)``).
        fuse_optimizer: options of the `fuse_optimizer` pass.
        offload: options of optimizer offload to host memory; None (default) keeps state on
            the device.
        verify: verify the graph after every pass (lint, ``meta["val"]``, signature).
        retrace_warning_after: warn once a step has been traced this many times (new input
            shapes, dtypes, train/eval mode or optimizer settings each cause a re-trace).
        sequence_parallel: a `graphoffload.SequenceParallel`: split the sequence across the
            ranks of a process group (the `ring_attention` pass); None (default): no split.
        data_parallel: a `graphoffload.ZeRO`: each rank of a process group trains on its own
            micro-batch, gradients averaged, optimizer state (with stage 2 gradients too, with
            stage 3 parameters too) sharded over the group (the `zero` pass); None (default):
            one process. With `sequence_parallel` too, the two groups are the two dimensions
            of a device mesh (`ZeRO(group=mesh["dp"])`, `SequenceParallel(group=mesh["sp"])`):
            the ranks of an sp group split one micro-batch's sequence, ZeRO shards over dp.
        accumulation_steps: k > 1 makes each call one micro-batch: its gradients (of the loss
            divided by k) are added into running sums kept on the device, and every k-th call
            updates from the sums (DeepSpeed's gradient_accumulation_steps). 1: every call updates.
        sanitize: on a machine without a GPU, run the offload runtime's asynchronous ops late,
            in random order, with their destinations poisoned (NaN) until they complete, so a
            read the schedule does not order after its wait changes results (a test mode; the
            environment variable GRAPHOFFLOAD_SANITIZE=1 turns it on too; see
            graphoffload/runtime/sanitizer.py).
        skip_nonfinite: skip the update of a call whose loss (anything `backward()` is called
            on) or global gradient norm is not finite: no parameter, optimizer state or step
            counter changes (gradients are still cleared as the step says), and the call is
            counted in `step.skipped_steps`. Exact otherwise. Fused updates then wait for every
            gradient, as with global-norm clipping. Under ZeRO the loss and the norm are every
            rank's (the flag is combined over the group), so every rank skips alike, with
            offload= too (the host updates read the combined flag). Off by default
            (graphoffload/nonfinite.py).
    """

    subgroup_numel: int = 32 * 1024 * 1024
    disable_passes: tuple[str, ...] = ()
    fuse_optimizer: FuseOptimizer = field(default_factory=FuseOptimizer)
    offload: Offload | None = None
    verify: bool = True
    retrace_warning_after: int = 8
    sequence_parallel: Any = None
    data_parallel: Any = None
    accumulation_steps: int = 1
    sanitize: bool = False
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, got {self.accumulation_steps!r}")
        if self.subgroup_numel <= 0:
            raise ValueError(f"subgroup_numel must be positive, got {self.subgroup_numel}")
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))

    @property
    def host_sums_under_zero(self) -> bool:
        """Whether ZeRO keeps the running gradient sums as this rank's chunks in host memory
        (`data_parallel=`, `offload=Offload(accumulate_on="host")`, `accumulation_steps` > 1; "auto"
        reaches the passes as the step's choice): `zero` then reduces every call's gradients itself
        (passes/zero.py says why), and `ring_attention` leaves the adds into the sums to it."""
        return self.data_parallel is not None and self.offload is not None \
            and self.offload.accumulate_on == "host" and self.accumulation_steps > 1
