"""Train a GPT on long sequences split across ranks with ring attention (sequence parallelism).

    torchrun --nproc-per-node 4 examples/train_long_context.py                  # CPU (gloo)
    torchrun --nproc-per-node 4 examples/train_long_context.py --device cuda    # one GPU per rank (NCCL)

Each rank keeps 1/N of every sequence from the token embedding on; attention passes key/value
blocks around the ring; the model code is the plain GPT of examples/gpt.py. Every rank gets the
whole batch here (`batch="full"`); with ``--sharded-batch`` each rank passes only its part,
``sp.shard(batch)``, and the compiled step gathers the token ids back to full length.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_job import join_job  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import graphoffload  # noqa: E402


def train_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    ap.add_argument("--sharded-batch", action="store_true", help="each rank passes only its part of the batch")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()

    rank, world, device = join_job(args.device)

    torch.manual_seed(0)   # same initial weights on every rank
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    model = GPT(cfg).to(device=device, dtype=getattr(torch, args.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    sp = graphoffload.SequenceParallel(layout=args.layout, batch="sharded" if args.sharded_batch else "full")
    step = graphoffload.offload_compile(train_step, sequence_parallel=sp)

    data = torch.Generator().manual_seed(1)   # same batches on every rank
    for i in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=data).to(device)
        batch = {"input_ids": x, "labels": torch.roll(x, -1, dims=1)}
        if args.sharded_batch:
            batch = sp.shard(batch)
        start = time.perf_counter()
        loss = step(model, optimizer, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if rank == 0:
            print(f"step {i}: loss {loss.item():.4f}  {1e3 * (time.perf_counter() - start):.1f} ms "
                  f"({args.seq_len // world} of {args.seq_len} tokens per rank, {world} ranks)")
    if rank == 0:
        step.explain()
    # no rank tears the group down while another may still have ring sends in flight: gloo
    # aborts a process whose connection closes under a pending operation
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
