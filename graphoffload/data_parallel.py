"""`ZeRO`: data parallelism with the optimizer state (stage 1), the gradients (stage 2) and the
parameters (stage 3) sharded over the ranks of a group (Rajbhandari et al., 2020), done by the
`zero` pass.

    zero = graphoffload.ZeRO(stage=2, group=None)    # None: the world group
    step = graphoffload.offload_compile(train_step, data_parallel=zero)
    loss = step(model, opt, my_micro_batch)          # each rank passes its own micro-batch

Gradients are averaged over the group, as with DDP, and the returned loss is the rank's own.
Every parameter is sharded along dim 0 the way FSDP2 (and DTensor's `Shard(0)`) shards it, with
`torch.chunk` semantics (`shard_rows`): chunks of ceil(d0/N) rows, the last ranks' chunks
shorter or empty. A rank updates its chunk of every parameter and keeps the optimizer state of
that chunk alone, and the updated chunks are all-gathered, so every rank ends the step with the
same full parameters. The state stays the user's: `optimizer.state[p]` holds DTensors over a
1-D mesh of the group, placement `Shard(0)` (`shard_state`), so `optimizer.state_dict()` and
torch.distributed.checkpoint save and load it (DCP reshards it to another world size); the step
counter stays a plain tensor, as torch.optim keeps it for an FSDP2 model. A 0-dim parameter
cannot be split: its state stays plain tensors, replicated, and every rank updates it alike
(a 0-dim `Replicate()` DTensor did not round-trip through DCP in our test, it loaded other
values, cause not found yet; plain tensors do).

This module holds the layout both the pass (which rewrites the graph to the chunks) and capture
(which creates the state) use, so they cannot disagree.

Stage 3 shards the parameters too: when the step first compiles, each parameter it updates
(but 0-dim ones) becomes an `nn.Parameter` holding a `Shard(0)` DTensor of this rank's rows
(`shard_parameter`), as FSDP2 leaves a model, and the graph gathers them before use.

A GradScaler and `skip_nonfinite=True` work with stages 1, 2 and 3: each rank checks its chunks
of the averaged gradients, and the flag is combined over the group (its maximum, one scalar
all-reduce), so every rank skips or applies the same update and the scale evolves alike; with
`offload=` too, because that combined flag is the `found_inf` the update kernels read before
`offload_optimizer` moves them to the host, so the host updates of each rank's chunks read it;
with accumulation_steps too (the updating call checks the reduced sums; skip_nonfinite's flag is
combined on the accumulating calls as well, so every rank counts the same calls in
`skipped_steps`, as one process counts them).

`accumulation_steps=k` works with stages 1, 2 and 3: gradients are reduced once per update (the
`zero` pass; each rank's running sums are whole gradients on the device, also with stage 3). With
`offload=` (ZeRO-Offload, any stage) each rank keeps its chunks' fp32 master weights and state in
host memory, still `Shard(0)` DTensors in `optimizer.state` (`as_shard`; runtime/host_state.py);
stage 3's host updates upload into the rank's rows, which its parameters' DTensors hold.
ZeRO-Offload accumulates too, its sums on the device as above, the updating call updating the
rank's chunks from its host state; or, with `Offload(accumulate_on="host")`, its sums this rank's
chunks in host memory, every call reduce-scattering its gradients (passes/zero.py).

With `sequence_parallel=` too (stages 1, 2 and 3) the two groups are the two dimensions of a
device mesh, `ZeRO(group=mesh["dp"])` and `SequenceParallel(group=mesh["sp"])` (`OverGroup`
takes a 1-D `DeviceMesh`; `groups.check_mesh` refuses groups that are not such a grid before
anything is traced): the ranks of an sp group split one micro-batch's sequence, and the
`ring_attention` pass leaves the parameter gradients as their partial sums, which the `zero`
pass reduces over both groups (stage 1: one all-reduce per bucket over a group of all the
mesh's ranks; stages 2-3: the reduce-scatter over dp, then this rank's part all-reduced over sp).
`accumulation_steps` works too: the running sums stay each rank's partial sums, reduced over both
groups once per update; or, with `offload=` and `Offload(accumulate_on="host")`, every call reduces
its gradients over both groups (reduce-scatter over dp, this rank's part all-reduced over sp) and
adds this rank's chunk into its host sum. An accumulating call has no update to say which
gradients are partial over sp, so ring attention lists those backward adds into the running sums
of the parameters the window's update updates (the ones the updating call's update reads); a
gradient whole over sp (a parameter read off the split sequence) is sent by sp rank 0 alone, as on
an updating call (with device sums it is refused: the sums hold partial sums). The state is sharded over dp alone: `Shard(0)` DTensors over a 1-D dp
mesh, the same on the ranks of an sp group (not a 2-D mesh DTensor with `Replicate()` over sp);
DCP saves and loads it on the same mesh (tests/test_zero_sequence_parallel.py). `offload=` works
with it too, as without `sequence_parallel=`, and so do a GradScaler and skip_nonfinite=True: their
flags, combined over the dp group alone, agree over sp too (the checks read chunks reduced over
both groups; the loss is ring attention's mean over the sp group's tokens).

`Offload(accumulate_on="auto")` with accumulation_steps is one choice for the whole step, not per
bucket (a bucket's placement would change its collectives: device sums reduced once per update,
host sums, this rank's chunks, every call): device sums when the accumulating call's predicted peak
with them fits the budget, else host sums (api.py, passes/host_accumulation.py `StepSums`), with
`sequence_parallel=` too (its trial peaks the max over both dimensions' ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from graphoffload.errors import RankTimeoutError, StateError
from graphoffload.groups import OverGroup


@dataclass(frozen=True)
class ZeRO(OverGroup):
    """ZeRO data parallelism over a process group (the `zero` pass).

    Attributes:
        stage: 1 shards the optimizer state (gradients all-reduced, each rank updates its
            chunk of every parameter, then the chunks are all-gathered); 2 also the gradients
            (each bucket reduce-scattered, so a rank receives its chunks' gradients alone).
            3 also the parameters: between steps each rank holds its `Shard(0)` rows of every
            parameter (the model's parameters become DTensors when the step first compiles),
            and the graph gathers each bucket of parameters before forward reads it and again
            before backward does (`passes/zero_params.py`).
        group: the torch.distributed process group, or a 1-D `DeviceMesh` (one dimension of a
            mesh, e.g. ``mesh["dp"]``, with ZeRO and sequence parallelism together); None: the
            default (world) group.
        bucket_numel: most elements of gradients one collective covers (buckets follow the
            order gradients are produced in backward); per bucket, one gradient collective
            and one all-gather.
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
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {self.stage!r}")
        if self.bucket_numel <= 0:
            raise ValueError("bucket_numel must be positive")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")


    def device_mesh(self, device_type: str) -> Any:
        """The 1-D DeviceMesh of the group (for the optimizer state's DTensors)."""
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.process_group(), device_type)


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, number of rows) of `rank`'s chunk of a dim 0 of `rows`, as `torch.chunk` and
    DTensor's `Shard(0)` split it: chunks of ceil(rows/world) rows, the last ranks' chunks
    shorter or empty (5 rows over 4 ranks: 2, 2, 1, 0)."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)


