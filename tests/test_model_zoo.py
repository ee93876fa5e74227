"""Tiny Hugging Face models across families, built from their configs (random init), trained for
a few steps compiled and eagerly: encoder (BERT, RoBERTa), encoder-decoder (T5), decoders
(GPT-2, Llama, Mistral, Qwen2), mixture-of-experts (Mixtral) and vision (ViT), plain and with the
optimizer state offloaded. Each family once broke capture or training in its own way: capitals
in parameter names (BERT's `LayerNorm`, T5's `SelfAttention`), a learned attention bias (T5's
relative position bias), expert routing (Mixtral)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_training_matches, eager_and_compiled

import graphoffload

import transformers  # noqa: E402  (in the `test` extra: missing fails rather than skips)

VOCAB, SEQ = 64, 8
TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32)
DECODER = dict(TEXT, num_hidden_layers=1, num_key_value_heads=1)


def _build(config_cls, model_cls, **kwargs):
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa"
    return model_cls(config)


MODELS = {
    "bert": lambda: _build(transformers.BertConfig, transformers.BertForMaskedLM, num_hidden_layers=1,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **TEXT),
    "roberta": lambda: _build(transformers.RobertaConfig, transformers.RobertaForMaskedLM, num_hidden_layers=1,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1, **TEXT),
    "t5": lambda: _build(transformers.T5Config, transformers.T5ForConditionalGeneration, vocab_size=VOCAB,
                         d_model=32, d_kv=16, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                         relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0),
    "gpt2": lambda: _build(transformers.GPT2Config, transformers.GPT2LMHeadModel, n_layer=1, n_head=2, n_embd=32,
                           vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": lambda: _build(transformers.LlamaConfig, transformers.LlamaForCausalLM, **DECODER),
    "mistral": lambda: _build(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=4,
                              **DECODER),
    "qwen2": lambda: _build(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, **DECODER),
    # transformers' default experts implementation: grouped_mm
    "mixtral": lambda: _build(transformers.MixtralConfig, transformers.MixtralForCausalLM,
                              num_local_experts=4, num_experts_per_tok=2, **DECODER),
    "mixtral-batched_mm": lambda: _build(transformers.MixtralConfig, transformers.MixtralForCausalLM,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         experts_implementation="batched_mm", **DECODER),
    "vit": lambda: _build(transformers.ViTConfig, transformers.ViTForImageClassification, image_size=8,
                          patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                          num_attention_heads=2, intermediate_size=32, num_labels=3,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}


def _batches(name: str, n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return [{"pixel_values": torch.randn(2, 3, 8, 8, generator=g), "labels": torch.randint(0, 3, (2,), generator=g)}
                for _ in range(n)]
    out = []
    for _ in range(n):
        ids = torch.randint(2, VOCAB, (2, SEQ), generator=g)
        batch = {"input_ids": ids, "labels": torch.randint(2, VOCAB, (2, SEQ), generator=g)}
        if name in ("bert", "roberta", "llama", "mistral"):
            batch["attention_mask"] = torch.ones(2, SEQ, dtype=torch.long).index_fill_(1, torch.tensor([SEQ - 1]), 0)
        out.append(batch)
    return out


def _step(model, optimizer, batch):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)


# every family plain; offloaded, the ones whose names or gradients reach the offload pass' own
# naming of host inputs (capitals, a learned bias, experts), to keep the file near a minute
CASES = [(name, None) for name in sorted(MODELS)] + [
    (name, graphoffload.Offload(device_updates="never")) for name in ("bert", "t5", "mixtral")]


@pytest.mark.parametrize("name,offload", CASES,
                         ids=[f"{n}-{'offloaded' if o is not None else 'plain'}" for n, o in CASES])
def test_tiny_hf_model_trains_like_eager(name, offload):
    torch.manual_seed(0)
    eager, opt_e, losses_e, compiled, opt_c, losses_c, _ = eager_and_compiled(
        MODELS[name](), _adamw, _batches(name), step_fn=_step, offload=offload)
    # bit for bit where the same kernels run; T5's learned relative position bias goes through
    # SDPA's mask, for which eager runs its math kernel and graphoffload its fused CPU kernel;
    # Mixtral's batched_mm experts sum routed tokens' gradients in another order: within 1e-5
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c,
                            exact=name not in ("t5", "mixtral-batched_mm"), offloaded=offload is not None)


def test_mixtral_with_data_dependent_expert_loop_names_the_switch_and_the_users_line():
    model = _build(transformers.MixtralConfig, transformers.MixtralForCausalLM, num_local_experts=4,
                   num_experts_per_tok=2, experts_implementation="eager", **DECODER)

    def step(model, optimizer, batch):
        loss = model(**batch).loss   # the user's line the error names
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(graphoffload.CaptureError) as info:
        graphoffload.offload_compile(step)(model, _adamw(model), _batches("mixtral", 1)[0])
    message = str(info.value)
    assert 'experts_implementation="grouped_mm"' in message and "batched_mm" in message
    assert f"{__file__}:" in message and "the user's line the error names" in message


@pytest.mark.parametrize("layout", ["tokens-by-expert", "tokens-by-expert, transposed weights", "batched",
                                    "batched, transposed weights"])
def test_grouped_mm_op_matches_torch_and_its_fake_gives_the_real_strides(layout):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphoffload.ops.grouped_mm import grouped_mm

    torch.manual_seed(0)
    # transposed weights (column-major, as transformers' experts pass them): eager's backward
    # takes the transposed product for their gradient, which sums in another order on some CPUs
    b = torch.randn(3, 4, 8).transpose(-2, -1) if layout.endswith("transposed weights") else torch.randn(3, 8, 4)
    if layout.startswith("tokens-by-expert"):
        a, offs = torch.randn(12, 8), torch.tensor([4, 4, 12], dtype=torch.int32)
    else:
        a, offs = torch.randn(3, 5, 8), None
    a.requires_grad_(), b.requires_grad_()
    grad = torch.randn(*a.shape[:-1], 4)
    ref = torch.autograd.grad(torch._grouped_mm(a, b, offs), (a, b), grad)
    got = torch.autograd.grad(grouped_mm(a, b, offs), (a, b), grad)
    for r, g in zip(ref, got):
        # the same kernels as eager autograd's, on operands laid out alike (so the same on every CPU)
        assert torch.equal(r, g) and r.stride() == g.stride(), (r.stride(), g.stride())
    torch.library.opcheck(torch.ops.graphoffload.grouped_mm.default, (a, b, offs))
    real = torch._grouped_mm(a.detach(), b.detach(), offs)
    mode = FakeTensorMode()
    fa, fb = mode.from_tensor(a.detach()), mode.from_tensor(b.detach())
    foffs = None if offs is None else mode.from_tensor(offs)
    with mode:
        fake = grouped_mm(fa, fb, foffs)
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
