"""Runtime: executes a compiled TrainGraph and owns graphoffload's custom ops."""

from graphoffload.runtime import attention, fused_optimizer_meta, grouped_mm, host_offload  # noqa: F401  (op registrations)
from graphoffload.runtime.executor import Executor

__all__ = ["Executor"]
