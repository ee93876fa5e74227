"""The process-group side shared by the parallelism configs (`SequenceParallel`, `ZeRO`).

Each names its group the same way (None: the world group) and is asked the same questions by
its pass and by the compiled step (the group's name for functional collectives, this rank, the
group's size), so they resolve it in one place.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch.distributed as dist

from graphoffload.errors import UnsupportedError


class OverGroup:
    """Mixin of a frozen config dataclass with a `group` field (a process group or None)."""

    group: Any
    parallelism: ClassVar[str] = "this parallelism"   # how errors name it

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
