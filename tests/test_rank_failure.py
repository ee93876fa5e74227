"""A rank that fails inside a ZeRO or sequence-parallel step, between two of its collectives:
the other ranks raise `RankTimeoutError` (`RingTimeoutError` under sequence parallelism) within
the config's `timeout_s`, not after the process group's own timeout.

Rank 1's model passes its first activation through `tripwire`, an identity whose backward
raises (or ends the process) when the batch says so. Its backward runs after the gradient
collectives of the later layers' buckets and before the first layer's, so on the second call
rank 1 fails after the step's first collectives while rank 0 goes on into the next one. The
world group the ranks were started with has a 60 s timeout; the step's is 3 s (each rank
compiles first and the ranks meet at a barrier before they run the step, so no rank's first
collective waits out another's compile).

After the timeout, the surviving rank's step is broken for good: its next call, synchronize()
and state_dict() raise `StateError` at once (no collective, no wait; rank 1 is not even inside
the step any more), naming the timeout, and the refused call changes nothing. So is rank 1's,
which raised after the step's first collectives (a RuntimeError under ZeRO, a KeyboardInterrupt
under sequence parallelism): its retry's collectives would pair with rank 0's later ones. A failure before the first collective leaves a step retryable (one process)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from ring_dist import run_ranks

import graphoffload

TIMEOUT_S = 3.0
MARGIN_S = 5.0   # compile is done by then; the rest of the call is milliseconds on tiny layers
REFUSED_S = TIMEOUT_S / 6   # a refusal waits for no collective: far less than one timeout
c10d = torch.ops._c10d_functional


@torch.library.custom_op("graphoffload_tests::tripwire", mutates_args=())
def tripwire(x: torch.Tensor, armed: torch.Tensor) -> torch.Tensor:
    return x.clone()


@tripwire.register_fake
def _(x, armed):
    return torch.empty_like(x)


@torch.library.custom_op("graphoffload_tests::tripwire_backward", mutates_args=())
def tripwire_backward(grad: torch.Tensor, armed: torch.Tensor) -> torch.Tensor:
    """Fails as the batch says: 1 raises, 2 ends the process at once (a crashed rank)."""
    how = int(armed)
    if how == 2:
        os._exit(0)   # noqa: the rank dies here, in the middle of backward
    if how == 1:
        raise RuntimeError("rank 1 failed inside the step on purpose")
    return grad.clone()


@tripwire_backward.register_fake
def _(grad, armed):
    return torch.empty_like(grad)


tripwire.register_autograd(lambda ctx, grad: (tripwire_backward(grad, ctx.armed), None),
                           setup_context=lambda ctx, inputs, output: setattr(ctx, "armed", inputs[1]))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor, armed: torch.Tensor) -> torch.Tensor:
        x = tripwire(self.layers[0](x), armed)
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return x


def _step(model, optimizer, batch):
    loss = model(batch["x"], batch["armed"]).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _fail_inside_the_second_call(rank: int, stage: int, how: int, fused: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # one layer a bucket: the last layers' collectives (and updates) come before the tripwire
    zero = graphoffload.ZeRO(stage=stage, bucket_numel=300, timeout_s=TIMEOUT_S)
    # fused: updates one layer a bucket too, so the last layers' run before the tripwire
    config = graphoffload.CompileConfig(fuse_optimizer=graphoffload.FuseOptimizer(bucket_numel=300 if fused else 1 << 20))
    step = graphoffload.offload_compile(_step, config=config, data_parallel=zero)
    batch = {"x": torch.randn(2, 16, generator=torch.Generator().manual_seed(rank)), "armed": torch.tensor(0)}
    step.compile(model, opt, batch)
    dist.barrier()   # every rank compiled: the step's collectives wait for no compile
    step(model, opt, batch)   # trains: every rank answers

    # the failure sits between collectives of the graph
    nodes = list(step.graphs["final"].graph.nodes)
    wire = next(i for i, n in enumerate(nodes) if n.target is torch.ops.graphoffload_tests.tripwire_backward.default)
    waits = [i for i, n in enumerate(nodes) if n.target is c10d.wait_tensor.default]
    assert waits[0] < wire < waits[-1], (waits, wire)

    if rank == 1:
        with pytest.raises(Exception, match="on purpose") as raised:
            step(model, opt, {**batch, "armed": torch.tensor(how)})
        # rank 0 is inside a later collective: rank 1's next call is refused, not paired with it
        _refused_at_once(step, model, _raised_in_graph(raised.value), model, opt, batch)
        return
    before = [p.detach().clone() for p in model.parameters()]
    start = time.monotonic()
    with pytest.raises(graphoffload.RankTimeoutError) as info:
        step(model, opt, batch)
    waited = time.monotonic() - start
    assert waited <= TIMEOUT_S + MARGIN_S, waited
    message = str(info.value)
    assert "ZeRO data parallelism: rank 0 of 2 failed in a collective of the step" in message, message
    assert "global ranks [0, 1]" in message and f"ZeRO(timeout_s={TIMEOUT_S:g})" in message, message
    assert "restart the job from the last checkpoint" in message, message
    changed = [n for (n, p), q in zip(model.named_parameters(), before) if not torch.equal(p, q)]
    if fused:   # the last layers' updates had run: the error says what changed, as a PartialUpdateError does
        assert changed and isinstance(info.value, graphoffload.RankFailedMidUpdateError), (changed, type(info.value))
        assert all(n in message for n in changed) and "layers.0.weight" not in changed, (changed, message)
        with pytest.raises(graphoffload.StateError, match="refusing to run"):
            step(model, opt, batch)
        step.accept_partial_update()   # accepting the partial update does not make the group usable again
    else:       # every update waits for the last collective: nothing changed
        assert not changed and not isinstance(info.value, graphoffload.PartialUpdateError), changed
    _refused_at_once(step, model, info.value, model, opt, batch)
    print(message)
    print(f"rank 0 (stage {stage}, rank 1 {'raised' if how == 1 else 'died'}): "
          f"RankTimeoutError after {waited:.2f} s")


def _raised_in_graph(exc: BaseException) -> BaseException:
    """The `StepRunError` a graph's op raised: `exc` itself, or the cause of the
    `PartialUpdateError` a call raises when the step's updates had changed something."""
    return exc if isinstance(exc, graphoffload.StepRunError) else exc.__cause__


