"""Graph passes over a `TrainGraph`, and the `PassManager` that runs them.

A pass is a plain function ``(TrainGraph, PassContext) -> TrainGraph`` in a module named after
it. See README.md beside this file for the invariants every pass keeps.
"""

from graphoffload.passes.eliminate_dead_code import eliminate_dead_code
from graphoffload.passes.manager import BUILTIN_PASSES, Pass, PassContext, PassManager
from graphoffload.passes.verify import verify_train_graph

__all__ = ["BUILTIN_PASSES", "Pass", "PassContext", "PassManager", "eliminate_dead_code",
           "verify_train_graph"]
