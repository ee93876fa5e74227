"""The process-group side shared by the parallelism configs (`SequenceParallel`, `ZeRO`).

Each names its group the same way (None: the world group) and is asked the same questions by
its pass and by the compiled step (the group's name for functional collectives, this rank, the
group's size), so they resolve it in one place.

A compiled step's collectives do not run over the user's group but over a group of the step's
own (`step_group`), made over the same ranks with the config's `timeout_s`: a rank that dies or
raises between two collectives of a step then makes the others' next collective fail within
`timeout_s` (gloo: the timeout of every wait; NCCL: the watchdog's), not after the user's
group's timeout (gloo's default is 30 minutes), and `rank_failed` turns the backend's error into
the config's `RankTimeoutError`. The user's group keeps its own timeout for everything else.

A group one of whose collectives timed out, or that this rank left between two collectives of the
step (it raised after the first), is not used again (`BrokenGroups`): the wait that
timed out leaves the collective pending (gloo: the late rank's matching collective still pairs
with it; NCCL: the watchdog aborts the communicator, or, by torch's default, the process), so a
retry's collectives would pair with the other ranks' older ones (another op, other buffers:
wrong numbers, or another hang) rather than with their own; and the other ranks of a rank that
raised part-way are inside, or past, the step's later collectives, which its retry's would meet.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.distributed as dist

from graphoffload.errors import StateError, UnsupportedError, describe


class OverGroup:
    """Mixin of a frozen config dataclass with `group` (a process group or None) and
    `timeout_s` fields, and a `timeout_error` class attribute (a `RankTimeoutError`)."""

    group: Any
    timeout_s: float
    parallelism: ClassVar[str] = "this parallelism"   # how errors name it
    timeout_error: ClassVar[type[Exception]]

    def process_group(self) -> dist.ProcessGroup:
        """The group: `group` itself, the world group for None, or the group of a 1-D `DeviceMesh`
        (e.g. one dimension of a 2-D mesh, ``mesh["dp"]``), over this rank's slice of it."""
        if not dist.is_available() or not dist.is_initialized():
            raise UnsupportedError(f"{self.parallelism} needs torch.distributed: call "
                                   "torch.distributed.init_process_group() first (e.g. under torchrun)")
        if self.group is None:
            return dist.group.WORLD
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(self.group, DeviceMesh):
            if self.group.ndim != 1:
                raise UnsupportedError(
                    f"{type(self).__name__}(group=...) was given a {self.group.ndim}-D DeviceMesh "
                    f"{self.group.mesh_dim_names or ''}: pass one dimension of it, e.g. mesh['dp'] for data "
                    "parallelism and mesh['sp'] for sequence parallelism")
            return self.group.get_group()
        return self.group

    @property
    def group_name(self) -> str:
        return self.process_group().group_name

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group())

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group())

    def step_group(self) -> dist.ProcessGroup:
        """A new process group over the ranks of this config's group, in the same order and on
        the same backend, whose collectives time out after `timeout_s`. Every rank of the group
        must call this at the same point (a compiled step does when it first compiles)."""
        group = self.process_group()
        return dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                              timeout=datetime.timedelta(seconds=self.timeout_s),
                              use_local_synchronization=True)

    def rank_failed(self, exc: BaseException, where: str) -> Exception:
        """The error for `exc`, raised by the backend in a collective of the compiled step
        (`where`): another rank failed inside the step, or stopped answering."""
        group = self.process_group()
        timeout = f"{type(self).__name__}(timeout_s={self.timeout_s:g})"
        return self.timeout_error(
            f"{self.parallelism}: rank {self.rank} of {self.world_size} failed in a collective of the step "
            f"({where}) over the step's own group of global ranks {dist.get_process_group_ranks(group)} "
            f"(those of process group {group.group_name!r}, timing out after {timeout}): another rank raised "
            f"or died inside the step, or did not reach this collective in time ({describe(exc)}). Look at "
            "the other ranks' errors first. The group cannot be used again in this process: end every rank "
            "and restart the job from the last checkpoint (torchrun restarts the ranks with --max-restarts); "
            "raise timeout_s if a rank is merely slow.")


class BrokenGroups:
    """Whether a parallel step's groups are still usable, shared by the step and its executors:
    the first failure of one of the step's collectives (a `RankTimeoutError` of a call, of its
    input check at the start, of `synchronize()`'s gathers, or any failure of those gathers part-way)
    breaks them for good, and so does this rank's own failure while the graph runs (an op's error,
    KeyboardInterrupt, SystemExit) after the graph's first collective, or where the executor cannot
    locate it: the other ranks went on into later collectives, which a retry's would pair with
    (`Executor.break_if_past_a_collective`). A failure before the first collective breaks nothing.
    From then on `refuse` raises before any collective, naming the failure."""

    def __init__(self) -> None:
        self.failure: BaseException | None = None
        self._consequence = ""

    def break_with(self, failure: BaseException, consequence: str = "") -> None:
        """Record `failure` (the first one is kept); `consequence`: what it left behind, for the
        refusals' message (e.g. parameters holding this rank's updated rows beside old ones)."""
        if self.failure is None:
            self.failure, self._consequence = failure, consequence

    def refuse(self, what: str) -> None:
        """Raise `StateError` (its cause the failure) if the groups broke; nothing otherwise."""
        failure = self.failure
        if failure is None:
            return
        raise StateError(
            f"refusing to {what}: this step failed inside its collectives earlier in this process "
            f"({describe(failure)}){self._consequence}, and a group one of whose collectives failed or timed out, "
            "or that this rank left between two collectives, is not used again "
            "(the other ranks may still be inside, or on their way to, an older collective that a new one would "
            "pair with). End every rank and restart the job from the last checkpoint (torchrun restarts the "
            "ranks with --max-restarts); raise timeout_s if a rank is merely slow") from failure


