"""`SequenceParallel`: split the sequence of a compiled train step across the ranks of a group.

    sp = graphoffload.SequenceParallel(group=None, layout="zigzag")   # None: the world group
    step = graphoffload.offload_compile(train_step, sequence_parallel=sp)
    loss = step(model, opt, batch)

The `ring_attention` pass rewrites the captured step: each rank keeps 1/N of the sequence from
the token embedding on, attention runs as ring attention, position-dependent tensors (position
ids, rotary tables, position embeddings, shifted labels) are computed on the full sequence and
sharded where they first meet a sharded tensor, the loss is the mean over every rank's tokens,
and parameter gradients are all-reduced over the group, so every rank applies the same update.

Two ways to feed the batch (both give the same result):
  * ``batch="full"`` (default): every rank passes the whole batch; the graph takes its part.
  * ``batch="sharded"``: each rank passes ``sp.shard(batch)``, its own part of every tensor's
    sequence dimension; the compiled step gathers the (small, integer) token tensors back to
    full length before the graph runs, so labels shifted inside the model keep their targets.

Every call first checks that the ranks pass tensors of the same shapes and dtypes, and the
first call with ``batch="full"`` that they pass the same batch (`RankAgreement`: one small
all-gather over gloo). With ZeRO over the other dimension of a mesh (`data_parallel=`), the
ranks of each sp group split one micro-batch: the batch is checked over the sp group, the shapes
over both groups (one `RankAgreement` each), and the gradients are left to the `zero` pass.
"""

from __future__ import annotations

import datetime
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist

from graphoffload.errors import RingTimeoutError, StateError, describe
from graphoffload.groups import OverGroup
from graphoffload.ops.ring_attention import LAYOUTS, shard, unshard
from graphoffload.torch_private import pytree


