"""Runtime: executes a compiled TrainGraph, and registers the kernels of the graphoffload:: ops that
need its streams, CPU worker or process groups (their schemas and fake kernels are in graphoffload/ops)."""

from graphoffload.runtime import host_offload, ring_attention  # noqa: F401  (register the kernels of ops/ that need the runtime)
from graphoffload.runtime.executor import Executor

__all__ = ["Executor"]
