"""Train a small character-level GPT with a graphoffload-compiled train step.

    python examples/train_gpt.py                      # Python's own standard library as the corpus
    python examples/train_gpt.py --data input.txt     # any text file
    python examples/train_gpt.py --steps 3000 --layers 6 --d-model 256 --seq-len 256

Runs on CUDA when available, else on the CPU. The default corpus needs no download: the
source files of the Python standard library this interpreter runs on, read at start-up. The
whole step — forward, backward, AdamW — is one captured graph; the lr schedule runs outside
it (the learning rate is a graph input, so changing it does not re-trace).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig  # noqa: E402

import graphoffload  # noqa: E402


def stdlib_corpus(max_bytes: int) -> bytes:
    """Concatenated .py files of the standard library, in a fixed order, up to max_bytes."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(directory, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


def load_corpus(args: argparse.Namespace) -> torch.Tensor:
    if args.data:
        with open(args.data, "rb") as f:
            data = f.read()
    else:
        data = stdlib_corpus(args.corpus_mb * 1024 * 1024)
    if len(data) < 2 * (args.seq_len + 1):
        raise SystemExit(f"the corpus has {len(data)} bytes; it needs at least {2 * (args.seq_len + 1)}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()   # bytes as tokens: vocab 256


class Bar:
    """tqdm when it is installed, else a one-line text bar."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.tqdm = tqdm(total=total, unit="step") if tqdm else None
        self.total, self.n, self.start = total, 0, time.perf_counter()

    def update(self, loss: float) -> None:
        self.n += 1
        if self.tqdm is not None:
            self.tqdm.set_postfix(loss=f"{loss:.3f}")
            self.tqdm.update()
            return
        width = 30
        done = width * self.n // self.total
        rate = self.n / max(time.perf_counter() - self.start, 1e-9)
        print(f"\r[{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} loss {loss:.3f} "
              f"{rate:.1f} step/s", end="", flush=True)

    def write(self, text: str) -> None:
        if self.tqdm is not None:
            self.tqdm.write(text)
        else:
            print("\r" + text.ljust(70), flush=True)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
        else:
            print()


@graphoffload.offload_compile
def train_step(model, optimizer, batch):
    loss = model(batch["input_ids"], labels=batch["labels"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", help="a text file to train on (default: the Python standard library's source)")
    p.add_argument("--corpus-mb", type=int, default=4, help="size of the default corpus")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50, help="steps of linear lr warm-up before cosine decay")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = load_corpus(args)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95),
                            fused=device.type in ("cuda", "cpu"))
    warmup = max(1, min(args.warmup, args.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / max(1, args.steps)))))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{len(data) / 1e6:.2f} MB of text ({'--data ' + args.data if args.data else 'Python stdlib source'}), "
          f"{n_params / 1e6:.2f} M parameters, device {device}")

    def batch() -> dict:
        start = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,))
        x = torch.stack([data[s:s + args.seq_len + 1] for s in start.tolist()]).to(device)
        return {"input_ids": x[:, :-1], "labels": x[:, 1:]}

    bar = Bar(args.steps)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        loss = train_step(model, opt, batch())
        sched.step()
        losses.append(loss.item())
        bar.update(losses[-1])
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            recent = losses[-args.log_every:]
            bar.write(f"step {step + 1:5d}  loss {sum(recent) / len(recent):.4f}  lr {sched.get_last_lr()[0]:.2e}")
    bar.close()
    elapsed = time.perf_counter() - start
    first, last = losses[0], sum(losses[-10:]) / len(losses[-10:])
    print(f"loss {first:.3f} -> {last:.3f} in {args.steps} steps, {elapsed:.1f} s "
          f"({train_step.trace_count} trace{'s' if train_step.trace_count != 1 else ''})")
    return last


if __name__ == "__main__":
    main()
