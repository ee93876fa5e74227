"""graphoffload's attention op against F.scaled_dot_product_attention in float64: outputs,
logsumexp, gradients; fake kernels that give the real strides; torch.library.opcheck."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import graphoffload  # noqa: F401  (registers torch.ops.graphoffload.*)
from graphoffload.ops.attention import attention, attention_backward

# (batch, heads, kv heads, q len, kv len, head dim, causal, mask)
CASES = {
    "causal": (2, 4, 4, 16, 16, 8, True, None),
    "non-causal": (2, 2, 2, 12, 12, 16, False, None),
    "bool-mask": (1, 2, 2, 10, 14, 8, False, "bool"),
    "float-mask": (2, 2, 2, 9, 9, 8, False, "float"),
    "gqa-causal": (2, 6, 2, 16, 16, 8, True, None),
    "gqa-float-mask": (1, 4, 1, 8, 8, 8, False, "float"),
    "odd-head-dim": (1, 3, 3, 7, 7, 13, True, None),
    "odd-head-dim-bool": (2, 2, 1, 5, 11, 7, False, "bool"),
}


def make_inputs(case: str, dtype=torch.float32, seed: int = 0):
    b, h, hkv, lq, lk, d, causal, mask_kind = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(lq, lk, generator=g) > 0.4
        mask[:, 0] = True    # every query sees at least one key
    elif mask_kind == "float":
        mask = torch.randn(b, 1, lq, lk, generator=g, dtype=dtype)
    return q, k, v, mask, causal


def reference(q, k, v, mask, causal):
    """float64 SDPA (outputs, lse, grads of a fixed upstream gradient)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    m = mask.double() if mask is not None and mask.is_floating_point() else mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=True)
    scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if m is not None:
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    lse = scores.logsumexp(-1)
    grad_out = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return out.detach(), lse.detach(), grads, grad_out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-10)], ids=["f32", "f64"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_and_its_gradients_match_float64_sdpa(case, dtype, tol):
    q, k, v, mask, causal = make_inputs(case, dtype)
    ref_out, ref_lse, ref_grads, grad_out = reference(q, k, v, mask, causal)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.graphoffload.attention(qg, kg, vg, mask, causal)
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    grads = torch.autograd.grad(out, (qg, kg, vg), grad_out.to(dtype))
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape, name     # GQA: dk/dv have the kv heads' shape
        torch.testing.assert_close(g.double(), r, rtol=tol * 10, atol=tol * 10, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_fake_kernels_give_the_real_strides(case):
    q, k, v, mask, causal = make_inputs(case)
    out, lse = attention(q, k, v, mask, causal)
    grad_out = torch.randn_like(out)
    grads = attention_backward(grad_out, q, k, v, out, lse, mask, causal)
    mode = FakeTensorMode()
    fq, fk, fv, fg, fo, fl = (mode.from_tensor(t) for t in (q, k, v, grad_out, out, lse))
    fmask = mode.from_tensor(mask) if mask is not None else None
    with mode:
        f_out, f_lse = attention(fq, fk, fv, fmask, causal)
        f_grads = attention_backward(fg, fq, fk, fv, fo, fl, fmask, causal)
    for name, real, fake in [("out", out, f_out), ("lse", lse, f_lse),
                             *((f"d{n}", r, f) for n, r, f in zip("qkv", grads, f_grads))]:
        assert fake.shape == real.shape, name
        assert fake.stride() == real.stride(), name
        assert fake.dtype == real.dtype, name


@pytest.mark.parametrize("case", ["causal", "bool-mask", "float-mask", "gqa-causal"])
def test_opcheck_passes(case):
    q, k, v, mask, causal = make_inputs(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.graphoffload.attention.default, (q, k, v, mask, causal))
    out, lse = attention(q.detach(), k.detach(), v.detach(), mask, causal)
    torch.library.opcheck(torch.ops.graphoffload.attention_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, mask, causal))


class DropoutAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).square().mean()


