"""The CPU update's threads (Offload.cpu_threads) in the runtime and the calibration, and the
calibration cache under concurrency: one measuring process per node, atomic writes."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_gpt, token_batches, train_step
from ring_dist import run_ranks, start_method

import graphoffload
from graphoffload import Offload
from graphoffload import calibration as calibration_module
from graphoffload.calibration import Calibration, host_update_threads, write_atomically
from graphoffload.runtime.host_offload import OffloadRuntime


def test_cpu_threads_default_leaves_two_cores_and_is_validated():
    cores = len(os.sched_getaffinity(0))
    assert host_update_threads() == max(1, cores - 2) and host_update_threads(3) == 3
    assert Offload().cpu_threads is None and Offload(cpu_threads=2).cpu_threads == 2
    with pytest.raises(ValueError, match="cpu_threads"):
        Offload(cpu_threads=0)


def test_host_update_workers_use_their_thread_count_and_leave_everyone_elses():
    own = torch.get_num_threads()
    target = 1 if own > 1 else 2
    runtime = OffloadRuntime(torch.device("cpu"), cpu_workers=2, cpu_threads=target)
    seen = {runtime.pool.submit(torch.get_num_threads).result() for _ in range(8)}
    assert seen == {target}
    assert torch.get_num_threads() == own
    later: list[int] = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [own]   # a thread started afterwards gets the process default, not the workers'
    runtime.pool.shutdown()


def test_a_step_with_one_update_thread_trains_like_eager():
    eager, compiled = tiny_gpt(), tiny_gpt()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(train_step, offload=Offload(device_updates="never", cpu_threads=1))
    for b in token_batches(2):
        assert torch.equal(train_step(eager, opt_e, b), step(compiled, opt_c, b))
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), compiled.parameters()))
    assert step.last.executor.offload_runtime.pool.submit(torch.get_num_threads).result() == 1


def test_calibration_measures_the_update_as_the_worker_runs_it_with_one_file_per_thread_count(tmp_path, monkeypatch):
    assert calibration_module.CPU_UPDATE_WORKING_SET >= 256 << 20   # past any last-level cache
    own = torch.get_num_threads()
    target = 1 if own > 1 else 2
    assert calibration_module._run_on_thread(target, torch.get_num_threads) == target
    assert torch.get_num_threads() == own
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert Calibration.cache_path(torch.device("cpu"), 1) != Calibration.cache_path(torch.device("cpu"), 2)
    assert Calibration.cache_path(torch.device("cpu")) == Calibration.cache_path(torch.device("cpu"), host_update_threads())


def _write_and_read(args) -> int:
    """One racer: write its own large JSON many times, read back after each write; returns how
    many reads did not parse as one whole document of some racer."""
    path, who, rounds = args
    torn = 0
    body = {"writer": who, "payload": [who] * 20000}
    for _ in range(rounds):
        write_atomically(path, json.dumps(body))
        try:
            with open(path) as f:
                data = json.load(f)
            torn += data["payload"] != [data["writer"]] * 20000
        except (json.JSONDecodeError, KeyError):
            torn += 1
    return torn


@pytest.mark.slow   # several processes
def test_racing_writers_never_leave_a_torn_cache_file(tmp_path):
    path = str(tmp_path / "cache" / "calibration.json")
    with multiprocessing.get_context(start_method()).Pool(4) as pool:
        torn = pool.map(_write_and_read, [(path, who, 40) for who in range(4)])
    assert torn == [0, 0, 0, 0]
    assert os.listdir(tmp_path / "cache") == ["calibration.json"]   # no temporary files left behind


def _one_node_of_ranks(rank: int, world: int, cache: str, log: str) -> None:
    os.environ["XDG_CACHE_HOME"] = cache
    os.environ["LOCAL_RANK"] = str(rank)
    base = Calibration(1e9, 1e9, 1.5e9, 1e9, 0.5e9, 1e10, 1e12, 1e11)

    def measure(device, threads=None):   # slow, and says who measured
        with open(log, "a") as f:
            f.write(f"{rank}\n")
        time.sleep(0.5)
        return Calibration(**{**base.to_json(), "cpu_update_params_per_s": 1000.0 + rank})
    calibration_module.measure = measure   # this spawned process's copy of the module only
    if rank == world - 1:
        time.sleep(0.3)   # a late rank may find the file already written: it must still pass the barrier
    got = Calibration.load_or_measure("cpu")
    assert got.cpu_update_params_per_s == 1000.0, got
    gathered = [None] * world
    dist.all_gather_object(gathered, got.cpu_update_params_per_s)
    assert gathered == [1000.0] * world


@pytest.mark.slow   # several processes
def test_under_torch_distributed_local_rank_zero_measures_and_the_others_wait(tmp_path):
    log = str(tmp_path / "measured")
    run_ranks(_one_node_of_ranks, 3, str(tmp_path / "cache"), log)
    assert open(log).read().split() == ["0"]