@dataclass(frozen=True)
class SequenceParallel(OverGroup):
    """Sequence parallelism over a process group (the `ring_attention` pass).

    Attributes:
        group: the torch.distributed process group, or a 1-D `DeviceMesh` (one dimension of a
            mesh, e.g. ``mesh["sp"]``, with ZeRO and sequence parallelism together); None: the
            default (world) group.
        layout: ``"zigzag"`` (rank r holds chunks r and 2N-1-r of 2N, balancing causal work)
            or ``"contiguous"`` (rank r holds chunk r of N).
        batch: ``"full"`` (every rank passes the whole batch) or ``"sharded"`` (each rank
            passes ``sp.shard(batch)``).
        seq_dim: the sequence dimension of the batch's tensors.
        timeout_s: seconds a rank waits for the others to start a step, for a ring exchange
            and in each gradient all-reduce (they run over a group of the step's own with this
            timeout) before raising, so a failed rank makes every rank fail rather than hang.
        bucket_numel: most elements of parameter gradients one all-reduce covers (buckets
            follow the order gradients are produced, so updates can start inside backward).
    """

    group: Any = None
    layout: Literal["zigzag", "contiguous"] = "zigzag"
    batch: Literal["full", "sharded"] = "full"
    seq_dim: int = 1
    timeout_s: float = 300.0
    bucket_numel: int = 4 * 1024 * 1024

    parallelism: ClassVar[str] = "sequence parallelism"
    timeout_error: ClassVar[type[Exception]] = RingTimeoutError
    same_shapes_hint: ClassVar[str] = ("Every rank must pass the same shapes: with batch='full' the whole batch, "
                                       "with batch='sharded' sp.shard(batch) of equal-shaped batches.")

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be {' or '.join(map(repr, LAYOUTS))}, got {self.layout!r}")
        if self.batch not in ("full", "sharded"):
            raise ValueError(f"batch must be 'full' or 'sharded', got {self.batch!r}")
        if self.bucket_numel <= 0:
            raise ValueError("bucket_numel must be positive")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    # ------------------------------------------------------------------ batches

    def shard(self, batch: Any) -> Any:
        """This rank's part of every tensor in `batch` (a pytree) along `seq_dim`."""
        rank, world = self.rank, self.world_size
        return pytree.tree_map(lambda x: shard(x, self.seq_dim, self.layout, rank, world)
                               if isinstance(x, torch.Tensor) and x.dim() > self.seq_dim else x, batch)

    def gather(self, batch: Any) -> Any:
        """Inverse of `shard`: every rank's parts of each tensor, put back in sequence order."""
        group, world = self.process_group(), self.world_size

        def full(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or x.dim() <= self.seq_dim:
                return x
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return unshard(parts, self.seq_dim, self.layout)
        return pytree.tree_map(full, batch)

    def prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The step's arguments as the graph takes them: full-length batch tensors."""
        if self.batch == "full":
            return args, kwargs
        return self.gather((args, kwargs))


class RankAgreement:
    """Checks before every call that all ranks of a parallel step's group pass tensors of the
    same shapes and dtypes, and, under sequence parallelism with ``batch="full"``, on the first
    call that they pass the same batch.

    Ring attention exchanges equal blocks and ZeRO reduces equal buckets: a rank with another
    shape would fail inside a collective (gloo aborts the process) or wait forever, and a rank
    whose new shape alone makes it re-trace would talk to ranks that did not. Ranks given
    different full batches under sequence parallelism (a data loader sharded over those ranks)
    would train on a mix of sequences without any error. The check is one small all-gather a
    call over gloo (the group itself, or a gloo group beside an NCCL one), so it never waits for
    the GPU, except on the first call with ``batch="full"``, which reads the batch once; it names
    what differs on every rank, or raises the config's `timeout_error` after its `timeout_s`.

    `parallel`: a `SequenceParallel` or a `ZeRO` (anything `OverGroup` with `timeout_s`).
    """

    def __init__(self, parallel: Any):
        self.sp = parallel
        self.calls = 0
        self._group: dist.ProcessGroup | None = None

    def group(self) -> dist.ProcessGroup:
        group = self.sp.process_group()
        if "gloo" in str(dist.get_backend(group)):
            # not kept: a step that outlives destroy_process_group() must not keep the group alive
            # until interpreter exit, where gloo's threads abort the process as it is torn down
            return group
        if self._group is None:   # only the group's own ranks take part in creating it
            self._group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                         timeout=datetime.timedelta(seconds=self.sp.timeout_s),
                                         use_local_synchronization=True)
        return self._group

    def check(self, args: tuple, kwargs: dict) -> None:
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        inputs = [f"{tuple(x.shape)} {x.dtype}".replace("torch.", "") for x in tensors]
        contents = getattr(self.sp, "batch", None) == "full" and self.calls == 0
        mine = torch.tensor([zlib.crc32(repr(inputs).encode()),
                             _contents_digest(tensors) if contents else 0], dtype=torch.int64)
        every = self._gather(mine)
        what = self.sp.parallelism
        if any(d[0] != mine[0] for d in every):
            described: list[Any] = [None] * len(every)
            dist.all_gather_object(described, inputs, group=self.group())
            listed = "; ".join(f"rank {r}: {', '.join(i) or 'no tensors'}" for r, i in enumerate(described))
            raise StateError(f"{what}: the ranks pass step inputs of different shapes or dtypes "
                             f"({listed}). {self.sp.same_shapes_hint}")
        differ = [r for r, d in enumerate(every) if d[1] != mine[1]]
        if differ:
            raise StateError(f"{what}: rank {self.sp.rank} was given another batch than rank(s) "
                             f"{differ}. With batch='full' every rank of the group passes the same whole batch "
                             "and keeps its part of the sequence; do not shard the data loader over these "
                             "ranks (shard it over data-parallel replicas only).")
        self.calls += 1   # counted once agreed: a call refused above is checked again in full

    def _gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        group, world = self.group(), self.sp.world_size
        every = [torch.empty_like(mine) for _ in range(world)]
        try:
            ok = dist.all_gather(every, mine, group=group, async_op=True).wait(
                datetime.timedelta(seconds=self.sp.timeout_s))
        except Exception as exc:  # noqa: BLE001 - backends raise their own error types
            ok, cause = False, f" ({describe(exc)})"
        else:
            cause = ""
        if ok is False:
            raise self.sp.timeout_error(
                f"{self.sp.parallelism}: rank {self.sp.rank} of {world} waited {self.sp.timeout_s:g} s "
                f"for the other ranks to start the step: a rank failed or never called it{cause}")
        return every


def _contents_digest(tensors: list[torch.Tensor]) -> int:
    digest = 0
    for x in tensors:
        raw = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest = zlib.crc32(raw.numpy().tobytes(), digest)
    return digest
