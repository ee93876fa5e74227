"""The process-group side shared by the parallelism configs (`SequenceParallel`, `ZeRO`).

Each names its group the same way (None: the world group) and is asked the same questions by
its pass and by the compiled step (the group's name for functional collectives, this rank, the
group's size), so they resolve it in one place.

A compiled step's collectives do not run over the user's group but over a group of the step's
own (`step_group`), made over the same ranks with the config's `timeout_s`: a rank that dies or
raises between two collectives of a step then makes the others' next collective fail within
`timeout_s` (gloo: the timeout of every wait; NCCL: the watchdog's), not after the user's
group's timeout (gloo's default is 30 minutes), and `rank_failed` turns the backend's error into
the config's `RankTimeoutError`. The user's group keeps its own timeout for everything else.
"""

from __future__ import annotations

import datetime
from typing import Any, ClassVar

import torch.distributed as dist

from graphoffload.errors import UnsupportedError, describe


class OverGroup:
    """Mixin of a frozen config dataclass with `group` (a process group or None) and
    `timeout_s` fields, and a `timeout_error` class attribute (a `RankTimeoutError`)."""

    group: Any
    timeout_s: float
    parallelism: ClassVar[str] = "this parallelism"   # how errors name it
    timeout_error: ClassVar[type[Exception]]

    def process_group(self) -> dist.ProcessGroup:
        if not dist.is_available() or not dist.is_initialized():
            raise UnsupportedError(f"{self.parallelism} needs torch.distributed: call "
                                   "torch.distributed.init_process_group() first (e.g. under torchrun)")
        return self.group if self.group is not None else dist.group.WORLD

    @property
    def group_name(self) -> str:
        return self.process_group().group_name

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group())

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group())

    def step_group(self) -> dist.ProcessGroup:
        """A new process group over the ranks of this config's group, in the same order and on
        the same backend, whose collectives time out after `timeout_s`. Every rank of the group
        must call this at the same point (a compiled step does when it first compiles)."""
        group = self.process_group()
        return dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                              timeout=datetime.timedelta(seconds=self.timeout_s),
                              use_local_synchronization=True)

    def rank_failed(self, exc: BaseException, where: str) -> Exception:
        """The error for `exc`, raised by the backend in a collective of the compiled step
        (`where`): another rank failed inside the step, or stopped answering."""
        group = self.process_group()
        timeout = f"{type(self).__name__}(timeout_s={self.timeout_s:g})"
        return self.timeout_error(
            f"{self.parallelism}: rank {self.rank} of {self.world_size} failed in a collective of the step "
            f"({where}) over the step's own group of global ranks {dist.get_process_group_ranks(group)} "
            f"(those of process group {group.group_name!r}, timing out after {timeout}): another rank raised "
            f"or died inside the step, or did not reach this collective in time ({describe(exc)}). Look at "
            "the other ranks' errors first. The group cannot be used again in this process: end every rank "
            "and restart the job from the last checkpoint (torchrun restarts the ranks with --max-restarts); "
            "raise timeout_s if a rank is merely slow.")
