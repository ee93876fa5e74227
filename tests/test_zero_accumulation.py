"""ZeRO with `accumulation_steps=k`, in spawned gloo processes: the accumulating calls add each
rank's own gradients into its running sums with no gradient collective at all (their graphs hold
none: counted), and the updating call adds the last micro-batch's gradient and reduces the sums
once per bucket (all-reduce or reduce-scatter), updates its chunks and (stages 1 and 2)
all-gathers them. Stage 3 gathers its parameter buckets for forward and backward on every call,
accumulating or updating (counted too). N ranks, k micro-batches each, train as single-process
eager accumulation over the whole batches (AdamW and SGD with momentum; stage 3 AdamW; within
test_zero's tolerance in fp64)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor
from ring_dist import run_ranks
from helpers import whole as _full, zero_gpt as _gpt, zero_optimizer as _optimizer
from steps import train_step

import graphoffload

K = 3
WINDOWS = 2
RTOL = 2e-5
c10d = torch.ops._c10d_functional
COLLECTIVES = {c10d.all_reduce.default, c10d.all_reduce_coalesced.default, c10d.reduce_scatter_tensor.default,
               c10d.all_gather_into_tensor.default}


def _windows(world: int, rows: int = 2) -> list[list[dict]]:
    """WINDOWS windows of K global batches of `rows * world` sequences each."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(WINDOWS):
        window = []
        for _ in range(K):
            x = torch.randint(0, 64, (rows * world, 16), generator=g)
            window.append({"input_ids": x, "labels": torch.roll(x, -1, 1)})
        out.append(window)
    return out


def _collectives(graph) -> int:
    return sum(n.target in COLLECTIVES for n in graph.graph.nodes)


def _expected(stage: int, update: bool, graph, buckets: int) -> int:
    """Collectives a call's graph should hold: stages 1 and 2 none on an accumulating call, one
    gradient collective and one all-gather per bucket on the updating call; stage 3 every call
    one all-gather per parameter bucket forward and backward gather, the updating call one
    reduce-scatter per gradient bucket besides."""
    if stage < 3:
        return 2 * buckets if update else 0
    params = graph.notes_of("zero", "params")[0].fields
    return len(params["forward_buckets"]) + len(params["backward_buckets"]) + (buckets if update else 0)


def _accumulates_as_eager(rank, world, stage, optimizer):
    eager = _gpt()
    model = copy.deepcopy(eager)
    opt_e, opt = _optimizer(optimizer, eager), _optimizer(optimizer, model)
    step = graphoffload.offload_compile(train_step, accumulation_steps=K,
                                        data_parallel=graphoffload.ZeRO(stage=stage, bucket_numel=4096, timeout_s=60))
    counts = []
    for window in _windows(world):
        for batch in window:
            rows = batch["input_ids"].shape[0] // world
            mine = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
            with torch.no_grad():   # the rank's own micro-batch loss, from the parameters every rank holds
                own = eager(mine["input_ids"], labels=mine["labels"])
            # eager: the whole batch (the mean of the ranks' losses), accumulated over the window
            (eager(batch["input_ids"], labels=batch["labels"]) / K).backward()
            got = step(model, opt, mine)
            assert torch.allclose(got, own, rtol=RTOL, atol=0), (got, own)
            counts.append((_collectives(step.last.graph), step.last.graph))
        opt_e.step()
        opt_e.zero_grad()
        assert step.micro_step == 0
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert p.grad is None
            assert isinstance(p, DTensor) == (stage == 3 and p.dim() > 0), name
            err = ((_full(p) - q).abs().max() / q.abs().max()).item()
            assert err <= RTOL, f"stage {stage} {optimizer}: {name} is {err:.3g} from eager"
    # gradients cross the group once per update: the accumulating calls' graphs hold no
    # gradient collective; the updating call's one gradient collective per bucket
    shards = step.last.graph.notes_of("zero", "shards")[0].fields
    assert shards["buckets"] > 1
    want = [_expected(stage, (i + 1) % K == 0, graph, shards["buckets"]) for i, (_, graph) in enumerate(counts)]
    assert [n for n, _ in counts] == want, (counts, want)
    if stage == 3:   # the gathers themselves are the same on both kinds of call
        params = [graph.notes_of("zero", "params")[0].fields for _, graph in counts[:K]]
        assert params[0]["sharded"] == params[-1]["sharded"]
        assert params[0]["forward_buckets"] == params[-1]["forward_buckets"]


def _world2(rank, world):
    for stage in (1, 2):
        for optimizer in ("adamw", "sgd"):
            _accumulates_as_eager(rank, world, stage, optimizer)
    # stage 3: AdamW (SGD's kernel under stage 3: tests/test_zero_stage3.py; the window is the same)
    _accumulates_as_eager(rank, world, 3, "adamw")


@pytest.mark.slow   # several processes
def test_zero_with_accumulation_steps_reduces_once_per_update_world2():
    run_ranks(_world2, 2, deadline_s=400)
