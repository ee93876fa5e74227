"""Hugging Face causal LMs (random init from small configs, nothing downloaded) train under a
compiled step exactly as eagerly: GPT-2, and Llama with grouped-query attention."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_training_matches, eager_and_compiled, hf_gpt2, hf_llama, hf_train_step, token_batches

import transformers  # noqa: E402,F401  (in the `test` extra: missing fails rather than skips)

MODELS = {"gpt2": hf_gpt2, "llama-gqa": hf_llama}
OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, fused=True),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_hugging_face_model_trains_bit_identical_to_eager(model_name, opt_name):
    eager, opt_e, losses_e, compiled, opt_c, losses_c, step = eager_and_compiled(
        MODELS[model_name](), OPTIMIZERS[opt_name], token_batches(10),
        step_fn=hf_train_step, make_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5))
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    assert step.trace_count == (2 if opt_name == "sgd" else 1)
    # SDPA became graphoffload's attention op (one forward, one backward node per layer)
    targets = [str(n.target) for n in step.train_graph.graph.nodes]
    assert sum("graphoffload.attention.default" in t for t in targets) == 2
    assert sum("graphoffload.attention_backward.default" in t for t in targets) == 2


def test_llama_graph_carries_the_small_grouped_key_value_heads():
    model = hf_llama()
    _, _, _, _, _, _, step = eager_and_compiled(model, OPTIMIZERS["adamw"], token_batches(1), step_fn=hf_train_step)
    for node in step.train_graph.graph.nodes:
        if str(node.target) == "graphoffload.attention.default":
            q, k, v = (a.meta["val"] for a in node.args[:3])
            assert q.shape[1] == 4 and k.shape[1] == v.shape[1] == 2
