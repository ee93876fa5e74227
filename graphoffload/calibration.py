"""Calibration: how fast this machine moves and updates optimizer state, measured once and cached.

The offload planner predicts a step's timeline from these rates: pinned copy bandwidth each
way and both ways at once, the fused CPU optimizer's rate alone and while copies run (they
share the host's memory bandwidth), the device optimizer's rate, and the device's matmul and
memory throughput for nodes that were not profiled. `Calibration.load_or_measure(device)`
measures on first use and caches a JSON file per machine and device under the user's cache
directory (`$XDG_CACHE_HOME/graphoffload`, else `~/.cache/graphoffload`); `remeasure=True`
measures again. Tests build synthetic calibrations directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import threading
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Calibration:
    """Measured rates (bytes/s, parameters/s, FLOP/s)."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float          # both directions at once, together
    cpu_update_params_per_s: float
    cpu_update_params_per_s_under_copy: float
    device_update_params_per_s: float
    device_flops: float
    device_bytes_per_s: float
    device: str = "cpu"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def cache_path(device: torch.device) -> str:
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        name = device.type if device.type == "cpu" else torch.cuda.get_device_name(device).replace(" ", "_")
        host = f"{platform.node()}-{os.cpu_count()}cpu"
        return os.path.join(root, "graphoffload", f"calibration-{host}-{name}.json")

    @classmethod
    def load_or_measure(cls, device: torch.device | str, remeasure: bool = False) -> Calibration:
        device = torch.device(device)
        path = cls.cache_path(device)
        if not remeasure and os.path.exists(path):
            with open(path) as f:
                return cls(**json.load(f))
        calibration = measure(device)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(calibration.to_json(), f, indent=2)
        return calibration


def _best_time(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _adamw_rate(device: torch.device, numel: int) -> float:
    p, g, m, v = (torch.rand(numel, device=device) for _ in range(4))
    step = torch.zeros((), device=device)

    def run():
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        _sync(device)
    return numel / _best_time(run)


def measure(device: torch.device, numel: int = 1 << 24) -> Calibration:
    """Measure this machine (a few seconds; smaller buffers on a CPU-only machine)."""
    cuda = device.type == "cuda"
    if not cuda:
        numel = 1 << 22
    pin = cuda
    host = torch.empty(numel, pin_memory=pin)
    dev = torch.empty(numel, device=device)
    nbytes = numel * 4

    def h2d():
        dev.copy_(host, non_blocking=True)
        _sync(device)

    def d2h():
        host.copy_(dev, non_blocking=True)
        _sync(device)

    h2d_rate, d2h_rate = nbytes / _best_time(h2d), nbytes / _best_time(d2h)
    if cuda:
        host2, dev2 = torch.empty(numel, pin_memory=True), torch.empty(numel, device=device)
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def duplex():
            with torch.cuda.stream(s1):
                dev.copy_(host, non_blocking=True)
            with torch.cuda.stream(s2):
                host2.copy_(dev2, non_blocking=True)
            _sync(device)
        duplex_rate = 2 * nbytes / _best_time(duplex)
    else:
        duplex_rate = min(h2d_rate, d2h_rate)   # one memory system: copies share it

    cpu_numel = numel // 4
    cpu_rate = _adamw_rate(torch.device("cpu"), cpu_numel)
    stop = threading.Event()
    # the copy thread waits on a blocking event, as the runtime's copies do: a spinning
    # synchronize would take a core from the CPU update measured beside it
    copied = torch.cuda.Event(blocking=True) if cuda else None

    def copy_load():
        while not stop.is_set():
            dev.copy_(host, non_blocking=True)
            if copied is not None:
                copied.record(torch.cuda.current_stream(device))
                copied.synchronize()
    loader = threading.Thread(target=copy_load, daemon=True)
    loader.start()
    try:
        cpu_under_copy = _adamw_rate(torch.device("cpu"), cpu_numel)
    finally:
        stop.set()
        loader.join()
    device_rate = _adamw_rate(device, numel) if cuda else cpu_rate
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    # on a GPU one such matmul, or one pass over the buffer, takes tens of microseconds, about
    # what the synchronisation after it costs: time a run of them
    reps = 10 if cuda else 1
    flops = reps * 2 * 2048**3 / _best_time(lambda: ([a @ a for _ in range(reps)], _sync(device)))
    device_bytes = reps * 2 * nbytes / _best_time(lambda: ([dev.mul_(1.0) for _ in range(reps)], _sync(device)))
    return Calibration(h2d_rate, d2h_rate, duplex_rate, cpu_rate, min(cpu_under_copy, cpu_rate), device_rate,
                       flops, device_bytes, device=str(device))