def local_chunk(param: Tensor, world: int, rank: int) -> Tensor:
    """`rank`'s chunk of `param` along dim 0, as a view (the parameter itself when 0-dim; the
    local tensor of a DTensor, which a ZeRO stage 3 step sharded already)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.to_local()
    if param.dim() == 0:
        return param
    start, rows = shard_rows(param.shape[0], world, rank)
    return param.narrow(0, start, rows)


def shard_state(state: dict[str, Any], param: Tensor, name: str, mesh: Any, world: int, rank: int) -> None:
    """Make the optimizer state of `param` (`optimizer.state[param]`) this rank's DTensors, in
    place: a plain tensor shaped like this rank's chunk (just created) is wrapped; one shaped
    like the whole parameter (e.g. loaded by `optimizer.load_state_dict` of a full checkpoint)
    is narrowed to the chunk (a copy, so the full tensor can be freed); a DTensor must already
    hold this rank's chunk. The step counter (0-dim, "step") stays a plain tensor, as
    torch.optim keeps it for an FSDP2 model, and so does the state of a 0-dim parameter
    (replicated, updated alike on every rank)."""
    from torch.distributed.tensor import DTensor, Shard

    if param.dim() == 0:   # replicated: plain tensors, which DCP saves once and loads on every rank
        return
    chunk = local_chunk(param.detach(), world, rank)
    placement = [Shard(0)]
    for key, value in list(state.items()):
        if key == "step" or not isinstance(value, Tensor):
            continue
        if isinstance(value, DTensor):
            local = value.to_local()
            if value.shape != param.shape or local.shape != chunk.shape or list(value.placements) != placement \
                    or value.device_mesh.size() != world:
                raise StateError(
                    f"optimizer state {key!r} of parameter {name} is a DTensor of shape {tuple(value.shape)} "
                    f"placed {list(value.placements)} over {value.device_mesh.size()} ranks with a local "
                    f"chunk of {tuple(local.shape)}, but this ZeRO step shards it {placement} over {world} "
                    f"ranks (this rank's chunk: {tuple(chunk.shape)}); load checkpoints of another world "
                    "size with torch.distributed.checkpoint, which reshards them")
            continue
        if value.shape == param.shape and value.shape != chunk.shape:
            local = local_chunk(value, world, rank).clone()
        elif value.shape == chunk.shape:
            local = value
        else:
            raise StateError(
                f"optimizer state {key!r} of parameter {name} has shape {tuple(value.shape)}, neither the "
                f"parameter's {tuple(param.shape)} nor this rank's chunk {tuple(chunk.shape)}; was a "
                "state_dict of another model loaded? Load a matching one")
        state[key] = as_shard(local, param, mesh)


def as_shard(local: Tensor, param: Tensor, mesh: Any) -> Any:
    """`local`, this rank's chunk of a tensor shaped like `param`, as the `Shard(0)` DTensor over
    `mesh` that `optimizer.state` holds (the local tensor itself is kept: writes to it land in the
    DTensor; it may live in host memory, with offload=, whatever the mesh's device). `local`
    should start its storage: torch gives the DTensor its storage offset, and `torch.save` and
    `copy.deepcopy` of a DTensor with a non-zero one fail ("invalid python storage"); the host
    arena's views are storages of their own for that reason."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())


def shard_parameter(param: Tensor, mesh: Any, world: int, rank: int) -> Tensor:
    """ZeRO stage 3: a new `nn.Parameter` holding a `Shard(0)` DTensor of `param` over `mesh`
    whose local tensor is a copy of this rank's rows (so the whole parameter can be freed),
    as FSDP2's `fully_shard` leaves a model's parameters."""
    from torch import nn

    local = local_chunk(param.detach(), world, rank).clone()
    return nn.Parameter(as_shard(local, param, mesh), requires_grad=param.requires_grad)
