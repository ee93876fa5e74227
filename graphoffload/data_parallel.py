"""`ZeRO`: data parallelism with the optimizer state (stage 1) and the gradients (stage 2)
sharded over the ranks of a group (Rajbhandari et al., 2020), done by the `zero` pass.

    zero = graphoffload.ZeRO(stage=2, group=None)    # None: the world group
    step = graphoffload.offload_compile(train_step, data_parallel=zero)
    loss = step(model, opt, my_micro_batch)          # each rank passes its own micro-batch

Gradients are averaged over the group, as with DDP, and the returned loss is the rank's own.
Each rank owns whole parameters, chosen per gradient bucket so that every rank owns about 1/N
of each bucket (`bucket_owners`): it keeps optimizer state only for those (`optimizer.state`
has entries for its own parameters only, as torch's ZeroRedundancyOptimizer keeps it), updates
only those, and the updated parameters are all-gathered, so every rank ends the step with the
same full parameters. Stage 1 all-reduces every gradient; stage 2 reduce-scatters each bucket,
so a rank keeps only its own parameters' gradients.

Not yet: stage 3, ZeRO with `offload=`, `sequence_parallel=` or `accumulation_steps`, and the
optimizer state as DTensors (the issue's convention); each is refused with an
`UnsupportedError` that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from graphoffload.errors import RankTimeoutError, UnsupportedError
from graphoffload.groups import OverGroup


@dataclass(frozen=True)
class ZeRO(OverGroup):
    """ZeRO data parallelism over a process group (the `zero` pass).

    Attributes:
        stage: 1 shards the optimizer state (gradients all-reduced, each rank updates its own
            parameters, then they are all-gathered); 2 also the gradients (each bucket
            reduce-scattered to the parameters' owners). 3 (parameters sharded too) is not
            supported yet.
        group: the torch.distributed process group; None: the default (world) group.
        bucket_numel: most elements of gradients one collective covers (buckets follow the
            order gradients are produced in backward); ownership is balanced within each bucket.
        timeout_s: seconds a rank waits for the others to start a step, and in each collective
            of the step (they run over a group of the step's own with this timeout), before
            raising `RankTimeoutError`, so a rank that failed, never calls, or fails inside the
            step makes the others fail rather than hang.
    """

    stage: int = 1
    group: Any = None
    bucket_numel: int = 4 * 1024 * 1024
    timeout_s: float = 300.0

    parallelism: ClassVar[str] = "ZeRO data parallelism"
    timeout_error: ClassVar[type[Exception]] = RankTimeoutError
    same_shapes_hint: ClassVar[str] = ("Every rank must pass a micro-batch of the same shapes and dtypes "
                                       "(pad or drop the last, smaller batch).")

    def __post_init__(self) -> None:
        if self.stage == 3:
            raise UnsupportedError("ZeRO stage 3 (parameters sharded between steps) is not supported yet; "
                                   "use ZeRO(stage=1) or ZeRO(stage=2)")
        if self.stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2 (3 is not supported yet), got {self.stage!r}")
        if self.bucket_numel <= 0:
            raise ValueError("bucket_numel must be positive")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")


def bucket_owners(buckets: Sequence[Sequence[int]], world: int) -> list[list[int]]:
    """The owning rank of every item of every bucket (items given by their sizes).

    Greedy, largest item first (as torch's ZeroRedundancyOptimizer partitions parameters): each
    goes to the rank holding the fewest elements of this bucket so far, ties to the one holding
    the fewest overall, then the lowest rank. Every rank then owns about 1/N of each bucket (so
    a bucket's padded reduce-scatter and all-gather move little more than the bucket) and of
    the whole. Deterministic: every rank computes the same owners from the same sizes."""
    total = [0] * world
    owners = []
    for sizes in buckets:
        here = [0] * world
        owner = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            r = min(range(world), key=lambda r: (here[r], total[r], r))
            owner[i] = r
            here[r] += sizes[i]
            total[r] += sizes[i]
        owners.append(owner)
    return owners
