"""One offload runtime per compiled step and device, shared by every variant of the step.

A step re-traces for new input shapes, dtypes or modes and keeps every variant, so a runtime
made per variant (each with its own CPU worker pool and, on a GPU, its own copy streams) would
add a worker thread per new shape that lives as long as the step: a long run over varying
sequence lengths would collect them without bound. The variants of one step run one at a
time and already share the host state (fp32 master weights, moments), so they share the
runtime too: its workers, streams, the uploads handed over to the next call and the widened
gradient scratch.

When the step is dropped (deleted and garbage-collected), a `weakref.finalize` shuts the
pools down. It does not wait: an upload still queued (handed over to a call that will never
come) lands in the parameters first, then the workers end.
"""

from __future__ import annotations

import weakref

import torch

from graphoffload.calibration import host_update_threads
from graphoffload.config import Offload
from graphoffload.errors import StateError
from graphoffload.runtime.host_offload import OffloadRuntime
from graphoffload.runtime.sanitizer import Sanitizer, sanitize_requested


def _shutdown(runtimes: dict[torch.device, OffloadRuntime]) -> None:
    for runtime in runtimes.values():
        runtime.shutdown()
    runtimes.clear()


class SharedRuntimes:
    """The offload runtimes of one compiled step, made on first use, one per device; they are
    shut down when `owner` is garbage-collected or `shutdown()` is called."""

    def __init__(self, owner: object, offload: Offload | None, sanitize: bool):
        self._offload = offload or Offload()
        self._sanitize = sanitize
        self._runtimes: dict[torch.device, OffloadRuntime] = {}
        # the finalizer holds the dict, never the owner, so it does not keep the owner alive
        self._finalizer = weakref.finalize(owner, _shutdown, self._runtimes)

    def get(self, device: torch.device) -> OffloadRuntime:
        device = torch.device(device)
        runtime = self._runtimes.get(device)
        if runtime is None:
            offload = self._offload
            sanitizer = Sanitizer() if sanitize_requested(self._sanitize) else None
            runtime = self._runtimes[device] = OffloadRuntime(
                device, offload.cpu_workers, host_update_threads(offload.cpu_threads), sanitizer)
        return runtime

    def failed_sums(self) -> StateError | None:
        """The error of a handed-over add into a running sum that failed (`OffloadRuntime.failed_sums`),
        until `forget_failed_sums()`: the step's accumulation window is incomplete."""
        return next((r.failed_sums for r in self._runtimes.values() if r.failed_sums is not None), None)

    def forget_failed_sums(self) -> None:
        """The step reset its running sums (its load_state_dict): a failed add no longer matters."""
        for runtime in self._runtimes.values():
            runtime.failed_sums = None

    def __len__(self) -> int:
        return len(self._runtimes)

    def shutdown(self) -> None:
        """End the worker threads now (queued work still runs first). A runtime asked for later
        is made afresh."""
        _shutdown(self._runtimes)
