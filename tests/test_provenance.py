"""Every node records the pass that created it (meta["pass"]), for every built-in pass: the
manager stamps what a pass creates through fx's node-creation hook, so a pass that copies
another node's meta (fuse_optimizer splitting a foreach kernel) cannot carry "capture" over."""

from __future__ import annotations

import torch
from gpt import GPT
from steps import TINY, foreach_clipped_step, token_batches
from test_offload_planner import BALANCED

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload
from graphoffload.passes import BUILTIN_PASSES


def assert_every_node_names_its_maker(graphs) -> set[str]:
    """Stage by stage: a node new in a pass's stage carries that pass's name; a node it kept
    keeps the name it had. Returns the passes whose stage was checked."""
    before = {n.name: n.meta["pass"] for n in graphs["captured"].graph.nodes}
    assert set(before.values()) == {"capture"}
    checked = set()
    for stage, graph in graphs.items():
        if stage in ("captured", "final"):
            continue
        now = {n.name: n.meta["pass"] for n in graph.graph.nodes}
        for name, made_by in now.items():
            expected = before.get(name, stage)
            assert made_by == expected, f"{stage}: node {name} stamped {made_by!r}, expected {expected!r}"
        before = now
        checked.add(stage)
    return checked


def test_every_built_in_pass_stamps_exactly_the_nodes_it_created():
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    config = CompileConfig(fuse_optimizer=FuseOptimizer(bucket_numel=4096, park_gradients=True))
    step = graphoffload.offload_compile(foreach_clipped_step, config=config,
                                        offload=Offload(device_updates=2, calibration=BALANCED))
    step(model, opt, token_batches(1, TINY.vocab_size, TINY.seq_len)[0])
    checked = assert_every_node_names_its_maker(step.graphs)
    # ring_attention: tests/test_ring_attention_step.py; zero: tests/test_zero.py (one rank's rewrite)
    assert checked == set(BUILTIN_PASSES) - {"ring_attention", "zero"}
    # fuse_optimizer's split of the foreach update kernels is its own work
    fused = step.graphs["fuse_optimizer"].graph.nodes
    assert any(n.meta["pass"] == "fuse_optimizer" and n.meta.get("phase") == "optimizer" for n in fused)
