"""graphoffload: compile a whole PyTorch train step into one graph and rewrite it with passes.

    @graphoffload.offload_compile
    def train_step(model, optimizer, batch):
        loss = model(batch["input_ids"], labels=batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

Layers (imports go one way, left to right; a test checks it):

    graph types, ops, config, errors  <-  capture, passes, runtime  <-  api

`offload_compile`, `CompiledStep` (the api, which imports the runtime) and the pass API load on first
use, so importing `graphoffload.passes` or `graphoffload.capture` never loads the runtime, nor
`graphoffload.runtime` the passes.
"""

import importlib
from typing import TYPE_CHECKING

from graphoffload import ops  # noqa: F401  (the graphoffload:: op vocabulary, declared before any layer uses it)
from graphoffload.config import CompileConfig, FuseOptimizer, Offload
from graphoffload.data_parallel import ZeRO
from graphoffload.errors import (CaptureError, GraphOffloadError, HostSumsUnsupportedError, PartialUpdateError,
                                 PassError, RankFailedMidUpdateError, RankTimeoutError, RingTimeoutError, StateError, StepRunError,
                                 UnsupportedError)
from graphoffload.graph import GraphSignature, InputSpec, Note, OutputSpec, TrainGraph
from graphoffload.memory import MemoryProfile, analyze_memory
from graphoffload.sequence_parallel import SequenceParallel

if TYPE_CHECKING:   # type checkers and IDEs see the lazy names as ordinary imports
    from graphoffload.api import CompiledStep, offload_compile
    from graphoffload.passes import Pass, PassContext, PassManager

# names whose modules load on first use, by the module that defines them
_LAZY = {"CompiledStep": "graphoffload.api", "offload_compile": "graphoffload.api",
         "Pass": "graphoffload.passes", "PassContext": "graphoffload.passes", "PassManager": "graphoffload.passes"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphoffload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CaptureError", "CompileConfig", "CompiledStep", "FuseOptimizer", "GraphOffloadError", "GraphSignature",
    "HostSumsUnsupportedError", "InputSpec",
    "MemoryProfile", "Note", "Offload", "OutputSpec", "PartialUpdateError", "Pass", "PassContext", "PassError",
    "PassManager", "RankFailedMidUpdateError", "RankTimeoutError", "RingTimeoutError", "SequenceParallel", "StateError", "StepRunError",
    "TrainGraph", "UnsupportedError", "ZeRO",
    "analyze_memory", "offload_compile",
]
