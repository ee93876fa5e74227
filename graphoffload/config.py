"""Configuration objects of `offload_compile`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CompileConfig:
    """Options of a compiled train step.

    Attributes:
        subgroup_numel: the optimizer update is emitted per subgroup of parameters holding at
            most this many elements (a tensor is never split), so later passes can move, place
            and offload each subgroup on its own.
        disable_passes: names of built-in passes to skip (e.g. ``("eliminate_dead_code",)``).
        verify: verify the graph after every pass (lint, ``meta["val"]``, signature).
        retrace_warning_after: warn once a step has been traced this many times (new input
            shapes, dtypes, train/eval mode or optimizer settings each cause a re-trace).
    """

    subgroup_numel: int = 32 * 1024 * 1024
    disable_passes: tuple[str, ...] = ()
    verify: bool = True
    retrace_warning_after: int = 8

    def __post_init__(self) -> None:
        if self.subgroup_numel <= 0:
            raise ValueError(f"subgroup_numel must be positive, got {self.subgroup_numel}")
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
