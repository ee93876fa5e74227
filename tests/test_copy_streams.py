"""Which stream each transfer waits on (issue 12, items 4 and 7), checked on the CPU.

On a GPU, prefetches (issued early by the graph thread) and CPU-path uploads (issued late by the
worker) run on separate host-to-device streams, so an upload never queues behind prefetches
issued before it; every transfer node carries the stream it runs on in `meta["stream"]`. Ring
exchanges on NCCL wait stream-ordered (no timeout polled on the host); on gloo they keep the
timeout that turns a dead rank into RingTimeoutError.
"""

from __future__ import annotations

import datetime

import pytest
import torch
from gpt import GPT
from steps import TINY, clipped_step, token_batches, train_step
from test_offload_planner import BALANCED

import graphoffload
from graphoffload import CompileConfig, FuseOptimizer, Offload
from graphoffload.runtime.host_offload import COPY_STREAMS
from graphoffload.runtime.ring_attention import _Ring

ops = torch.ops.graphoffload
EXPECTED = {ops.copy_to_host.default: "d2h", ops.prefetch_to_device.default: "h2d_prefetch",
            ops.copy_to_device.default: "h2d_upload"}


@pytest.mark.parametrize("step_fn, offload, park, streams", [
    (train_step, Offload(device_updates=2, calibration=BALANCED), False, {"d2h", "h2d_prefetch", "h2d_upload"}),
    (clipped_step, None, True, {"d2h", "h2d_prefetch"}),
], ids=["hybrid", "park-gradients"])
def test_every_transfer_node_names_its_stream(step_fn, offload, park, streams):
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(step_fn, offload=offload, config=CompileConfig(
        fuse_optimizer=FuseOptimizer(bucket_numel=4096, park_gradients=park)))
    graph = step.compile(model, optimizer, token_batches(1)[0])
    seen = set()
    for node in graph.graph.nodes:
        if node.target in EXPECTED:
            assert node.meta.get("stream") == EXPECTED[node.target], node.format_node()
            seen.add(node.meta["stream"])
        else:
            assert "stream" not in node.meta, node.format_node()
    assert seen == streams
    # the runtime makes one stream per name: uploads never queue behind prefetches
    assert len(set(COPY_STREAMS)) == len(COPY_STREAMS) and seen <= set(COPY_STREAMS)


class _Work:
    def __init__(self):
        self.calls = []

    def wait(self, *args):
        self.calls.append(args)
        return True


@pytest.mark.parametrize("stream_ordered", [True, False], ids=["nccl", "gloo"])
def test_ring_waits_poll_a_timeout_only_on_gloo(stream_ordered):
    ring = _Ring.__new__(_Ring)   # no process group needed to check how it waits
    ring.rank, ring.world, ring.prev, ring.next = 0, 2, 1, 1
    ring.timeout_s, ring.timeout = 5.0, datetime.timedelta(seconds=5)
    ring.stream_ordered = stream_ordered
    works = [_Work(), _Work()]
    ring.wait(works, "a block")
    assert all(w.calls == ([()] if stream_ordered else [(ring.timeout,)]) for w in works)