@dataclass(frozen=True)
class MeshRankFailed:
    """`OverGroup.rank_failed` for a step over both dimensions of a mesh (ZeRO over `dp`,
    sequence parallelism over `sp`): a collective of the step failed over one of its three
    groups (dp, sp, or all the mesh's ranks); the error names each group's ranks."""

    dp: OverGroup
    sp: OverGroup

    def __call__(self, exc: BaseException, where: str) -> Exception:
        dp_ranks = dist.get_process_group_ranks(self.dp.process_group())
        sp_ranks = dist.get_process_group_ranks(self.sp.process_group())
        return self.dp.timeout_error(
            f"ZeRO data parallelism with sequence parallelism: rank {dist.get_rank()} of {dist.get_world_size()} "
            f"failed in a collective of the step ({where}) over one of the step's own groups: data-parallel global "
            f"ranks {dp_ranks} (timing out after ZeRO(timeout_s={self.dp.timeout_s:g})), sequence-parallel ranks "
            f"{sp_ranks} (SequenceParallel(timeout_s={self.sp.timeout_s:g})) or all ranks of the mesh (the longer "
            f"of the two): another rank raised or died inside the step, or did not reach this collective in time "
            f"({describe(exc)}). Look at the other ranks' errors first. The groups cannot be used again in this "
            "process: end every rank and restart the job from the last checkpoint (torchrun restarts the ranks "
            "with --max-restarts); raise timeout_s if a rank is merely slow.")


def check_orthogonal(dp_groups: list[list[int]], sp_groups: list[list[int]], world: int) -> None:
    """Data parallelism over one group and sequence parallelism over another (a 2-D mesh): every
    rank's pair of groups, `dp_groups[r]` and `sp_groups[r]` (global ranks), must cut the world
    into a grid: each rank in exactly one group of each kind, a group of one kind meeting each
    of the other in one rank, and dp size x sp size = world. Raises `UnsupportedError` naming
    both groups' ranks otherwise (a pure check, given every rank's groups)."""
    for r in range(world):
        dp, sp = sorted(dp_groups[r]), sorted(sp_groups[r])
        both = f"rank {r}'s data-parallel group has ranks {dp} and its sequence-parallel group ranks {sp}"
        problem = None
        if r not in dp or r not in sp:
            problem = "a rank must belong to both of its groups"
        elif set(dp) & set(sp) != {r}:
            problem = "they share ranks other than itself (the two groups must be different dimensions of a mesh)"
        elif len(dp) * len(sp) != world:
            problem = f"their sizes {len(dp)} x {len(sp)} are not the world size {world}"
        else:
            for q in dp:   # the same groups as seen by every rank named in them
                if sorted(dp_groups[q]) != dp:
                    problem = f"rank {q} is in it but names data-parallel ranks {sorted(dp_groups[q])}"
                    break
            for q in sp:
                if problem is None and sorted(sp_groups[q]) != sp:
                    problem = f"rank {q} is in it but names sequence-parallel ranks {sorted(sp_groups[q])}"
        if problem is not None:
            raise UnsupportedError(
                f"ZeRO data parallelism with sequence_parallel=: {both}: {problem}. The two groups must be "
                "the two dimensions of one device mesh, every rank in exactly one group of each: e.g. "
                "mesh = init_device_mesh(device, (dp, sp), mesh_dim_names=('dp', 'sp')), then "
                "ZeRO(group=mesh['dp']) and SequenceParallel(group=mesh['sp'])")


def check_mesh(dp: OverGroup, sp: OverGroup) -> None:
    """`check_orthogonal` on every rank's groups, gathered over the world (once, on a step's
    first call, before anything is traced; every rank of the job must call it). The gather is one
    small all-gather over gloo (the world group, or a gloo group beside an NCCL one) that waits at
    most the longer `timeout_s`, so a rank that never calls makes the others raise the dp
    config's `timeout_error` rather than hang."""
    import torch

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = torch.full((2, world), -1, dtype=torch.int64)
    for row, config in enumerate((dp, sp)):
        ranks = dist.get_process_group_ranks(config.process_group())
        mine[row, :len(ranks)] = torch.tensor(ranks, dtype=torch.int64)
    timeout = datetime.timedelta(seconds=max(dp.timeout_s, sp.timeout_s))
    group = dist.group.WORLD if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo", timeout=timeout)
    every = [torch.empty_like(mine) for _ in range(world)]
    try:
        ok = dist.all_gather(every, mine, group=group, async_op=True).wait(timeout)
        cause = ""
    except Exception as exc:  # noqa: BLE001 - backends raise their own error types
        ok, cause = False, f" ({describe(exc)})"
    if ok is False:
        raise dp.timeout_error(
            f"ZeRO data parallelism with sequence_parallel=: rank {rank} of {world} waited "
            f"{timeout.total_seconds():g} s for the other ranks to start the step's first call: a rank failed or "
            f"never called it{cause}")
    groups = [[[r for r in e[row].tolist() if r >= 0] for e in every] for row in (0, 1)]
    check_orthogonal(groups[0], groups[1], world)


def mesh_step_group(dp: OverGroup, sp: OverGroup) -> dist.ProcessGroup:
    """A step's group over the ranks of both dimensions of a mesh, which `check_mesh` made sure
    are the whole world (in rank order), on the dp group's backend, timing out after the longer
    of the two configs' `timeout_s`. Every rank calls it at the same point, after its two
    `step_group`s."""
    group = dp.process_group()
    return dist.new_group(list(range(dist.get_world_size())), backend=dist.get_backend(group),
                          timeout=datetime.timedelta(seconds=max(dp.timeout_s, sp.timeout_s)),
                          use_local_synchronization=True)
