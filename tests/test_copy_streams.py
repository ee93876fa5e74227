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


def test_a_carried_write_back_blocks_nobody_but_its_readers():
    """Item 7, the device path's end-of-step wait: `carry_host_write` returns while the copy is
    in flight (under the sanitizer, its destination still holds poison), the next prefetch of
    that host memory waits for it (it reads the landed values, not the poison), and
    `synchronize()` lands it on the host."""
    from graphoffload.runtime.host_offload import OffloadRuntime
    from graphoffload.runtime.sanitizer import Sanitizer

    runtime = OffloadRuntime(torch.device("cpu"), sanitizer=Sanitizer(seed=0, min_delay_s=0.2, max_delay_s=0.25))
    try:
        state = torch.arange(6, dtype=torch.float32)
        host, other = torch.zeros(6), torch.ones(6)
        with runtime.active():
            ticket = runtime.copy_to_host([state], [host])
            runtime.carry_host_write(ticket, [host])
            assert host.isnan().all(), "carry_host_write waited for the copy: the host blocked"
        assert runtime.in_flight
        with runtime.active():   # the next step
            *fetched, ticket = runtime.prefetch([host, other])
            runtime.wait_device(ticket)
        assert torch.equal(fetched[0], state), "the prefetch read the host memory before its write-back landed"
        assert torch.equal(fetched[1], other)
        runtime.synchronize()
        assert not runtime.in_flight and torch.equal(host, state)
    finally:
        runtime.shutdown()


def test_overlap_next_step_carries_device_path_write_backs_and_trains_as_eager():
    """With Offload(overlap_next_step=True) the device-path buckets end in carry_host_write, not
    wait_host; under the sanitizer (late, poisoned copies) five steps still equal eager, and the
    optimizer's state_dict() between steps (which synchronizes) shows eager's state."""
    torch.manual_seed(0)
    eager = GPT(TINY)
    compiled = GPT(TINY)
    compiled.load_state_dict(eager.state_dict())
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, fused=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-3, fused=True)
    step = graphoffload.offload_compile(train_step, offload=Offload(
        device_updates=1, calibration=BALANCED, overlap_next_step=True), config=CompileConfig(
        sanitize=True, fuse_optimizer=FuseOptimizer(bucket_numel=4096)))
    for i, batch in enumerate(token_batches(5)):
        torch.testing.assert_close(step(compiled, opt_c, batch), train_step(eager, opt_e, batch),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i}: {m}")
        if i == 2:
            saved = opt_c.state_dict()["state"]
            for j, p in enumerate(eager.parameters()):
                torch.testing.assert_close(saved[j]["exp_avg"], opt_e.state[p]["exp_avg"], rtol=1e-5, atol=1e-7)
    targets = {n.target for n in step.last.graph.graph.nodes}
    assert ops.carry_host_write.default in targets and ops.wait_host.default not in targets
    step.synchronize()
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(pc, pe, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
