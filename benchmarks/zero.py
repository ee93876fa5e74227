"""ZeRO benchmark: per-rank memory and step time of graphoffload's ZeRO stages 1, 2 and 3 (each
also with `offload=`, ZeRO-Offload: modes ``zero1_offload``, ``zero2_offload``, ``zero3_offload``) against
torch's DistributedDataParallel and FSDP2 (`fully_shard`), for N = 1, 2, 4 ranks.

Every (N, mode) pair runs in N freshly spawned processes (gloo on the CPU; NCCL with one GPU a
rank under ``--device cuda``), so each process's peak memory is that mode's alone. Each rank
trains the benchmark GPT on its own micro-batch of ``--batch`` sequences (weak scaling: the
global batch is N x --batch) with AdamW; step times are rank 0's, between barriers, median of
``--iters`` after ``--warmup`` (the first of which compiles graphoffload's step). The ``*_sp2``
modes run ZeRO over the "dp" dimension of an (N/2, 2) device mesh and ring attention over its "sp"
dimension: the two ranks of an sp pair split one micro-batch's sequence, so the global batch is
N/2 x --batch there (half the other modes'), and activations are half a rank's.

Columns: ``state_MiB`` the optimizer state one rank holds, measured from ``optimizer.state``
(its local shards for FSDP2), the largest over the ranks; ``state_share`` that over the whole
model's state (1/N is ideal; with offload the state includes the fp32 master weights, in host
memory, and so does the whole it is compared with); ``state_on`` the devices its tensors are on;
``params_MiB`` the parameters one rank holds between steps, measured from ``model.parameters()``
(a DTensor's local shard for FSDP2 and ZeRO stage 3), the largest over the ranks;
``predicted_peak_MiB`` graphoffload's own prediction of a step's peak (``step.memory().peak``:
the graph's inputs plus what the step allocates), rank 0's; ``peak_MiB`` the peak memory of a rank above what it held before
the model was built, during the timed steps (after warm-up, so a compile's transient memory is
not counted, what the compiled step keeps is), the largest over the ranks (CPU: the process's
peak resident set, VmHWM, which includes allocator slack and, for graphoffload, the modules its
first compile imports (sympy and torch's tracing: tens of MiB whatever the model); GPU:
``torch.cuda.max_memory_allocated``); ``step_peak_MiB`` that peak above what the rank held when the
timed steps began: what a step allocates and frees (gradients, activations, collective buffers).

    python benchmarks/zero.py                      # CPU, gloo, N = 1, 2, 4
    python benchmarks/zero.py --smoke              # tiny, N = 1, 2 (seconds)
    python benchmarks/zero.py --device cuda        # NCCL, one GPU a rank, N up to the GPUs present
    python benchmarks/zero.py --modes zero2_offload --worlds 2 --accumulation-steps 2 --accumulate-on host
    python benchmarks/zero.py --modes zero1_offload zero2_offload --worlds 2 --overlap-next-step

With ``--accumulation-steps k`` every call is one micro-batch (the update every k-th); the
``*_offload`` modes keep the running gradient sums where ``--accumulate-on`` says: ``device`` (each
rank's whole partial sums, reduced once per update) or ``host`` (each rank's fp32 chunks, every
micro-batch reduce-scattered first). ``step_ms`` is then the median over accumulating and updating
calls, and ``predicted_peak_MiB`` is the last timed call's variant's (device memory: host sums are
not counted); the results file is named after both options.

On a CPU the ranks share the machine's cores: with more ranks than cores they take turns, so
read the memory columns and the ratios between modes at the same N, not the scaling of time.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import autocast_train_step, build_gpt, device_name, median, print_table, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("zero1", "zero2", "zero3", "zero1_offload", "zero2_offload", "zero3_offload", "zero2_sp2", "zero3_sp2",
         "ddp", "fsdp2")
SP = 2   # the sp dimension of the *_sp2 modes' (N/2, 2) mesh
COLUMNS = ["world", "mode", "step_ms", "state_MiB", "state_share", "state_on", "params_MiB", "predicted_peak_MiB",
           "peak_MiB", "step_peak_MiB", "status"]


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:   # resident set
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak(device: torch.device) -> None:
    """Forget the peak so far (the first call's compile): from here on, the steps' own."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:   # Linux: VmHWM := VmRSS
            f.write("5")


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim():
                local = t.to_local() if hasattr(t, "to_local") else t   # FSDP2: a DTensor's shard
                total += local.numel() * local.element_size()
    return total


def _param_bytes(model: torch.nn.Module) -> int:
    """The parameters this rank holds: a DTensor's local shard (FSDP2, ZeRO stage 3)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local)


def _prepare(mode: str, model: torch.nn.Module, world: int, device: torch.device, args: argparse.Namespace):
    """The step to time for `mode`, its optimizer, and the compiled step (None: eager)."""
    import graphoffload

    def make_opt(params):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    if mode.startswith("zero"):
        opt = make_opt(model.parameters())
        offload = graphoffload.Offload(accumulate_on=args.accumulate_on, overlap_next_step=args.overlap_next_step) \
            if mode.endswith("_offload") else None
        sp = dp_group = None
        if mode.endswith("_sp2"):   # ZeRO over "dp", ring attention over "sp" of a (N/2, 2) mesh
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (world // SP, SP), mesh_dim_names=("dp", "sp"))
            sp, dp_group = graphoffload.SequenceParallel(group=mesh["sp"]), mesh["dp"]
        zero = graphoffload.ZeRO(stage=int(mode[4]), group=dp_group)
        if args.bucket_numel:
            zero = graphoffload.ZeRO(stage=zero.stage, group=dp_group, bucket_numel=args.bucket_numel)
        step = graphoffload.offload_compile(autocast_train_step, offload=offload, data_parallel=zero,
                                            sequence_parallel=sp, accumulation_steps=args.accumulation_steps)
        return lambda batch: step(model, opt, batch), opt, step
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = make_opt(ddp.parameters())
        return lambda batch: autocast_train_step(ddp, opt, batch), opt, None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_opt(model.parameters())
    return lambda batch: autocast_train_step(model, opt, batch), opt, None


def _worker(rank: int, world: int, store: str, mode: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        result = _measure(rank, world, mode, args, device)
    except Exception as exc:  # noqa: BLE001 - a mode the installed torch cannot run is a row, not a crash
        result = {"status": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        traceback.print_exc()
    gc.collect()   # the model, DDP's reducer, the compiled step: gone before the group is torn down
    every: list = [None] * world
    dist.all_gather_object(every, result)
    if rank == 0:
        torch.save(every, out)
    dist.barrier()
    dist.destroy_process_group()


def _measure(rank: int, world: int, mode: str, args: argparse.Namespace, device: torch.device) -> dict:
    import torch.distributed as dist

    for module in ("graphoffload", "torch.distributed.fsdp", "torch.nn.parallel"):   # before the baseline
        importlib.import_module(module)
    before = _memory_bytes(device)
    model, cfg = build_gpt(args, device)
    full_state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())   # AdamW: exp_avg, exp_avg_sq
    if mode.endswith("_offload"):   # and the fp32 master weights
        full_state += sum(p.numel() * 4 for p in model.parameters())
    run, opt, step = _prepare(mode, model, world, device, args)
    # each rank its own micro-batch; the *_sp2 modes: each sp pair one, split along the sequence
    g = torch.Generator().manual_seed(1 + (rank // SP if mode.endswith("_sp2") else rank))
    batch = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g).to(device)
    times = []
    for i in range(args.warmup + args.iters):
        if i == args.warmup:
            _reset_peak(device)
            held = _memory_bytes(device)
        dist.barrier()
        start = time.perf_counter()
        run(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    locals_ = [t.to_local() if hasattr(t, "to_local") else t for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim()]
    where = sorted({t.device.type for t in locals_})   # offloaded: "cpu" under --device cuda too
    return {"status": "ok", "step_ms": median(times) * 1e3, "state": _state_bytes(opt), "full_state": full_state,
            "state_on": "+".join(where),
            "params": _param_bytes(model), "predicted_peak": step.memory().peak if step is not None else None,
            "peak": _peak_bytes(device) - before, "step_peak": _peak_bytes(device) - held}


def run_mode(world: int, mode: str, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    row: dict = {"world": world, "mode": mode}
    if mode.endswith("_sp2") and world % SP:
        row["status"] = f"skipped: a ({world}/{SP}, {SP}) mesh"
        return row
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.pt")
        try:
            mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), mode, args, out), nprocs=world,
                               start_method="spawn")
        except Exception as exc:  # noqa: BLE001 - a rank that died (e.g. aborted by its backend)
            if not os.path.exists(out):   # it died before every rank's results were gathered
                row["status"] = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"
                return row
            # every rank measured and the results were saved: a rank the backend aborted while
            # the group was torn down (gloo does, now and then) does not void the measurement
            row["teardown"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"
        every = torch.load(out)
    failed = [r["status"] for r in every if r["status"] != "ok"]
    if failed:
        row["status"] = failed[0]
        return row
    state = max(r["state"] for r in every)
    row.update(step_ms=every[0]["step_ms"], state_MiB=state / 2**20, state_share=state / every[0]["full_state"],
               state_on=every[0]["state_on"],
               state_MiB_each=[r["state"] / 2**20 for r in every],
               params_MiB=max(r["params"] for r in every) / 2**20,
               predicted_peak_MiB=None if every[0]["predicted_peak"] is None else every[0]["predicted_peak"] / 2**20,
               peak_MiB=max(r["peak"] for r in every) / 2**20,
               step_peak_MiB=max(r["step_peak"] for r in every) / 2**20, status="ok")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="default: 1 2 4 (--smoke: 1 2)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny model, N = 1, 2")
    p.add_argument("--bucket-numel", type=int, default=None,
                   help="ZeRO(bucket_numel=...): elements a gradient or (stage 3) parameter bucket holds; "
                        "default: ZeRO's")
    p.add_argument("--accumulation-steps", type=int, default=1,
                   help="graphoffload's modes: micro-batches per update (the eager baselines update every call)")
    p.add_argument("--accumulate-on", default="device", choices=("device", "host"),
                   help="the *_offload modes with --accumulation-steps: where the running gradient sums live")
    p.add_argument("--overlap-next-step", action="store_true",
                   help="the *_offload modes: Offload(overlap_next_step=True), the CPU path's uploads (and, "
                        "stages 1-2, the all-gathers of the updated rows) handed over to the next call")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.worlds = args.worlds or ([1, 2] if args.smoke else [1, 2, 4])
    if args.smoke:
        args.layers, args.d_model, args.heads, args.vocab, args.seq = 2, 32, 2, 64, 16
        args.warmup, args.iters = 1, 2
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs CUDA devices")
        gpus = torch.cuda.device_count()
        rows = [run_mode(w, m, args) if w <= gpus else {"world": w, "mode": m, "status": f"skipped: {gpus} GPU(s)"}
                for w in args.worlds for m in args.modes]
        device = f"{device_name(torch.device('cuda', 0))} x{gpus}, NCCL, one GPU a rank"
    else:
        rows = [run_mode(w, m, args) for w in args.worlds for m in args.modes]
        device = f"CPU ({os.cpu_count()} cores), gloo, {args.threads} thread(s) a rank"
    print_table(rows, COLUMNS)
    suffix = f"_k{args.accumulation_steps}_{args.accumulate_on}" if args.accumulation_steps > 1 else ""
    suffix += "_overlap" if args.overlap_next_step else ""
    out = args.out or os.path.join(HERE, "results", f"zero_{args.device}{suffix}.json")
    write_json(out, {"device": device, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
