"""Activation checkpointing as users write it (`torch.utils.checkpoint`, Hugging Face's
`gradient_checkpointing_enable`) inside a compiled step: the graph recomputes the checkpointed
blocks in backward, trains like eager, draws the same dropout masks, and predicts a lower peak."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import (assert_training_matches, eager_and_compiled, hf_gpt2, hf_llama, hf_train_step, run_steps,
                     token_batches)
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import graphoffload

NON_REENTRANT = {"use_reentrant": False}


class Block(nn.Module):
    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.dropout = dropout

    def forward(self, x):
        h = F.dropout(F.gelu(self.up(self.norm(x))), self.dropout, self.training)
        return x + F.dropout(self.down(h), self.dropout, self.training)


class Mlp(nn.Module):
    """Residual MLP blocks, each optionally run under torch.utils.checkpoint."""

    def __init__(self, width: int = 32, depth: int = 3, dropout: float = 0.0, checkpointed: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.checkpointed = checkpointed

    def forward(self, x, y):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def mlp_step(model, optimizer, batch):
    loss = model(batch["x"], batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def mlp_batches(n: int, rows: int = 64, width: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, width, generator=g), "y": torch.randn(rows, generator=g)} for _ in range(n)]


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _peak(model, step_fn, batch, stage="captured") -> int:
    step = graphoffload.offload_compile(step_fn)
    model = copy.deepcopy(model)
    step.compile(model, adamw(model), batch)
    return step.memory(stage).peak


def test_checkpointed_blocks_are_recomputed_in_backward_and_train_bit_identical():
    torch.manual_seed(0)
    model = Mlp()
    eager, opt_e, losses_e, compiled, opt_c, losses_c, step = eager_and_compiled(
        model, adamw, mlp_batches(4), step_fn=mlp_step)
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    graph = step.graphs["captured"].graph
    recomputed = [n for n in graph.nodes if "recompute" in n.meta]
    # every block runs again in backward, each recomputed node paired with the forward node it repeats
    regions = {n.meta["recompute"] for n in recomputed}
    assert regions == {f"blocks.{i} (Block)" for i in range(3)}
    nodes = {n.name: n for n in graph.nodes}
    mms = [n for n in recomputed if n.target is torch.ops.aten.addmm.default]
    # `up` only: what backward needs is recomputed, and `down`'s output is needed by no gradient
    # (checkpoint stops the recompute early, as eagerly)
    assert len(mms) == 3
    for n in mms:
        assert n.meta["phase"] == "backward"
        twin = nodes[n.meta["recompute_of"]]
        assert twin.meta["phase"] == "forward" and twin.target is n.target
    assert any("recomputed in backward (activation checkpointing): blocks.0 (Block)" in line
               for line in step.explain(file=None).splitlines())
    listing = step.print_graph("captured", file=io.StringIO())
    assert f"recompute of {mms[0].meta['recompute_of']} in {mms[0].meta['recompute']}" in listing


def test_checkpointing_lowers_the_predicted_peak():
    torch.manual_seed(0)
    plain = Mlp(width=64, depth=4, checkpointed=False)
    ckpt = copy.deepcopy(plain)
    ckpt.checkpointed = True
    batch = mlp_batches(1, rows=512, width=64)[0]
    for stage in ("captured", "final"):
        with_ckpt, without = _peak(ckpt, mlp_step, batch, stage), _peak(plain, mlp_step, batch, stage)
        # each block keeps its (rows, 4 * width) hidden activations without checkpointing
        assert with_ckpt < without - 2 * 512 * 256 * 4, (stage, with_ckpt, without)


class NoisyBlock(Block):
    """Noise from `torch.rand(shape)` (a random op with no tensor input) feeding the GELU, whose
    backward needs the noisy value: the recompute draws it again."""

    def forward(self, x):
        h = self.up(self.norm(x))
        h = F.gelu(h + 0.1 * torch.rand(h.shape))
        return x + F.dropout(self.down(h), self.dropout, self.training)


@pytest.mark.parametrize("noise", [False, True], ids=["dropout", "dropout+rand"])
def test_dropout_under_recompute_draws_the_forward_masks(noise):
    torch.manual_seed(0)
    model = Mlp(dropout=0.2)
    if noise:
        model.blocks = nn.ModuleList(NoisyBlock(32, 0.2) for _ in range(3))
    batches = mlp_batches(4)
    eager, compiled = model, copy.deepcopy(model)
    opt_e, opt_c = adamw(eager), adamw(compiled)
    step = graphoffload.offload_compile(mlp_step)
    torch.manual_seed(5)
    losses_e = run_steps(mlp_step, eager, opt_e, batches)
    after_eager = torch.rand(3)
    torch.manual_seed(5)
    losses_c = run_steps(step, compiled, opt_c, batches)
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    # the generator ends where eager leaves it (the recompute's draws are put back)
    assert torch.equal(torch.rand(3), after_eager)
    graph = step.graphs["captured"].graph
    random = [n for n in graph.nodes if n.target in (torch.ops.aten.bernoulli_.float, torch.ops.aten.rand.default)]
    # per block two random ops (two dropouts, or the noise and one dropout), drawn again in the recompute
    assert sum("recompute" in n.meta for n in random) == sum("recompute" not in n.meta for n in random) == 3 * 2
    assert sum(n.target is torch.ops.graphoffload.swap_rng_state.default for n in graph.nodes) == 2 * 3


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveMlp(Mlp):
    def forward(self, x, y):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))
        return F.mse_loss(self.head(x).squeeze(-1), y)


def test_selective_checkpointing_policy_decides_what_is_recomputed():
    torch.manual_seed(0)
    model = SelectiveMlp(width=64)
    batches = mlp_batches(3, rows=256, width=64)
    eager, opt_e, losses_e, compiled, opt_c, losses_c, step = eager_and_compiled(
        model, adamw, batches, step_fn=mlp_step)
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    recomputed = [n for n in step.graphs["captured"].graph.nodes if "recompute" in n.meta]
    targets = {n.target for n in recomputed}
    # the policy saves the matmuls and recomputes the rest (norms, GELU)
    assert torch.ops.aten.addmm.default not in targets
    assert {torch.ops.aten.gelu.default, torch.ops.aten.native_layer_norm.default} <= targets
    assert all(n.meta["phase"] == "backward" for n in recomputed)
    plain = copy.deepcopy(model)
    plain.__class__, plain.checkpointed = Mlp, False
    assert step.memory("captured").peak < _peak(plain, mlp_step, batches[0])


def test_reentrant_checkpoint_is_refused_with_what_to_do():
    class Reentrant(Mlp):
        def forward(self, x, y):
            x = self.blocks[0](x)   # so the checkpointed blocks' input requires grad
            for block in self.blocks[1:]:
                x = checkpoint(block, x, use_reentrant=True)
            return F.mse_loss(self.head(x).squeeze(-1), y)

    torch.manual_seed(0)
    model = Reentrant()
    step = graphoffload.offload_compile(mlp_step)
    with pytest.raises(graphoffload.UnsupportedError, match="use_reentrant=False") as info:
        step(model, adamw(model), mlp_batches(1)[0])
    assert "test_checkpointing.py" in str(info.value)   # the user's backward line


# --------------------------------------------------------------------------- Hugging Face


def _padded_batches(n: int) -> list[dict]:
    """Token batches whose first row starts with two padding tokens: with a padding mask, Hugging
    Face builds the same explicit attention mask eagerly and under tracing (without one it
    relies on `is_causal` eagerly but materialises the mask under tracing: other kernels)."""
    out = []
    for b in token_batches(n):
        mask = torch.ones_like(b["input_ids"])
        mask[0, :2] = 0
        labels = b["labels"].masked_fill(mask == 0, -100)
        out.append({**b, "attention_mask": mask, "labels": labels})
    return out


def hf_masked_step(model, optimizer, batch):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.loss


@pytest.mark.parametrize("make_model", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_hugging_face_gradient_checkpointing_trains_bit_identical_with_a_lower_peak(make_model):
    import transformers  # noqa: F401  (in the `test` extra: missing fails rather than skips)
    plain = make_model()
    model = copy.deepcopy(plain)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    batches = _padded_batches(3)
    eager, opt_e, losses_e, compiled, opt_c, losses_c, step = eager_and_compiled(
        model, adamw, batches, step_fn=hf_masked_step)
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    graph = step.graphs["captured"].graph
    regions = {n.meta["recompute"] for n in graph.nodes if "recompute" in n.meta}
    assert len(regions) == 2   # one per decoder layer
    # the recompute runs graphoffload's attention op again, as the forward did
    attention = [n for n in graph.nodes if n.target is torch.ops.graphoffload.attention.default]
    assert sum("recompute" in n.meta for n in attention) == 2 and len(attention) == 4
    plain.train()
    assert step.memory("captured").peak < _peak(plain, hf_masked_step, batches[0])


# --------------------------------------------------------------------------- sequence parallelism


def _checkpointed_gpt_under_sequence_parallelism(rank, world):
    from gpt import GPT, GPTConfig

    class CheckpointedGPT(GPT):
        def forward(self, idx, labels):
            x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), labels.flatten())

    def gpt_step(model, optimizer, batch):
        loss = model(batch["input_ids"], batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    torch.manual_seed(0)
    eager = CheckpointedGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)).double()
    model = copy.deepcopy(eager)
    opt_e, opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, model))
    step = graphoffload.offload_compile(gpt_step, sequence_parallel=graphoffload.SequenceParallel(timeout_s=60))
    for batch in token_batches(3):
        want, got = gpt_step(eager, opt_e, batch), step(model, opt, batch)
        assert torch.allclose(got, want, rtol=1e-10, atol=0), (got, want)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert (p - q).abs().max().item() <= 1e-10
    graph = step.graphs["final"].graph
    ring = [n for n in graph.nodes if n.target is torch.ops.graphoffload.ring_attention.default]
    # each layer's attention runs as ring attention in the forward and again in its recompute
    assert len(ring) == 4 and sum("recompute" in n.meta for n in ring) == 2
    assert torch.ops.graphoffload.attention.default not in {n.target for n in graph.nodes}


@pytest.mark.slow   # several processes
def test_checkpointed_blocks_under_sequence_parallelism_match_eager():
    from ring_dist import run_ranks

    run_ranks(_checkpointed_gpt_under_sequence_parallelism, 2, deadline_s=240)


def test_llama_gradient_checkpointing_without_padding_matches_eager_to_rounding():
    # no padding mask: eagerly Hugging Face passes is_causal to SDPA, under tracing it builds the
    # causal mask (use_cache=False, which checkpointing implies): another kernel, same math
    import transformers  # noqa: F401  (in the `test` extra: missing fails rather than skips)
    model = hf_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    eager, opt_e, losses_e, compiled, opt_c, losses_c, step = eager_and_compiled(
        model, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True), token_batches(3),
        step_fn=hf_train_step)
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=False)
    assert sum("recompute" in n.meta for n in step.graphs["captured"].graph.nodes) > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dropout_under_recompute_on_cuda_draws_the_forward_masks():
    # CUDA's generator is philox (a seed and an offset): the recompute rewinds the offset
    torch.manual_seed(0)
    model = Mlp(dropout=0.2).cuda()
    batches = [{k: v.cuda() for k, v in b.items()} for b in mlp_batches(3)]
    eager, compiled = model, copy.deepcopy(model)
    opt_e, opt_c = adamw(eager), adamw(compiled)
    step = graphoffload.offload_compile(mlp_step)
    torch.manual_seed(5)
    losses_e = run_steps(mlp_step, eager, opt_e, batches)
    after_eager = torch.rand(3, device="cuda")
    torch.manual_seed(5)
    losses_c = run_steps(step, compiled, opt_c, batches)
    assert_training_matches(eager, opt_e, losses_e, compiled, opt_c, losses_c, exact=True)
    assert torch.equal(torch.rand(3, device="cuda"), after_eager)
