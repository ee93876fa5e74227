"""Run a function in N spawned CPU processes joined by a gloo process group (sequence-parallel
tests). The store is a file in a temporary directory; every collective has a timeout and the
whole run a deadline, so a dead or stuck rank fails the test instead of hanging it."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world: int, store: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a rank that crashes in native code (gloo has, rarely) prints every thread's Python stack
    # to the test's stderr instead of only an exit signal
    faulthandler.enable(all_threads=True)
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
        gc.collect()   # compiled steps in reference cycles go now, not at interpreter exit
        # no rank tears its process group down while a peer may still have sends in flight
        # (a gloo pair destroyed under a pending operation aborts the process)
        # (a peer that already failed or left on purpose is not this rank's error)
        try:
            dist.barrier()
        except RuntimeError:
            pass
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, deadline_s: float = 120.0) -> None:
    """Run `fn(rank, world, *args)` on `world` spawned ranks; re-raise the first failure."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(fn, world, os.path.join(tmp, "store"), args), nprocs=world,
                                 join=False, start_method="spawn")
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, end - time.monotonic()))):
                if time.monotonic() > end:
                    raise TimeoutError(f"ranks did not finish within {deadline_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()


def silent_rank(rank: int, world: int, call, error: type[Exception], match: str) -> None:
    """Rank 1 never calls the step: on rank 0 `call()` must raise `error` (matching `match`)
    from the check every parallel step makes first; once it has, rank 1 answers that check
    (two int64 per rank: shapes digest, batch digest), so the group is torn down cleanly."""
    gave_up = torch.zeros(1)
    if rank == 1:
        dist.recv(gave_up, 0, tag=7)
        dist.all_gather([torch.empty(2, dtype=torch.int64) for _ in range(world)], torch.zeros(2, dtype=torch.int64))
        return
    with pytest.raises(error, match=match):
        call()
    dist.send(gave_up, 1, tag=7)
