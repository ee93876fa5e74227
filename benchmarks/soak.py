"""Soak: run a compiled, offloaded step for many steps and check that the process does not grow.

    python benchmarks/soak.py                 # 2,000 steps per mode
    python benchmarks/soak.py --smoke         # 60 steps per mode (seconds)

Modes: `offload` (every bucket updated on the CPU path), `hand-over` (the same with
`Offload(overlap_next_step=True)`: the last uploads land during the next call) and
`hand-over+shapes` (the same, cycling through four sequence lengths, so each call switches
between four traced variants). Every `--interval` steps the script samples the process's
resident set size, its OS threads (/proc/self/task: torch's intra-op threads included), its
live Python threads, its graphoffload worker threads and its open file descriptors. After
`--warmup` steps every figure must stay flat: threads and files exactly, RSS within
`--rss-slack-mib` (the allocator keeps freed blocks; a leak of a tensor per step grows
without bound, e.g. 2,000 steps x the tiny model's 0.2 MiB of parameters). A row per mode
is printed, the samples go to the JSON file, and the exit status is 1 when a mode is not flat.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import print_table, write_json  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import graphoffload  # noqa: E402


def train_step(model, optimizer, batch):
    loss = model(batch, labels=batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def sample(step_index: int) -> dict:
    gc.collect()
    return {"step": step_index, "rss_MiB": round(rss_mib(), 2),
            "os_threads": len(os.listdir("/proc/self/task")),
            "py_threads": threading.active_count(),
            "workers": sum(t.name.startswith("graphoffload-host") for t in threading.enumerate()),
            "open_files": len(os.listdir("/proc/self/fd"))}


def soak(mode: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=2, d_model=args.d_model)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    step = graphoffload.offload_compile(train_step, offload=graphoffload.Offload(
        device_updates="never", overlap_next_step=mode != "offload"))
    lengths = [args.seq, args.seq * 3 // 4, args.seq // 2, args.seq // 4] if mode == "hand-over+shapes" else [args.seq]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, n), generator=g) for n in lengths]
    samples = []
    start = time.perf_counter()
    loss = None
    for i in range(args.steps):
        loss = step(model, opt, batches[i % len(batches)])
        if (i + 1) % args.interval == 0 or i == 0:
            samples.append(sample(i + 1))
    step.synchronize()
    seconds = time.perf_counter() - start
    after = [s for s in samples if s["step"] >= args.warmup]
    first, last = after[0], after[-1]
    rss_growth = max(s["rss_MiB"] for s in after) - first["rss_MiB"]
    flat = (rss_growth <= args.rss_slack_mib
            and all(s[k] == first[k] for s in after for k in ("os_threads", "py_threads", "workers", "open_files")))
    row = {"mode": mode, "steps": args.steps, "traces": step.trace_count, "s_per_step": seconds / args.steps,
           "final_loss": float(loss), "rss_at_warmup_MiB": first["rss_MiB"], "rss_end_MiB": last["rss_MiB"],
           "rss_growth_MiB": round(rss_growth, 2), "os_threads": f"{first['os_threads']}->{last['os_threads']}",
           "workers": f"{first['workers']}->{last['workers']}",
           "open_files": f"{first['open_files']}->{last['open_files']}", "flat": flat}
    del step
    gc.collect()
    return {"row": row, "samples": samples}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--interval", type=int, default=100)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rss-slack-mib", type=float, default=8.0)
    p.add_argument("--modes", default="offload,hand-over,hand-over+shapes")
    p.add_argument("--smoke", action="store_true", help="60 steps per mode, samples every 10")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "soak_cpu.json"))
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.interval = 60, 20, 10
    results = [soak(mode, args) for mode in args.modes.split(",")]
    rows = [r["row"] for r in results]
    print_table(rows, ["mode", "steps", "traces", "s_per_step", "rss_at_warmup_MiB", "rss_end_MiB",
                       "rss_growth_MiB", "os_threads", "workers", "open_files", "flat"])
    settings = {k: v for k, v in vars(args).items() if k != "out"}   # no local paths in the results
    write_json(args.out, {"device": "cpu", "threads": torch.get_num_threads(), "args": settings, "rows": rows,
                          "samples": {r["row"]["mode"]: r["samples"] for r in results}})
    return 0 if all(r["flat"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
