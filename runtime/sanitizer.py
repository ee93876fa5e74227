"""Sanitizer: make data in flight observable where copies are otherwise synchronous.

On a machine without a GPU the offload runtime's copies are plain synchronous copies, so a graph
that reads a tensor before the wait that orders it after its transfer still gets the right
numbers: the bug shows only on a GPU, and only when the timing is unlucky. With the sanitizer on
(`CompileConfig(sanitize=True)` or the environment variable `GRAPHOFFLOAD_SANITIZE=1`), every
asynchronous op of the CPU runtime behaves as the worst legal GPU timing would:

- from its launch until the op completes, its destination holds poison (NaN for floating
  tensors, the dtype's largest value for integers, True for bools), so a read that is not
  ordered after the op's wait sees poison instead of stale or fresh values;
- the op completes on its own thread after a random small delay (seeded, so a failure can be
  replayed with the same `GRAPHOFFLOAD_SANITIZE_SEED`), in any order the real runtime allows:
  copies on the device-to-host stream stay in FIFO order (a CUDA stream guarantees that, and the
  runtime relies on it), host updates and uploads complete in any order their dependencies
  allow.

A copy's source is read at its launch, as a CUDA copy stream ordered after the compute stream
reads it. The sanitizer changes timing only: a correct schedule gives the same numbers with it
on, bit for bit; it is slower (a thread and a delay per op), for tests.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
from torch import Tensor

SANITIZE_ENV = "GRAPHOFFLOAD_SANITIZE"
SANITIZE_SEED_ENV = "GRAPHOFFLOAD_SANITIZE_SEED"


def sanitize_requested(configured: bool) -> bool:
    """The config's flag, or the environment variable set to a true value."""
    return configured or os.environ.get(SANITIZE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def poison(tensors: Sequence[Tensor]) -> None:
    """Fill tensors with a value no correct computation reads back."""
    for t in tensors:
        if t.dtype == torch.bool:
            t.fill_(True)
        elif t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        else:
            t.fill_(torch.iinfo(t.dtype).max)


class Sanitizer:
    """Runs the CPU runtime's asynchronous ops late, in random order, over poisoned destinations."""

    # ordered streams: ops launched on one complete in launch order (the d2h copy stream)
    FIFO_STREAMS = ("d2h",)

    def __init__(self, seed: int | None = None, min_delay_s: float = 5e-4, max_delay_s: float = 2e-3):
        if seed is None:
            seed = int(os.environ.get(SANITIZE_SEED_ENV, "0"))
        self.seed = seed
        self.rng = random.Random(seed)
        # a floor on the delay: an op that could complete at once would hide a read right after it
        self.min_delay_s, self.max_delay_s = min_delay_s, max_delay_s
        self._last: dict[str, Future] = {}

    def launch(self, stream: str, destinations: Sequence[Tensor], after: Sequence[Future],
               work: Callable[[], object]) -> Future:
        """Poison `destinations` now; run `work` on its own thread after a random delay, once
        every future in `after` (and, on a FIFO stream, the stream's previous op) is done."""
        poison(destinations)
        delay = self.rng.uniform(self.min_delay_s, self.max_delay_s)
        before = list(after)
        if stream in self.FIFO_STREAMS and stream in self._last:
            before.append(self._last[stream])
        fut: Future = Future()

        def run() -> None:
            time.sleep(delay)
            try:
                for dependency in before:
                    dependency.result()
                fut.set_result(work())
            except BaseException as exc:   # delivered to whoever waits for the op
                fut.set_exception(exc)
        if stream in self.FIFO_STREAMS:
            self._last[stream] = fut
        threading.Thread(target=run, name=f"graphoffload-sanitize-{stream}", daemon=True).start()
        return fut
