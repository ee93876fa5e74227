"""Run a function in N fresh CPU processes joined by a gloo process group (the multi-rank
tests). The store is a file in a temporary directory; every collective has a timeout and the
whole run a deadline, so a dead or stuck rank fails the test instead of hanging it.

The ranks are forked from a forkserver that imported torch, torch.distributed.tensor and
graphoffload once per test session: a spawned rank spent 2 to 6 s of a 2-core machine importing
them, in every rank of every multi-rank test. Each rank is still a fresh process (nothing a test
does in one is seen by the next), started with the test's environment, not the forkserver's."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# imported once in the forkserver; every rank is forked from it with these already loaded (the
# Hugging Face models some ranks train too; a module that is not installed is skipped)
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "graphoffload",
            "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"]


def start_method() -> str:
    """How the tests start fresh processes: "forkserver" (torch and graphoffload preloaded), or
    "spawn" where there is none. Also for a test's own pool (`multiprocessing.get_context`)."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.set_forkserver_preload(_PRELOAD)   # takes effect when the server starts (the first use)
    return "forkserver"


def _entry(rank: int, fn, world: int, store: str, args: tuple, environ: dict, log: str) -> None:
    # a forked rank has the forkserver's environment and output (as they were when the server
    # started, in some earlier test): give it the test's environment, as a spawned one would have
    # (tests set XDG_CACHE_HOME, GRAPHOFFLOAD_SANITIZE, ...), and a file for its output, which
    # run_ranks shows in the test's own output
    os.environ.clear()
    os.environ.update(environ)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a rank that crashes in native code (gloo has, rarely) prints every thread's Python stack
    # to its output (shown in the test's) instead of only an exit signal
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
    """Run `fn(rank, world, *args)` on `world` fresh ranks; re-raise the first failure."""
    method = start_method()
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "ranks.log")
        ctx = mp.start_processes(_entry, args=(fn, world, os.path.join(tmp, "store"), args, dict(os.environ), log),
                                 nprocs=world, join=False, start_method=method)
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, end - time.monotonic()))):
                if time.monotonic() > end:
                    raise TimeoutError(f"ranks did not finish within {deadline_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            if os.path.exists(log):   # what the ranks printed (a native crash's stacks too)
                with open(log, errors="replace") as f:
                    sys.stdout.write(f.read())


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
