"""Graph passes over a `TrainGraph`, and the `PassManager` that runs them.

A pass is a plain function ``(TrainGraph, PassContext) -> TrainGraph`` in a module named after
it; registry.py registers the built-in ones with their contracts. See README.md beside this file for the invariants every pass keeps.
"""

from graphoffload.passes.eliminate_dead_code import eliminate_dead_code
from graphoffload.passes.manager import Pass, PassContext, PassManager, validate_schedule
from graphoffload.passes.registry import BUILTIN_PASS_SPECS, BUILTIN_PASSES, PassSpec, builtin_schedule
from graphoffload.passes.verify import verify_train_graph

__all__ = ["BUILTIN_PASSES", "BUILTIN_PASS_SPECS", "Pass", "PassContext", "PassManager", "PassSpec", "builtin_schedule",
           "eliminate_dead_code", "validate_schedule", "verify_train_graph"]
