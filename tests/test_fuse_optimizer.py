"""fuse_optimizer: updates move into backward, results stay identical, gradients die early."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from gpt import GPT, GPTConfig
from steps import TINY, clipped_step, foreach_clipped_step, token_batches, train_step, zero_first_step

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer

def _step(clip: float | None):
    return train_step if clip is None else functools.partial(clipped_step, max_norm=clip)


def _batches(n: int, vocab: int, seq: int, batch: int = 2, seed: int = 0):
    return token_batches(n, vocab, seq, batch, seed)


def _train(model, make_opt, step_fn, batches):
    opt = make_opt(model.parameters())
    losses = [step_fn(model, opt, b).item() for b in batches]
    return losses, opt


def _assert_same(model_a, model_b, opt_a, opt_b, exact: bool):
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        if exact:
            assert torch.equal(pa, pb), name
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7, msg=name)
        for key, value in opt_a.state[pa].items():
            other = opt_b.state[pb][key]
            assert torch.equal(value, other) if exact else torch.allclose(value, other, rtol=1e-5, atol=1e-7)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.5])
def test_fused_step_matches_unfused_and_eager_bit_for_bit(opt_name, clip):
    torch.manual_seed(0)
    eager = GPT(TINY)
    fused, unfused = copy.deepcopy(eager), copy.deepcopy(eager)
    make_opt = OPTIMIZERS[opt_name]
    config = CompileConfig(subgroup_numel=20_000, fuse_optimizer=FuseOptimizer(bucket_numel=4096))
    fused_step = graphoffload.offload_compile(_step(clip), config=config)
    unfused_step = graphoffload.offload_compile(
        _step(clip), config=CompileConfig(subgroup_numel=20_000, disable_passes=("fuse_optimizer",)))

    batches = list(_batches(10, TINY.vocab_size, TINY.seq_len))
    eager_losses, eager_opt = _train(eager, make_opt, _step(clip), batches)
    fused_losses, fused_opt = _train(fused, make_opt, fused_step, batches)
    unfused_losses, unfused_opt = _train(unfused, make_opt, unfused_step, batches)

    assert fused_losses == eager_losses == unfused_losses
    _assert_same(eager, fused, eager_opt, fused_opt, exact=True)
    _assert_same(eager, unfused, eager_opt, unfused_opt, exact=True)
    graph = fused_step.train_graph
    (summary,) = graph.notes_of("fuse_optimizer", "buckets")
    buckets = graph.notes_of("fuse_optimizer", "bucket")
    assert len(buckets) == summary.fields["buckets"] > 0
    if clip is None:
        assert all(b.fields["in_backward"] for b in buckets)
    else:
        # global-norm clipping writes every gradient after backward: every update waits for it
        assert summary.fields["in_backward"] == 0 and not any(b.fields["in_backward"] for b in buckets)
        assert all("clip_grad_norm_(" in b for b in buckets)   # the note points at the user's clipping line


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.5])
def test_fused_hugging_face_model_matches_unfused_and_eager(opt_name, clip):
    import transformers  # in the `test` extra: missing fails rather than skips
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(cfg)
    fused, unfused = copy.deepcopy(eager), copy.deepcopy(eager)

    def train_step(model, optimizer, batch):
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    fused_step = graphoffload.offload_compile(train_step, config=CompileConfig(
        fuse_optimizer=FuseOptimizer(bucket_numel=2048)))
    unfused_step = graphoffload.offload_compile(train_step, config=CompileConfig(disable_passes=("fuse_optimizer",)))
    make_opt = OPTIMIZERS[opt_name]
    batches = list(_batches(10, 64, 16))
    eager_losses, eager_opt = _train(eager, make_opt, train_step, batches)
    fused_losses, fused_opt = _train(fused, make_opt, fused_step, batches)
    unfused_losses, unfused_opt = _train(unfused, make_opt, unfused_step, batches)
    # the same kernels in another order: bit-identical to the unfused graph and to eager
    assert fused_losses == unfused_losses == eager_losses
    _assert_same(unfused, fused, unfused_opt, fused_opt, exact=True)
    _assert_same(eager, fused, eager_opt, fused_opt, exact=True)
    assert any(n.meta.get("bucket") is not None for n in fused_step.train_graph.graph.nodes)


def _bucket_kernels(graph):
    return [n for n in graph.graph.nodes if n.meta.get("bucket") is not None
            and getattr(n.target, "overloadpacket", None) is torch.ops.aten._fused_adamw_]


def test_every_bucket_runs_inside_backward_right_after_its_gradients():
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = OPTIMIZERS["adamw"](model.parameters())
    step = graphoffload.offload_compile(_step(None), config=CompileConfig(
        fuse_optimizer=FuseOptimizer(bucket_numel=1)))   # one parameter a bucket
    step(model, opt, _batches(1, TINY.vocab_size, TINY.seq_len)[0])
    graph = step.train_graph
    order = {n: i for i, n in enumerate(graph.graph.nodes)}
    backward = [n for n in graph.graph.nodes if n.meta["phase"] == "backward"]
    kernels = _bucket_kernels(graph)
    assert len(kernels) == len(list(model.parameters()))
    inside = [k for k in kernels if order[k] < order[backward[-1]]]
    # only the tied embedding/head weight's gradient is final at the very end of backward
    assert len(inside) >= len(kernels) - 1
    for kernel in kernels:
        grad = kernel.args[1][0]
        assert order[grad] < order[kernel]
        between = list(graph.graph.nodes)[order[grad] + 1:order[kernel]]
        # nothing between the gradient and its update touches that parameter
        param = kernel.args[0][0]
        assert not any(param in n.all_input_nodes for n in between)


def test_fusion_lowers_predicted_peak_by_most_of_the_gradient_bytes():
    cfg = GPTConfig(vocab_size=256, seq_len=8, n_layer=8, n_head=4, d_model=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = graphoffload.offload_compile(_step(None))
    step(model, opt, _batches(1, cfg.vocab_size, cfg.seq_len, batch=1)[0])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    captured, fused = step.memory("captured").peak, step.memory("fuse_optimizer").peak
    assert captured - fused >= 0.8 * grad_bytes, (captured, fused, grad_bytes)

    unfused = graphoffload.offload_compile(_step(None), config=CompileConfig(disable_passes=("fuse_optimizer",)))
    unfused(model, opt, _batches(1, cfg.vocab_size, cfg.seq_len, batch=1)[0])
    assert unfused.memory("final").peak == captured


def test_gradient_left_on_param_grad_is_kept_and_reported():
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)

    train_step = zero_first_step   # gradients stay on .grad
    step = graphoffload.offload_compile(train_step)
    batches = list(_batches(3, TINY.vocab_size, TINY.seq_len))
    _, eager_opt = _train(eager, OPTIMIZERS["adamw"], train_step, batches)
    _, compiled_opt = _train(compiled, OPTIMIZERS["adamw"], step, batches)
    _assert_same(eager, compiled, eager_opt, compiled_opt, exact=True)
    for pa, pb in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(pa.grad, pb.grad)
    assert any("stay alive" in line for line in step.train_graph.notes["fuse_optimizer"])


def test_foreach_clipping_norms_move_into_backward_and_results_stay_exact():
    train_step = foreach_clipped_step
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = copy.deepcopy(eager)
    step = graphoffload.offload_compile(train_step)
    batches = list(_batches(5, TINY.vocab_size, TINY.seq_len))
    eager_losses, eager_opt = _train(eager, OPTIMIZERS["adamw"], train_step, batches)
    compiled_losses, compiled_opt = _train(compiled, OPTIMIZERS["adamw"], step, batches)
    assert compiled_losses == eager_losses
    _assert_same(eager, compiled, eager_opt, compiled_opt, exact=True)

    nodes = list(step.train_graph.graph.nodes)
    last_backward = max(i for i, n in enumerate(nodes) if n.meta["phase"] == "backward")
    norms = [i for i, n in enumerate(nodes)
             if getattr(n.target, "overloadpacket", None) is torch.ops.aten._foreach_norm]
    assert len(norms) == len(list(compiled.parameters()))   # one per gradient
    assert sum(i < last_backward for i in norms) >= len(norms) - 1
