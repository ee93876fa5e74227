"""A custom graph pass: round every gradient to bfloat16 before the optimizer uses it.

This simulates training with bf16 gradient communication (as a data-parallel job that
all-reduces in bf16 would see) without changing the model code: the pass finds each fused
optimizer update kernel in the captured step and routes each of its gradients through
`to(bfloat16).to(float32)`. Everything else in the step — forward, backward, the update
kernel itself — stays as it was.

    python examples/custom_pass.py

A pass is a plain function (TrainGraph, PassContext) -> TrainGraph; user passes run after the
built-in ones, and the PassManager stamps every node a pass creates with
`meta["pass"] = <its name>`, infers its shape/dtype (`meta["val"]`) and verifies the graph.
"""

from __future__ import annotations

import io
import os
import sys

import torch
from torch import fx

import graphoffload
from graphoffload import PassContext, TrainGraph

aten = torch.ops.aten
# the fused kernels graphoffload lowers optimizer.step() to; argument 1 is the gradient list
UPDATE_KERNELS = (aten._fused_adamw_, aten._fused_adam_, aten._fused_sgd_)


def _is_update(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in UPDATE_KERNELS


def cast_grads_to_bf16(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    """Feed each update kernel bf16-rounded copies of its float32 gradients."""
    rounded = 0
    for update in [n for n in graph.graph.nodes if _is_update(n)]:
        grads = list(update.args[1])
        new_grads = []
        with graph.graph.inserting_before(update):
            for grad in grads:
                if grad.meta["val"].dtype != torch.float32:
                    new_grads.append(grad)
                    continue
                low = graph.graph.call_function(aten._to_copy.default, (grad,), {"dtype": torch.bfloat16})
                back = graph.graph.call_function(aten._to_copy.default, (low,), {"dtype": torch.float32})
                for node in (low, back):
                    # gradient nodes name their parameter; the manager fills val, phase and pass
                    node.meta["param"] = grad.meta.get("param", update.meta.get("param"))
                new_grads.append(back)
                rounded += 1
        # only the update reads the rounded copies: a gradient returned on .grad stays exact
        update.update_arg(1, new_grads)
    graph.note("cast_grads_to_bf16", f"rounded {rounded} gradients to bfloat16 before their update")
    return graph


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)

    @graphoffload.offload_compile(passes=[cast_grads_to_bf16])
    def train_step(model, optimizer, batch):
        loss = model(batch["input_ids"], labels=batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    text = torch.arange(64).repeat(8)   # a repeating sequence the model can learn quickly
    for i in range(5):
        start = torch.randint(0, len(text) - 33, (4,))
        x = torch.stack([text[s:s + 33] for s in start])
        loss = train_step(model, opt, {"input_ids": x[:, :-1], "labels": x[:, 1:]})
        print(f"step {i}: loss {loss.item():.4f}")

    lines = train_step.print_graph("final", file=io.StringIO()).splitlines()
    added = [ln for ln in lines if "by cast_grads_to_bf16" in ln]
    print(f"\n{len(added)} nodes added by the pass, e.g.:")
    print("\n".join(added[:2]))
    print("\n".join(train_step.train_graph.notes["cast_grads_to_bf16"]))


if __name__ == "__main__":
    main()
