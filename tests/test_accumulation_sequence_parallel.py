"""Gradient accumulation under sequence parallelism (issue 18), in spawned gloo processes: both
forms -- a micro-batch loop inside the step, and `accumulation_steps=k` -- train as single-process
eager accumulation on the full sequences, and the parameter gradients are all-reduced once per
update, not once per micro-batch (the accumulating calls' graphs hold no gradient all-reduce; the
running sums stay each rank's partial sums until the update adds the last micro-batch and reduces)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from ring_dist import run_ranks
from steps import train_step as one_step

K = 3


def _gpt():
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)).double()


def _micro_batches(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 64, (2, 16), generator=g)
        out.append({"input_ids": x, "labels": torch.roll(x, -1, dims=1)})
    return out


def loop_step(model, optimizer, micro_batches):
    for mb in micro_batches:
        (model(mb["input_ids"], labels=mb["labels"]) / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()


def _optimizers():
    return {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
            "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)}


def _all_reduces(graph) -> tuple[int, int]:
    """(bucketed gradient all-reduces, single all-reduces) in a compiled graph."""
    c10d = torch.ops._c10d_functional
    targets = [n.target for n in graph.graph.nodes]
    return targets.count(c10d.all_reduce_coalesced.default), targets.count(c10d.all_reduce.default)


def _same_on_every_rank(model, world) -> None:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def _form_a(rank, world, optimizer):
    import graphoffload

    eager = _gpt()
    model = copy.deepcopy(eager)
    make = _optimizers()[optimizer]
    opt_e, opt = make(eager), make(model)
    step = graphoffload.offload_compile(loop_step, sequence_parallel=graphoffload.SequenceParallel(timeout_s=60))
    for window in range(2):
        mbs = _micro_batches(K, seed=10 + window)
        loop_step(eager, opt_e, mbs)
        step(model, opt, mbs)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).abs().max().item() <= 1e-10, (optimizer, name, (p - q).abs().max().item())
    _same_on_every_rank(model, world)


def _form_b(rank, world, optimizer):
    import graphoffload

    eager = _gpt()
    model = copy.deepcopy(eager)
    make = _optimizers()[optimizer]
    opt_e, opt = make(eager), make(model)
    step = graphoffload.offload_compile(one_step, accumulation_steps=K,
                                        sequence_parallel=graphoffload.SequenceParallel(timeout_s=60))
    reduces = []
    for window in range(2):
        mbs = _micro_batches(K, seed=20 + window)
        for mb in mbs:
            want = eager(mb["input_ids"], labels=mb["labels"])
            (want / K).backward()
            got = step(model, opt, mb)
            # the micro-batch's own loss (the model computes it in fp32: summed over ranks in another order)
            assert torch.allclose(got.double(), want.detach().double(), rtol=1e-6, atol=0), (got, want)
            reduces.append(_all_reduces(step.last.graph))
        opt_e.step()
        opt_e.zero_grad()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).abs().max().item() <= 1e-10, (optimizer, name, (p - q).abs().max().item())
    _same_on_every_rank(model, world)
    # gradients are reduced once per update: only every k-th call's graph all-reduces them
    # accumulating calls: the loss's sum and token count only (one all-reduce); the update: that,
    # and the gradient buckets, each once
    assert [r for r in reduces] == [reduces[0], reduces[0], reduces[2]] * 2, reduces
    assert reduces[0] == (0, 1) and reduces[2][0] >= 1 and reduces[2][1] == 1, reduces
    # accumulate, and accumulate-and-update (SGD's first update, which creates its momentum, a third)
    assert step.trace_count == (3 if optimizer == "sgd" else 2)


class _ScaledLoss(torch.nn.Module):
    """A parameter used only after the loss is averaged over ranks: its gradient is the same on
    every rank (not a partial sum), so it cannot be added into a running partial sum."""

    def __init__(self):
        super().__init__()
        self.gpt = _gpt()
        self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, idx, labels):
        return self.gpt(idx, labels=labels) * self.scale


def _replicated_gradient_is_refused(rank, world):
    import graphoffload

    model = _ScaledLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    step = graphoffload.offload_compile(one_step, accumulation_steps=K,
                                        sequence_parallel=graphoffload.SequenceParallel(timeout_s=60))
    with pytest.raises(graphoffload.UnsupportedError, match="running gradient sum"):
        step(model, opt, _micro_batches(1)[0])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def _world2(rank, world):
    for optimizer in ("adamw", "sgd"):
        _form_a(rank, world, optimizer)
        _form_b(rank, world, optimizer)
    _replicated_gradient_is_refused(rank, world)


@pytest.mark.slow   # several processes
def test_accumulation_under_sequence_parallelism_world2():
    run_ranks(_world2, 2, deadline_s=240)
