"""What the torchrun examples share: joining the job (process group, this rank's device)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def join_job(device_kind: str) -> tuple[int, int, torch.device]:
    """Join the torchrun job (NCCL on GPUs, gloo on the CPU): (rank, world size, this rank's device)."""
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120))
    device = torch.device(device_kind, int(os.environ.get("LOCAL_RANK", 0))) if device_kind == "cuda" else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device
