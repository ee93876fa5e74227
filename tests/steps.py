"""Train steps, tiny configs and batches shared by the test modules."""

from __future__ import annotations

import torch
from gpt import GPTConfig

TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def train_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def hf_step(model, optimizer, batch):
    """The same for a Hugging Face causal LM (it shifts the labels itself)."""
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def zero_first_step(model, optimizer, batch):
    """optimizer.zero_grad() first: the gradients stay on .grad after the step."""
    optimizer.zero_grad()
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    optimizer.step()
    return loss


def clipped_step(model, optimizer, batch, max_norm: float = 0.5):
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def foreach_clipped_step(model, optimizer, batch, max_norm: float = 0.5):
    """clip_grad_norm_ as its foreach (GPU) path runs it: one norm and one scaling over all."""
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    optimizer.step()
    optimizer.zero_grad()
    return loss


def token_batches(n: int, vocab: int = 64, seq: int = 16, batch: int = 2, seed: int = 0) -> list[dict]:
    """`n` batches of random tokens whose labels are the next token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": x, "labels": torch.roll(x, -1, dims=1)})
    return out
