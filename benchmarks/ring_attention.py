"""Ring attention benchmark.

GPU (one device, ``--gpu``): the compute efficiency of an N-way ring. For each sequence length
S and ring size N it times, for one rank of a causal zigzag ring, the per-block SDPA calls and
log-sum-exp merges that rank runs (forward, and forward + backward), and one full flash
attention over the whole sequence. Every rank of a zigzag ring does the same work, so
efficiency = t(full attention) / (N x t(one rank's blocks)); 1.0 means splitting the sequence
costs no compute. Communication is not included (one device).

CPU (``--cpu``, default): ring attention in N spawned gloo processes (N = 1, 2, 4) against one
process running full attention, forward and forward + backward, with the number of ring
exchanges per call. Tiny machines: read the ratios, not the absolute times.

    python benchmarks/ring_attention.py --cpu [--smoke]
    python benchmarks/ring_attention.py --gpu --seqs 8192 16384 32768 65536 131072 --worlds 2 4 8
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, median, print_table, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------- GPU: compute efficiency

def _rank_work(q, k, v, dout, world: int, rank: int, backward: bool):
    """The attention work one rank of a causal zigzag ring does, on local shards (no comms)."""
    from graphoffload.runtime import ring_attention as ra

    q_len = q.shape[-2]
    out0, lse0 = ra._block_forward(q, k, v, True, None)
    out_acc, lse_acc = out0.float(), lse0.float().contiguous()
    for s in range(1, world):
        plan = ra.block_plan("zigzag", True, rank, (rank - s) % world, q_len, k.shape[-2])
        if plan is None:
            continue
        qs, ks, causal = plan
        out_b, lse_b = ra._block_forward(q[..., qs, :], k[..., ks, :], v[..., ks, :], causal, None)
        ra._merge(out_acc[..., qs, :], lse_acc[..., qs], out_b, lse_b)
    if not backward:
        return out_acc
    out = out_acc.to(q.dtype)
    dq, dk, dv = ra._block_backward(dout, q, k, v, out, lse_acc, True, None)
    for s in range(1, world):
        plan = ra.block_plan("zigzag", True, rank, (rank - s) % world, q_len, k.shape[-2])
        if plan is None:
            continue
        qs, ks, causal = plan
        ra._block_backward(dout[..., qs, :], q[..., qs, :], k[..., ks, :], v[..., ks, :], out[..., qs, :],
                           lse_acc[..., qs], causal, None)
    return dq


def _cuda_time(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def gpu_rows(args) -> list[dict]:
    from graphoffload.ops.attention import _backward, _forward

    dev = torch.device("cuda")
    rows = []
    for seq in args.seqs:
        g = torch.Generator(device=dev).manual_seed(0)
        shape = (args.batch, args.heads, seq, args.head_dim)
        q, k, v, dout = (torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))

        def full_fwd():
            return _forward(q, k, v, None, True, None)

        def full_fwd_bwd():
            out, lse = _forward(q, k, v, None, True, None)
            return _backward(dout, q, k, v, out, lse, None, True, None)

        t_full = {"fwd": _cuda_time(full_fwd, args.warmup, args.iters),
                  "fwd+bwd": _cuda_time(full_fwd_bwd, args.warmup, args.iters)}
        for world in args.worlds:
            if seq % (2 * world):
                continue
            from graphoffload.runtime.ring_attention import shard

            local = [shard(t, 2, "zigzag", 0, world).contiguous() for t in (q, k, v, dout)]
            for mode in ("fwd", "fwd+bwd"):
                t_rank = _cuda_time(lambda: _rank_work(*local, world, 0, mode == "fwd+bwd"), args.warmup, args.iters)
                rows.append({"seq": seq, "world": world, "mode": mode, "full_ms": t_full[mode] * 1e3,
                             "rank_ms": t_rank * 1e3, "efficiency": t_full[mode] / (world * t_rank)})
            del local
        del q, k, v, dout
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- CPU: gloo ranks

def _cpu_worker(rank: int, world: int, store: str, cfg: dict, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from graphoffload.runtime import ring_attention as ra

    g = torch.Generator().manual_seed(0)
    shape = (cfg["batch"], cfg["heads"], cfg["seq"], cfg["head_dim"])
    q, k, v, dout = (ra.shard(torch.randn(shape, generator=g), 2, "zigzag", rank, world) for _ in range(4))
    group = dist.group.WORLD.group_name
    calls = []
    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: calls.append(1) or real(ops)

    def fwd():
        return torch.ops.graphoffload.ring_attention(q, k, v, True, None, "zigzag", group, 120.0)

    def fwd_bwd():
        out, lse = fwd()
        return torch.ops.graphoffload.ring_attention_backward(dout, q, k, v, out, lse, True, None, "zigzag",
                                                              group, 120.0)

    result = {}
    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        for _ in range(cfg["warmup"]):
            fn()
        times = []
        for _ in range(cfg["iters"]):
            dist.barrier()
            calls.clear()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times.append(time.perf_counter() - start)
        result[name] = (median(times), len(calls))
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def cpu_rows(args) -> list[dict]:
    import torch.multiprocessing as mp

    from graphoffload.ops.attention import _backward, _forward

    cfg = {"batch": args.batch, "heads": args.heads, "seq": args.seq, "head_dim": args.head_dim,
           "warmup": args.warmup, "iters": args.iters, "threads": 1}
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=g) for _ in range(4))
    full = {}
    for name in ("fwd", "fwd+bwd"):
        def run():
            out, lse = _forward(q, k, v, None, True, None)
            if name == "fwd+bwd":
                _backward(dout, q, k, v, out, lse, None, True, None)
        for _ in range(args.warmup):
            run()
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        full[name] = median(times)
    rows = []
    for world in args.worlds:
        # one rank's attention work alone (no communication), as on the GPU: compute efficiency
        from graphoffload.runtime.ring_attention import shard

        local = [shard(t, 2, "zigzag", 0, world).contiguous() for t in (q, k, v, dout)]
        alone = {}
        for name in ("fwd", "fwd+bwd"):
            for _ in range(args.warmup):
                _rank_work(*local, world, 0, name == "fwd+bwd")
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                _rank_work(*local, world, 0, name == "fwd+bwd")
                times.append(time.perf_counter() - start)
            alone[name] = median(times)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.pt")
            mp.start_processes(_cpu_worker, args=(world, os.path.join(tmp, "store"), cfg, out), nprocs=world,
                               start_method="spawn")
            result = torch.load(out)
        for name in ("fwd", "fwd+bwd"):
            t, calls = result[name]
            rows.append({"seq": args.seq, "world": world, "mode": name, "full_1proc_ms": full[name] * 1e3,
                         "rank_compute_ms": alone[name] * 1e3,
                         "compute_efficiency": full[name] / (world * alone[name]),
                         "ring_ms": t * 1e3, "speedup": full[name] / t, "exchanges": calls,
                         # forward N-1 key/value exchanges; backward N-1 more plus N gradient ones
                         "expected_exchanges": 0 if world == 1 else (world - 1 if name == "fwd" else 3 * world - 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="single-GPU compute efficiency")
    ap.add_argument("--cpu", action="store_true", help="gloo ranks on CPU (default)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--seq", type=int, default=4096, help="CPU sequence length")
    ap.add_argument("--worlds", type=int, nargs="+", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device")
        args.worlds = args.worlds or [2, 4, 8]
        args.heads, args.head_dim = args.heads or 16, args.head_dim or 128
        rows = gpu_rows(args)
        print_table(rows, ["seq", "world", "mode", "full_ms", "rank_ms", "efficiency"])
        device = device_name(torch.device("cuda"))
        out = args.out or os.path.join(HERE, "results", "ring_attention_gpu.json")
    else:
        args.worlds = args.worlds or [1, 2, 4]
        args.heads, args.head_dim = args.heads or 4, args.head_dim or 64
        if args.smoke:
            args.seq, args.worlds, args.warmup, args.iters = 256, [1, 2], 1, 2
        rows = cpu_rows(args)
        print_table(rows, ["seq", "world", "mode", "full_1proc_ms", "rank_compute_ms", "compute_efficiency",
                           "ring_ms", "speedup", "exchanges", "expected_exchanges"])
        device = f"CPU ({os.cpu_count()} cores), gloo, 1 thread per rank"
        out = args.out or os.path.join(HERE, "results", "ring_attention_cpu.json")
    write_json(out, {"device": device, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
