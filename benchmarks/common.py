"""Shared pieces of the benchmark scripts: timing, tables, JSON results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from gpt import GPT, GPTConfig  # noqa: E402


def build_gpt(args: Any, device: torch.device) -> tuple[GPT, GPTConfig]:
    """The benchmark GPT from the common command-line sizes (--layers, --d-model, ...)."""
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    torch.manual_seed(0)
    return GPT(cfg).to(device), cfg


def autocast_train_step(model, optimizer, batch, max_norm: float | None = None):
    """The step every benchmark times: bf16 autocast on a GPU, plain fp32 on a CPU; with
    `max_norm`, gradients clipped by global norm."""
    on_gpu = batch.device.type == "cuda"
    with torch.autocast("cuda" if on_gpu else "cpu", dtype=torch.bfloat16, enabled=on_gpu):
        loss = model(batch, labels=batch)
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(run: Callable[[], Any], device: torch.device, warmup: int, steps: int) -> list[float]:
    """Wall time of each of `steps` calls of `run` after `warmup` calls, in seconds."""
    for _ in range(warmup):
        run()
    synchronize(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def time_interleaved(runs: dict[str, Callable[[], Any]], device: torch.device, warmup: int,
                     steps: int) -> dict[str, list[float]]:
    """Like `time_steps` for several variants, alternating between them every step so that
    drift in the machine's speed (other processes, clocks) hits all of them alike."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, run in runs.items():
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "-" if x is None else str(x)


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
