"""Device memory the liveness analysis does not see (issue 12, item 3): modelled terms.

On CUDA the caching allocator also holds cuBLAS workspaces, attention backward's fp32
accumulator and blocks `record_stream` keeps until their copy ends; the budget check adds them
to the predicted peak. The terms come from shapes, so they are checked here on a CPU-traced
graph; tests/test_offload_cuda.py compares the total with what a GPU measures.
"""

from __future__ import annotations

import torch
from gpt import GPT
from steps import TINY, token_batches, train_step

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload
from graphoffload.passes.offload_optimizer import CUDA_WORKSPACE_RESERVE, unseen_device_bytes


def test_unseen_device_memory_terms_follow_the_graph():
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(train_step, offload=Offload(device_updates="never"),
                                        config=CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=4096)))
    batch = token_batches(1)[0]
    graph = step.compile(model, optimizer, batch).graph
    assert set(unseen_device_bytes(graph, torch.device("cpu")).values()) == {0}
    terms = unseen_device_bytes(graph, torch.device("cuda"))
    batch_size, seq = batch["input_ids"].shape
    # dq's fp32 accumulator: batch x heads x sequence x head dim x 4 bytes
    assert terms["attention_backward"] == batch_size * TINY.n_head * seq * (TINY.d_model // TINY.n_head) * 4
    assert terms["cublas_workspace"] == CUDA_WORKSPACE_RESERVE
    # this graph's copies read CPU tensors: nothing on a device is held for them
    assert terms["copy_held"] == 0
