"""Configuration objects of `offload_compile`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FuseOptimizer:
    """Options of the `fuse_optimizer` pass (updates run inside backward).

    The pass never changes results. With global-norm clipping in the step, updates must wait
    for every gradient: only the per-gradient norms move into backward, and the gradients'
    memory is not freed early (the cost of exact clipping).

    Attributes:
        bucket_numel: most elements one fused update kernel covers. Smaller buckets free
            gradients sooner; larger ones launch fewer kernels. None: 1/32 of all parameters,
            clamped to [64K, 16M] elements.
    """

    bucket_numel: int | None = None

    def __post_init__(self) -> None:
        if self.bucket_numel is not None and self.bucket_numel <= 0:
            raise ValueError(f"bucket_numel must be positive, got {self.bucket_numel}")


@dataclass(frozen=True)
class CompileConfig:
    """Options of a compiled train step.

    Attributes:
        subgroup_numel: the optimizer update is emitted per subgroup of parameters holding at
            most this many elements (a tensor is never split), so later passes can move, place
            and offload each subgroup on its own.
        disable_passes: names of built-in passes to skip (e.g. ``("fuse_optimizer",)``).
        fuse_optimizer: options of the `fuse_optimizer` pass.
        verify: verify the graph after every pass (lint, ``meta["val"]``, signature).
        retrace_warning_after: warn once a step has been traced this many times (new input
            shapes, dtypes, train/eval mode or optimizer settings each cause a re-trace).
    """

    subgroup_numel: int = 32 * 1024 * 1024
    disable_passes: tuple[str, ...] = ()
    fuse_optimizer: FuseOptimizer = field(default_factory=FuseOptimizer)
    verify: bool = True
    retrace_warning_after: int = 8

    def __post_init__(self) -> None:
        if self.subgroup_numel <= 0:
            raise ValueError(f"subgroup_numel must be positive, got {self.subgroup_numel}")
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
