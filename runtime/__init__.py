"""Runtime: executes a compiled TrainGraph and owns graphoffload's custom ops."""

from graphoffload.runtime import attention, host_offload  # noqa: F401  (register torch.ops.graphoffload.*)
from graphoffload.runtime.executor import Executor

__all__ = ["Executor"]
