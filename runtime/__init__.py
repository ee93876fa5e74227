"""Runtime: executes a compiled TrainGraph and owns graphoffload's custom ops."""

from graphoffload.runtime import attention  # noqa: F401  (registers torch.ops.graphoffload.attention*)
from graphoffload.runtime.executor import Executor

__all__ = ["Executor"]