def test_sdpa_with_attention_dropout_in_a_step_is_unsupported():
    model = DropoutAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, optimizer, x):
        loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    with pytest.raises(graphoffload.UnsupportedError, match="dropout_p=0.1"):
        graphoffload.offload_compile(step)(model, opt, torch.randn(2, 5, 8))


# (mask shape, grouped K/V, causal): per head, broadcast over batch / over heads / over queries
MASK_SHAPES = {"per-head": ((1, 4, 9, 11), False, False), "per-batch": ((2, 1, 9, 11), True, False),
               "keys-only-2d": ((1, 11), False, False), "full-gqa": ((2, 4, 9, 11), True, False),
               "causal": ((1, 4, 9, 9), False, True)}


@pytest.mark.parametrize("case", sorted(MASK_SHAPES))
def test_learned_mask_gets_the_gradient_eager_sdpa_gives_it(case):
    shape, gqa, causal = MASK_SHAPES[case]
    torch.manual_seed(0)
    lk = shape[-1]
    q = torch.randn(2, 4, shape[-2] if len(shape) == 4 else 9, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2 if gqa else 4, lk, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 4, q.shape[-2], 8, dtype=torch.float64)
    kwargs = dict(attn_mask=mask, enable_gqa=gqa) if not causal else dict(attn_mask=mask + torch.zeros(
        lk, lk, dtype=torch.float64).masked_fill(torch.ones(lk, lk, dtype=torch.bool).triu(1), float("-inf")),
        enable_gqa=gqa)
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kwargs), (q, k, v, mask), grad_out)
    out, _ = attention(q, k, v, kwargs["attn_mask"], False)
    got = torch.autograd.grad(out, (q, k, v, mask), grad_out)
    for name, g, r in zip(("dq", "dk", "dv", "dmask"), got, ref):
        assert g.shape == r.shape, name        # reduced over the dimensions the mask was broadcast along
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_mask_gradient_op_passes_opcheck_and_its_fake_gives_the_real_strides():
    q, k, v, mask, causal = make_inputs("gqa-float-mask")
    out, lse = attention(q, k, v, mask, causal)
    args = (torch.randn_like(out), q, k, v, out, lse, mask, causal)
    torch.library.opcheck(torch.ops.graphoffload.attention_mask_grad.default, args)
    real = torch.ops.graphoffload.attention_mask_grad(*args)
    mode = FakeTensorMode()
    with mode:
        fake = torch.ops.graphoffload.attention_mask_grad(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                            for a in args))
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


class LearnedBiasAttention(torch.nn.Module):
    """Attention with a learned additive bias per head and key (ALiBi-style learned slopes)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48, bias=False)   # a key bias has a zero gradient: Adam would amplify its noise
        self.bias = torch.nn.Parameter(torch.zeros(1, 2, 1, 6))
        self.slopes = torch.nn.Parameter(torch.linspace(-0.5, 0.5, 2).view(1, 2, 1, 1))

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        distance = torch.arange(6.0).view(1, 1, 1, 6) - torch.arange(6.0).view(1, 1, 6, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias + self.slopes * distance)


@pytest.mark.parametrize("offload", [None, graphoffload.Offload(device_updates="never")], ids=["plain", "offloaded"])
def test_learned_attention_bias_trains_like_eager(offload):
    # the op's backward gave the mask no gradient: the bias silently never trained
    from helpers import assert_training_matches, eager_and_compiled

    def step(model, optimizer, x):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    torch.manual_seed(0)
    model = LearnedBiasAttention()
    batches = [torch.randn(2, 6, 16) for _ in range(3)]
    eager, opt_e, losses_e, compiled, opt_c, losses_c, _ = eager_and_compiled(
        model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), batches, step_fn=step, offload=offload)
    assert not torch.equal(compiled.bias, torch.zeros(1, 2, 1, 6))   # it trained
    # eager SDPA runs its math kernel for a mask that requires grad on the CPU, the op its
    # flash kernel: the same numbers to rounding, not the same bits
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=False,
                            offloaded=offload is not None)
