"""graphoffload: compile a whole PyTorch train step into one graph and rewrite it with passes.

    @graphoffload.offload_compile
    def train_step(model, optimizer, batch):
        loss = model(batch["input_ids"], labels=batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss
"""

from graphoffload.api import CompiledStep, offload_compile
from graphoffload.config import CompileConfig, FuseOptimizer, Offload
from graphoffload.errors import (CaptureError, GraphOffloadError, PartialUpdateError, PassError, RingTimeoutError,
                                 StateError, StepRunError, UnsupportedError)
from graphoffload.graph import GraphSignature, InputSpec, OutputSpec, TrainGraph
from graphoffload.memory import MemoryProfile, analyze_memory
from graphoffload.passes import Pass, PassContext, PassManager
from graphoffload.sequence_parallel import SequenceParallel

__all__ = [
    "CaptureError", "CompileConfig", "CompiledStep", "FuseOptimizer", "GraphOffloadError", "GraphSignature", "InputSpec",
    "MemoryProfile", "Offload", "OutputSpec", "PartialUpdateError", "Pass", "PassContext", "PassError", "PassManager",
    "RingTimeoutError", "SequenceParallel", "StateError", "StepRunError", "TrainGraph", "UnsupportedError",
    "analyze_memory", "offload_compile",
]
