"""On a GPU: graphoffload's attention op (flash and memory-efficient kernels) against float64
SDPA, the example GPT's fp32 and bf16-autocast training against eager, and the predicted peak
memory against the CUDA caching allocator's measured peak. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from gpt import GPT, GPTConfig
from helpers import assert_movement_and_state_close, assert_training_matches, run_steps, token_batches
from steps import train_step
from test_attention_op import CASES, make_inputs, reference
from torch._subclasses.fake_tensor import FakeTensorMode

import graphoffload
from graphoffload import CompileConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)

# the fused attention kernels take bfloat16 from sm80 on (eager SDPA falls back to its math kernel)
PRE_AMPERE = torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0)


def cuda_batches(n: int) -> list[dict]:
    return [{k: v.cuda() for k, v in b.items()} for b in token_batches(n)]


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)


def bf16_step(model, optimizer, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.float16, 2e-2)], ids=["f32", "f16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_op_matches_float64_sdpa(case, dtype, tol):
    # f16 without a mask runs flash attention on sm80+, everything else memory-efficient
    # attention; the odd head dims go through the padding to a multiple of 8
    q, k, v, mask, causal = make_inputs(case, dtype)
    ref_out, ref_lse, ref_grads, grad_out = reference(q, k, v, mask, causal)
    q, k, v = (t.cuda().requires_grad_() for t in (q, k, v))
    mask = mask.cuda() if mask is not None else None
    out, lse = torch.ops.graphoffload.attention(q, k, v, mask, causal)
    assert lse.dtype == torch.float32 and lse.shape[:-1] == ref_lse.shape[:-1]
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse[..., :q.shape[-2]].double().cpu(), ref_lse, rtol=tol, atol=tol)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(dtype).cuda())
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape, name
        torch.testing.assert_close(g.double().cpu(), r, rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")

    # the fake kernels pick the same kernel as the real ones: same shapes and strides
    mode = FakeTensorMode()
    real = [out, lse, *grads]
    with torch.no_grad():
        fq, fk, fv, fo, fl = (mode.from_tensor(t.detach()) for t in (q, k, v, out, lse))
        fmask = mode.from_tensor(mask) if mask is not None else None
        with mode:
            fake = [*torch.ops.graphoffload.attention(fq, fk, fv, fmask, causal),
                    *torch.ops.graphoffload.attention_backward(torch.empty_like(fo), fq, fk, fv, fo, fl, fmask, causal)]
    for r, f in zip(real, fake):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


@pytest.mark.parametrize("step_fn,tol", [
    (train_step, 1e-5),
    pytest.param(bf16_step, 2e-2, marks=pytest.mark.skipif(PRE_AMPERE, reason="bf16 attention needs sm80+")),
], ids=["fp32", "bf16-autocast"])
def test_gpt_on_gpu_matches_eager(step_fn, tol):
    torch.manual_seed(0)
    eager = GPT(CFG).cuda()
    compiled = copy.deepcopy(eager)
    start = [p.detach().double().clone() for p in eager.parameters()]
    opt_e, opt_c = adamw(eager), adamw(compiled)
    step = graphoffload.offload_compile(step_fn)
    batches = cuda_batches(10)
    losses_e = run_steps(step_fn, eager, opt_e, batches)
    losses_c = run_steps(step, compiled, opt_c, batches)
    # the CUDA fused kernels read lr as a float32 device tensor in the graph and as a double
    # eagerly: equal up to rounding, not bit for bit
    if step_fn is bf16_step:
        # bf16 autocast (issue 20 item 4): rtol 2e-2 / atol 2e-3 on the parameters passed a LayerNorm
        # weight never updated and a halved exp_avg_sq (test_comparisons.py keeps those mutants).
        # Movement and state are compared on their own scale instead, within 10% (not yet measured
        # on a GPU when written: the first GPU run should report the errors it sees)
        for i, (a, b) in enumerate(zip(losses_e, losses_c)):
            torch.testing.assert_close(b, a, rtol=tol, atol=0, msg=f"loss {i}")
        assert_movement_and_state_close(eager, opt_e, compiled, opt_c, start, rtol=0.1)
    else:
        assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=False,
                                rtol=tol, atol=tol * 0.1)
    assert step.trace_count == 1
    if step_fn is bf16_step:
        dtypes = {n.meta["val"].dtype for n in step.train_graph.graph.nodes
                  if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)}
        assert torch.bfloat16 in dtypes     # autocast was captured


def test_predicted_peak_is_within_ten_percent_of_measured():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, seq_len=128, n_layer=8, n_head=8, d_model=512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    # the captured graph is what runs when no pass rewrites it (dead code aside)
    step = graphoffload.offload_compile(train_step, config=CompileConfig(disable_passes=("fuse_optimizer",)))
    batch = {"input_ids": torch.randint(0, 8192, (4, 128), device="cuda")}
    batch["labels"] = torch.roll(batch["input_ids"], -1, 1)
    step(model, opt, batch)     # creates the optimizer state and the cuBLAS workspace
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        loss = step(model, opt, batch)
        del loss
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    predicted = step.memory("captured").peak
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)


@pytest.mark.parametrize("shape", [(1, 4, 9, 11), (2, 1, 9, 11)], ids=["per-head", "per-batch"])
def test_learned_mask_gradient_on_the_gpu_matches_eager_sdpa(shape):
    # eager SDPA runs the memory-efficient kernel, which computes the bias gradient, as the op does
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, 4, 11, 8, device="cuda", requires_grad=True) for _ in range(2))
    mask = torch.randn(shape, device="cuda", requires_grad=True)
    grad_out = torch.randn(2, 4, 9, 8, device="cuda")
    ref = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                              (q, k, v, mask), grad_out)
    out, _ = torch.ops.graphoffload.attention(q, k, v, mask)
    got = torch.autograd.grad(out, (q, k, v, mask), grad_out)
    for name, g, r in zip(("dq", "dk", "dv", "dmask"), got, ref):
        assert g.shape == r.shape, name
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
