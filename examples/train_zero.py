"""Train a GPT data-parallel with ZeRO stage 1, 2 or 3: each rank its own micro-batch, the
optimizer state (with stage 2 the gradients too, with stage 3 the parameters as well) sharded over
the ranks.

    torchrun --nproc-per-node 2 examples/train_zero.py                        # CPU (gloo)
    torchrun --nproc-per-node 4 examples/train_zero.py --device cuda --stage 1 # one GPU per rank (NCCL)
    torchrun --nproc-per-node 2 examples/train_zero.py --offload              # ZeRO-Offload
    torchrun --nproc-per-node 2 examples/train_zero.py --stage 3              # parameters sharded too
    torchrun --nproc-per-node 2 examples/train_zero.py --stage 3 --offload    # ... and ZeRO-Offload
    torchrun --nproc-per-node 2 examples/train_zero.py --accumulation-steps 4 # one update per 4 calls
    torchrun --nproc-per-node 4 examples/train_zero.py --sp 2                 # 2 x 2 mesh: ZeRO x ring

The model code is the plain GPT of examples/gpt.py and the step an ordinary train step; the
`zero` pass averages the gradients over the ranks, has each rank update only its dim-0 chunk of
every parameter (keeping optimizer state for that chunk alone, as Shard(0) DTensors) and
all-gathers the updated chunks, so every rank ends each step with the same model (stage 3: the
model's parameters stay Shard(0) DTensors of each rank's rows, gathered inside the step before
forward and backward read them). With --offload (any stage) each rank keeps its chunks' fp32
master weights and optimizer state in host memory (ZeRO-Offload; stage 3: the host update's
result is uploaded into the rank's rows of the parameters). With --accumulation-steps k each
call is one micro-batch and every k-th call updates, the gradients reduced once per update (not
with --offload yet). Each rank prints the share of the optimizer state and of the parameters it
holds at the end.

With --sp S the ranks form a 2-D device mesh ("dp", "sp") of world/S x S: the S ranks of an sp
group pass the same micro-batch and split its sequence (ring attention), ZeRO shards over the dp
dimension, and the gradients are reduced over both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed_job import join_job  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import graphoffload  # noqa: E402
from train_long_context import train_step  # noqa: E402  (the ordinary step)


def local_bytes(tensors) -> int:
    # a DTensor's numel() is the whole tensor's: count the chunk this rank holds
    return sum(local.numel() * local.element_size() for t in tensors
               for local in [t.to_local() if isinstance(t, DTensor) else t])


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    # a DTensor's numel() is the whole tensor's: count the chunk this rank holds
    return sum(local.numel() * local.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) for local in [t.to_local() if isinstance(t, DTensor) else t])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--bucket-numel", type=int, default=None,
                    help="ZeRO(bucket_numel=...); for stage 3 about one layer's parameters")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4, help="rows per rank and step")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--offload", action="store_true", help="master weights and state in host memory (any stage)")
    ap.add_argument("--sp", type=int, default=1,
                    help="sequence-parallel ranks per micro-batch: a (world/sp, sp) mesh, ZeRO over its dp dimension")
    ap.add_argument("--accumulation-steps", type=int, default=1,
                    help="micro-batches per update (gradients reduced once per update)")
    ap.add_argument("--accumulate-on", default="device", choices=["device", "host", "auto"],
                    help="with --offload and --accumulation-steps: running sums on the device, as this rank's "
                         "chunks on the host (a reduce-scatter per call), or 'auto' (host when device sums' "
                         "predicted peak exceeds --gpu-memory-budget)")
    ap.add_argument("--gpu-memory-budget", default=None, help="with --offload: Offload(gpu_memory_budget=...)")
    args = ap.parse_args()

    rank, world, device = join_job(args.device)

    torch.manual_seed(0)   # same initial weights on every rank
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dp_rank, sp = rank, None
    if args.sp > 1:   # a 2-D mesh: ZeRO over "dp", the sequence split over "sp"
        from torch.distributed.device_mesh import init_device_mesh

        if world % args.sp:
            raise SystemExit(f"--sp {args.sp} does not divide the {world} ranks")
        mesh = init_device_mesh(device.type, (world // args.sp, args.sp), mesh_dim_names=("dp", "sp"))
        dp_rank = mesh["dp"].get_local_rank()
        sp = graphoffload.SequenceParallel(group=mesh["sp"])
    group = mesh["dp"] if sp is not None else None
    zero = graphoffload.ZeRO(stage=args.stage, group=group) if args.bucket_numel is None else \
        graphoffload.ZeRO(stage=args.stage, group=group, bucket_numel=args.bucket_numel)
    step = graphoffload.offload_compile(train_step, data_parallel=zero, accumulation_steps=args.accumulation_steps,
                                        offload=graphoffload.Offload(accumulate_on=args.accumulate_on,
                                                                     gpu_memory_budget=args.gpu_memory_budget)
                                        if args.offload else None,
                                        sequence_parallel=sp)
    whole_params = sum(p.numel() * p.element_size() for p in model.parameters())

    data = torch.Generator().manual_seed(1 + dp_rank)   # each dp rank its own micro-batches (shared over sp)
    for i in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len), generator=data).to(device)
        start = time.perf_counter()
        loss = step(model, optimizer, {"input_ids": x, "labels": torch.roll(x, -1, dims=1)})
        if device.type == "cuda":
            torch.cuda.synchronize()
        if rank == 0:
            print(f"step {i}: loss {loss.item():.4f} (rank 0's micro-batch)  "
                  f"{1e3 * (time.perf_counter() - start):.1f} ms, {world} ranks, ZeRO stage {args.stage}"
                  + (f" x sequence parallel over {args.sp}" if sp is not None else "")
                  + (" + offload" if args.offload else "")
                  + (("  (updated)" if step.micro_step == 0 else "  (accumulated)") if args.accumulation_steps > 1
                     else ""))
    # AdamW's moments and step counters (and with --offload the fp32 master weights)
    full = (2 * sum(p.numel() * p.element_size() for p in model.parameters()) + 4 * len(list(model.parameters()))
            + (4 * sum(p.numel() for p in model.parameters()) if args.offload else 0))
    print(f"rank {rank}: optimizer state {state_bytes(optimizer):,} bytes of {full:,} "
          f"({state_bytes(optimizer) / full:.2f}), {len(optimizer.state)} parameters; parameters "
          f"{local_bytes(model.parameters()):,} bytes of {whole_params:,} "
          f"({local_bytes(model.parameters()) / whole_params:.2f})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