def _refused_at_once(step, model, timed_out: BaseException, *args) -> None:
    """After `timed_out`, the step's next call (with `args`), synchronize(), state_dict(),
    load_state_dict() and compile() each raise `StateError` caused by it, well within one
    timeout, and change no parameter."""
    before = [p.detach().clone() for p in model.parameters()]
    saved = {"optimizers": [{}]}   # refused before it is read (a ValueError or KeyError otherwise)
    took_all = []
    for what in (lambda: step(*args), step.synchronize, step.state_dict, lambda: step.load_state_dict(saved),
                 lambda: step.compile(*args)):
        start = time.monotonic()
        with pytest.raises(graphoffload.StateError, match="refusing to .* restart the job from the last "
                                                          "checkpoint") as refused:
            what()
        took = time.monotonic() - start
        assert took < REFUSED_S, took
        took_all.append(took)
        assert refused.value.__cause__ is timed_out, refused.value.__cause__
        assert type(timed_out).__name__ in str(refused.value), str(refused.value)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    print(f"after {type(timed_out).__name__}: call, synchronize(), state_dict(), load_state_dict(), compile() "
          "refused in "
          + ", ".join(f"{t * 1e3:.2f}" for t in took_all) + " ms")


def _ranks(rank: int, world: int) -> None:
    del world
    _fail_inside_the_second_call(rank, stage=2, how=1, fused=True)
    done = torch.zeros(1)   # the world group is still fine: rank 1 waits for rank 0's error
    if rank == 0:
        dist.send(done, 1)
    else:
        dist.recv(done, 0)
    _fail_inside_the_second_call(rank, stage=1, how=2, fused=False)


