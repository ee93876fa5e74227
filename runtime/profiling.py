"""Profile one run of a graph node by node (profile-guided planning).

Runs the GraphModule under an fx.Interpreter that times every node, synchronizing the device
around each one so a node's time is its own. Slower than a normal run, so the executor uses
it for one step when the offload plan needs measured compute times.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import fx


class TimingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, device: torch.device):
        super().__init__(gm)
        self.device = device
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        self._sync()
        start = time.perf_counter()
        out = super().run_node(n)
        self._sync()
        self.seconds[n.name] = time.perf_counter() - start
        return out
