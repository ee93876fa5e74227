"""Calibration: how fast this machine moves and updates optimizer state, measured once and cached.

The offload planner predicts a step's timeline from these rates: pinned copy bandwidth each
way and both ways at once, the fused CPU optimizer's rate alone and while copies run (they
share the host's memory bandwidth), the device optimizer's rate, and the device's matmul and
memory throughput for nodes that were not profiled. `Calibration.load_or_measure(device)`
measures on first use and caches a JSON file per machine and device under the user's cache
directory (`$XDG_CACHE_HOME/graphoffload`, else `~/.cache/graphoffload`); `remeasure=True`
measures again. Tests build synthetic calibrations directly.

The CPU update is measured as the runtime runs it: on a thread of its own with the intra-op
threads `Offload.cpu_threads` gives it (by default all cores but two, left to the graph thread
and the communication libraries), over a working set larger than the last-level cache (256 MiB
of parameters, gradients and moments), alone and beside a thread that keeps copying. Under
torchrun, one process per node measures while the others wait (local rank 0, then a barrier of
the default process group), and the cache file is written atomically (a temporary file, then
`os.replace`), so ranks never read a half-written file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import tempfile
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed


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
    cpu_update_threads: int | None = None   # the intra-op threads the CPU update was measured with
    # what one rank sends per second in a collective (ZeRO's, ring attention's); None: not
    # measured (`measure` needs no process group), and the planner charges collectives at the
    # device-to-host link's rate (`link_bytes_per_s`)
    collective_bytes_per_s: float | None = None

    @property
    def link_bytes_per_s(self) -> float:
        """The rate the planner charges a collective's bytes at."""
        return self.collective_bytes_per_s or self.d2h_bytes_per_s

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def cache_path(device: torch.device, threads: int | None = None) -> str:
        name = device.type if device.type == "cpu" else torch.cuda.get_device_name(device).replace(" ", "_")
        host = f"{platform.node()}-{os.cpu_count()}cpu"
        threads = host_update_threads(threads)
        return os.path.join(cache_dir(), f"calibration-{host}-{name}-{threads}threads.json")

    @classmethod
    def load_or_measure(cls, device: torch.device | str, remeasure: bool = False,
                        threads: int | None = None) -> Calibration:
        """The cached calibration of this machine, device and CPU-update thread count (see
        `host_update_threads`), measured first if there is none. Under torch.distributed, the
        local rank 0 of each node measures while the node's other ranks wait at a barrier."""
        device = torch.device(device)
        path = cls.cache_path(device, threads)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # every rank passes the barrier once, whether or not the file was there: a rank that
            # skipped it because it saw the file a moment later than another would hang the rest
            if _local_rank() == 0 and (remeasure or not os.path.exists(path)):
                write_atomically(path, json.dumps(measure(device, threads=threads).to_json(), indent=2))
            torch.distributed.barrier()
            return cls._load(path)
        if not remeasure and os.path.exists(path):
            return cls._load(path)
        calibration = measure(device, threads=threads)
        write_atomically(path, json.dumps(calibration.to_json(), indent=2))
        return calibration

    @classmethod
    def _load(cls, path: str) -> Calibration:
        with open(path) as f:
            return cls(**json.load(f))


def cache_dir() -> str:
    """Where graphoffload keeps what it measured or planned on this machine:
    `$XDG_CACHE_HOME/graphoffload`, else `~/.cache/graphoffload`."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "graphoffload")


def _local_rank() -> int:
    """This process's rank on its node: torchrun's LOCAL_RANK, else the global rank modulo the
    processes per node it sets (LOCAL_WORLD_SIZE), else the global rank."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    rank = torch.distributed.get_rank()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    return rank % per_node if per_node else rank


def write_atomically(path: str, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never part
    of it: into a temporary file beside it, flushed, then renamed over it (atomic on POSIX)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def host_update_threads(requested: int | None = None) -> int:
    """Intra-op threads of a host optimizer update: `requested`, or by default every core this
    process may run on but two (at least one), which stay free for the thread that launches the
    graph's kernels and for the communication libraries' own threads."""
    if requested is not None:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 2)


def use_intraop_threads(threads: int) -> None:
    """Give the calling thread `threads` intra-op threads. OpenMP keeps the count per thread, but
    torch also records it as the default for threads that have not run a parallel op yet: the
    thread that started this one restores its own count (`torch.set_num_threads`) once this one
    has called this, so nothing else changes."""
    torch.get_num_threads()   # torch's lazy per-thread initialisation first, or it would undo ours
    torch.set_num_threads(threads)


def _run_on_thread(threads: int, fn):
    """`fn()` on a new thread with `threads` intra-op threads, as the runtime's worker runs the
    host update; returns its result."""
    result: list = []
    errors: list[BaseException] = []

    def body():
        try:
            use_intraop_threads(threads)
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(exc)
    own = torch.get_num_threads()
    worker = threading.Thread(target=body, name="graphoffload-calibration")
    worker.start()
    worker.join()
    torch.set_num_threads(own)
    if errors:
        raise errors[0]
    return result[0]


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


def _adamw_rate(device: torch.device, numel: int, repeats: int = 3,
                tensors: tuple[torch.Tensor, ...] | None = None) -> float:
    p, g, m, v = tensors or tuple(torch.rand(numel, device=device) for _ in range(4))
    step = torch.zeros((), device=device)

    def run():
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        _sync(device)
    return numel / _best_time(run, repeats)


# the CPU update's working set: parameters, gradients and two moments in fp32, past any cache
CPU_UPDATE_WORKING_SET = 256 << 20


def measure(device: torch.device, numel: int = 1 << 24, threads: int | None = None) -> Calibration:
    """Measure this machine (a few seconds; smaller copy buffers on a CPU-only machine).
    `threads`: the CPU update's intra-op threads (`host_update_threads`)."""
    threads = host_update_threads(threads)
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

    cpu_numel = CPU_UPDATE_WORKING_SET // 16   # 4 fp32 tensors
    working_set = tuple(torch.full((cpu_numel,), 0.5) for _ in range(4))   # filled: pages touched

    def cpu_update_rate() -> float:
        return _run_on_thread(threads, lambda: _adamw_rate(torch.device("cpu"), cpu_numel, 1, working_set))
    cpu_rate = cpu_update_rate()
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
        cpu_under_copy = cpu_update_rate()
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
                       flops, device_bytes, device=str(device), cpu_update_threads=threads)