@torch.library.custom_op("graphoffload_tests::env_tripwire", mutates_args=())
def env_tripwire(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@env_tripwire.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("graphoffload_tests::env_tripwire_backward", mutates_args=())
def env_tripwire_backward(grad: torch.Tensor) -> torch.Tensor:
    """Raises when this process's GRAPHOFFLOAD_TESTS_TRIPWIRE is set (a sequence-parallel step
    takes the same batch on every rank, so the rank that fails is told another way): a
    KeyboardInterrupt, as a user's Ctrl-C would land there."""
    if os.environ.get("GRAPHOFFLOAD_TESTS_TRIPWIRE"):
        raise KeyboardInterrupt("rank 1 interrupted inside the step on purpose")
    return grad.clone()


@env_tripwire_backward.register_fake
def _(grad):
    return torch.empty_like(grad)


env_tripwire.register_autograd(lambda ctx, grad: env_tripwire_backward(grad))


class Attention(torch.nn.Module):
    """Embedding, the tripwire, one causal attention, a head: in backward the attention's ring
    exchanges and the gradient all-reduces of the later layers come before the tripwire, the
    embedding's all-reduce after it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(64, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = env_tripwire(self.tok(idx))
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return torch.nn.functional.cross_entropy(self.head(y).flatten(0, 1), labels.flatten())


def _sequence_parallel_ranks(rank: int, world: int) -> None:
    del world
    torch.manual_seed(0)
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sp = graphoffload.SequenceParallel(timeout_s=TIMEOUT_S, bucket_numel=1000)
    step = graphoffload.offload_compile(_step_on, sequence_parallel=sp)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}
    step.compile(model, opt, batch)
    dist.barrier()   # every rank compiled: the step's collectives wait for no compile
    step(model, opt, batch)
    nodes = list(step.graphs["final"].graph.nodes)
    wire = next(i for i, n in enumerate(nodes)
                if n.target is torch.ops.graphoffload_tests.env_tripwire_backward.default)
    waits = [i for i, n in enumerate(nodes) if n.target is c10d.wait_tensor.default]
    assert waits[0] < wire < waits[-1], (waits, wire)
    done = torch.zeros(1)
    if rank == 1:
        os.environ["GRAPHOFFLOAD_TESTS_TRIPWIRE"] = "1"
        with pytest.raises(KeyboardInterrupt, match="on purpose") as raised:
            step(model, opt, batch)
        del os.environ["GRAPHOFFLOAD_TESTS_TRIPWIRE"]
        # past the ring's exchanges: rank 0 is inside a later collective, so rank 1's own next
        # call (and the rest) is refused rather than paired with it; the interrupt stays one
        _refused_at_once(step, model, raised.value, model, opt, batch)
        dist.recv(done, 0)   # the world group is still fine: wait for rank 0's error
        return
    start = time.monotonic()
    with pytest.raises(graphoffload.RingTimeoutError) as info:
        step(model, opt, batch)
    waited = time.monotonic() - start
    assert waited <= TIMEOUT_S + MARGIN_S, waited
    message = str(info.value)
    assert "sequence parallelism: rank 0 of 2 failed in a collective of the step" in message, message
    assert f"SequenceParallel(timeout_s={TIMEOUT_S:g})" in message, message
    _refused_at_once(step, model, info.value, model, opt, batch)
    dist.send(done, 1)
    print(f"rank 0 (sequence parallel, rank 1 raised): RingTimeoutError after {waited:.2f} s")


def _step_on(model, optimizer, batch):
    loss = model(batch["input_ids"], batch["labels"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.slow   # two processes
def test_a_rank_failing_inside_a_sequence_parallel_step_makes_the_others_raise_within_timeout_s():
    run_ranks(_sequence_parallel_ranks, 2, deadline_s=120)


@pytest.mark.slow   # two processes
def test_a_rank_failing_inside_a_zero_step_makes_the_others_raise_within_timeout_s():
    run_ranks(_ranks, 2, deadline_s=120)


class Embedded(torch.nn.Module):
    """An embedding before `Net`: bad token ids fail in forward, before any collective of a ZeRO
    stage 1-2 step; the tripwire fails in backward, after the later layers' collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(8, 16)
        self.net = Net()

    def forward(self, idx: torch.Tensor, armed: torch.Tensor) -> torch.Tensor:
        return self.net(self.tok(idx), armed)


def test_a_failure_before_the_first_collective_is_retryable_one_after_it_breaks_the_step(one_process_group):
    import copy

    torch.manual_seed(0)
    model = Embedded()
    eager = copy.deepcopy(model)
    opt, eager_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager))
    zero = graphoffload.ZeRO(stage=2, bucket_numel=300, timeout_s=TIMEOUT_S)
    step = graphoffload.offload_compile(_step, data_parallel=zero)
    ids = torch.randint(0, 8, (2, 4), generator=torch.Generator().manual_seed(1))
    batch = {"x": ids, "armed": torch.tensor(0)}
    step(model, opt, batch)
    _step(eager, eager_opt, batch)
    nodes = list(step.graphs["final"].graph.nodes)
    first = next(i for i, n in enumerate(nodes) if getattr(n.target, "namespace", None) == "_c10d_functional")
    embedding = next(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.embedding.default)
    wire = next(i for i, n in enumerate(nodes) if n.target is torch.ops.graphoffload_tests.tripwire_backward.default)
    assert embedding < first < wire, (embedding, first, wire)

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(graphoffload.StepRunError, match="outside its 8 rows"):
        step(model, opt, {**batch, "x": ids + 8})   # before the first collective: nothing changed
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    loss = step(model, opt, batch)   # the retry runs, as eager's second step
    eager_loss = _step(eager, eager_opt, batch)
    assert torch.allclose(loss, eager_loss, rtol=1e-5, atol=0), (loss, eager_loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-5 * q.norm(), name

    with pytest.raises(Exception, match="on purpose") as raised:
        step(model, opt, {**batch, "armed": torch.tensor(1)})   # after the first collective
    failure = _raised_in_graph(raised.value)
    with pytest.raises(graphoffload.StateError, match="stopped inside the step at node .*tripwire_backward"):
        step(model, opt, batch)
    _refused_at_once(step, model, failure, model, opt, batch)


def test_the_ops_that_exchange_with_other_ranks_are_the_ones_a_failure_after_breaks_the_step():
    """What `Executor.break_if_past_a_collective` counts as the graph's first collective: every op
    that takes a process group by name (the functional collectives, ring attention's exchanges in
    forward and backward, a sequence-parallel step's first ones), not a collective's wait or a
    local op."""
    from graphoffload.runtime.executor import _communicates

    g = torch.fx.Graph()
    x = g.placeholder("x")
    ops = {torch.ops._c10d_functional.all_reduce.default: (x, "sum", "0"),
           torch.ops._c10d_functional.reduce_scatter_tensor.default: (x, "sum", 2, "0"),
           torch.ops._c10d_functional.all_gather_into_tensor.default: (x, 2, "0"),
           torch.ops.graphoffload.ring_attention.default: (x, x, x, True, None, "zigzag", "0", 1.0),
           torch.ops._c10d_functional.wait_tensor.default: (x,),
           torch.ops.aten.add.Tensor: (x, x)}
    nodes = {op: g.call_function(op, args) for op, args in ops.items()}
    assert [op for op, n in nodes.items() if _communicates(n)] == list(ops)[:4]
    assert not _communicates(x)
