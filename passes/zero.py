"""zero: shard the optimizer update (ZeRO stage 1), the gradients (stage 2) and the parameters
(stage 3) over the ranks of a `ZeRO` group, each rank training on its own micro-batch, in the
FSDP2 layout.

The captured step computes this rank's gradients and updates every parameter. This pass cuts
every parameter along dim 0 as DTensor's `Shard(0)` does (`graphoffload.data_parallel.shard_rows`:
chunks of ceil(d0/N) rows, the last ranks' shorter or empty), so each rank updates 1/N of every
parameter rather than whole parameters of its own: the share is even whatever the sizes, and
the state is laid out as FSDP2 keeps it, which is what lets `optimizer.state_dict()` and DCP
save and load it. The gradients are cut into buckets in the order backward produces them
(`bucket_numel` elements at most, one dtype each); then, per bucket:

* **Gradients**, right after the bucket's last one is produced: stage 1 all-reduces them
  (`_c10d_functional.all_reduce_coalesced` + `wait_tensor`) and the update reads this rank's
  rows of each average (a view), as DDP leaves every rank every average; stage 2 packs them rank
  by rank into one flat buffer, each parameter's chunk padded to ceil(d0/N) rows so every
  rank's part has the same length, and reduce-scatters it (`reduce_scatter_tensor`), so a rank
  receives its chunks' averaged gradients only and the full gradients die after the pack.
* **The update** kernels run on this rank's chunk of every parameter: the chunk as a view of the
  parameter (the kernel writes through it), its gradient chunk, and state placeholders of the
  chunk's shape (capture traced them full; `Capture.create_deferred_state` makes them DTensors
  after this pass, sized by the same `shard_rows`). Every rank increments every step counter,
  as torch.optim does with FSDP2; a rank whose chunk is empty updates empty tensors.
* **Parameters**, after the last update: each rank packs its updated chunks of the bucket the
  same way, one `all_gather_into_tensor` brings every rank's, and each parameter is overwritten
  from the gathered rows (`copy_`), so every rank ends the step with the same full parameters.
  With `Offload(overlap_next_step=True)` (ZeRO-Offload, stages 1-2) a bucket's gather moves to
  the start of the next call instead, right before forward first reads any of its parameters
  (`_defer_gathers`): a CPU-path bucket's upload of this rank's rows can then run on past the
  call, as stage 3's does (`offload_optimizer` hands it over and waits for it right before the
  gather packs the rows), rather than being waited for in the step because the gather reads it.
  Its nodes carry `meta["deferred_gather"]` (the bucket's index) and nothing reads their
  results (their copies write into the parameters, which forward reads from the placeholders):
  between calls the parameters hold only this rank's updated rows, the executor runs exactly
  those nodes on `synchronize()`, and a call whose parameters are whole (after a
  `synchronize()`, or a fresh step's first call) runs the graph without them, so each update's
  rows are gathered once. A bucket whose parameters the step reads after their update (a weight norm
  logged after `optimizer.step()`) keeps its gather after the update.

A 0-dim parameter cannot be split: its gradient goes into every rank's part of the buffer (so
the reduce-scatter gives each rank the sum), every rank updates it alike, its state is
replicated (plain tensors), and it is not gathered. Gradients are averaged (summed, then
divided by the ranks: gloo has no average); the loss the step returns stays the rank's own.
Collectives are emitted in bucket order at positions every rank's graph shares, so all ranks
issue them in the same order.

With `accumulation_steps=k` and device sums the pass has nothing to do on the accumulating calls
of stages 1 and 2 (their graphs hold no update): each rank adds its own gradients into its running sums,
full-size local partial sums, with no collective at all. On the updating call the gradient the
update reads is the sum plus the last micro-batch's gradient, so the bucket collectives above
reduce the whole window's sums, once per update, not once per micro-batch.

Stage 3 keeps device sums the same way, whole on every rank (what FSDP2 does under `no_sync`),
rather than sharded (reduce-scattering every micro-batch's gradients and adding this rank's
chunk into a running sum of its rows, as DeepSpeed's ZeRO-3 does). Why: the gradients then cross
the group once per update, as issue 18 asks and as stages 1 and 2 do (with P the parameters'
elements, a window moves about 2kP gathered + P reduce-scattered, where sharded sums move 3kP:
1.2x as much at k = 2, towards 1.5x for large k), and both calls stay the programs stages 1-2
already have plus stage 3's gathers: nothing new to get wrong in the reduction. The
cost is memory: a whole gradient set per rank for the window, where sharded sums would hold 1/N
of it (stage 3 still saves (N-1)/N of the parameters; `README.md` has the measured peaks).
Sharded sums on the device are not done; with `offload=`, host sums are sharded (below). An
accumulating call has no update in its graph, so the parameters it shards come from capture's
`accumulation` note (`updated`: those the window's update updates), the same ones the updating
call shards; it gathers them for forward and for backward exactly as the updating call does
(`_accumulating_stage_3`).

With `offload=` and `Offload(accumulate_on="host")` (DeepSpeed ZeRO-Offload's form) the sums are
this rank's chunks in host memory instead, so the device holds no running sum at all, which is
the point for a model whose sums do not fit beside it: every call, accumulating or updating,
reduce-scatters each bucket right after its last gradient (stage 1 too: only this rank's chunk is
needed). An accumulating call adds this rank's chunk of each average into its running sum, made
the chunk's shape here (`_accumulating_host_sums`); an updating call's bucket collectives reduce
the last micro-batch's gradient alone (capture's device add `gradient + sum` dropped,
`_lift_host_sums`) and the update reads `chunk + sum`, which `offload_optimizer` turns into a copy
of the chunk to the host and an add of the sum there, as for host sums without ZeRO
(passes/host_accumulation.py): clipping's norms and a GradScaler's checks of the accumulated
chunks move to the host with it. The cost is a reduce-scatter per micro-batch, k per window,
where device sums reduce once per update. `Offload(accumulate_on="auto")` picks one of the two for
the whole step (the step's trial compiles, passes/host_accumulation.py `StepSums`): the config
this pass sees says "device" or "host", and the choice is noted (`sum_choice`; device sums also when
a trial compile with host sums raised `HostSumsUnsupportedError`, which this pass's own refusals of
them raise too). With
`sequence_parallel=` each call's gradients are partial sums over sp too, so every call reduces
them over both groups (reduce-scatter over dp, this rank's part all-reduced over sp): sums kept
partial over sp would have to be reduced over sp on the updating call, but they are added on the
host after that call's collectives, so the reduction would need them back on the device, which
host sums exist to avoid. Ring attention's `deferred_gradients` note says
which gradients are partial on the accumulating call as on the updating one.

**Clipping** (`clip_grad_norm_`, L2, in its per-tensor or foreach form): the step's norms of the
gradients are pointed at this rank's chunks of the averages (on stage 1 too, which holds every
average, so no rank norms all N chunks), so the total it computes is the norm of this rank's
chunks; its square is all-reduced (one scalar, after every bucket's collective) and its root
replaces the total for everything that read it: the clip coefficient, which the step's `mul_`s
apply to the chunks before the update, and the norm the step returns, the same on every rank.
A 0-dim parameter's gradient is whole on every rank, so only rank 0 counts it.

**Stage 3** reduces the gradients as stage 2 does, but a parameter's placeholder is this rank's
chunk (the update writes it in place and nothing is gathered after it): `zero_params.py` gathers
the whole parameters per bucket before forward reads them and again before backward does, on
every call (with `accumulation_steps`, the accumulating calls too). Clipping works as on stage 2
(the norms read the reduce-scattered chunks; `_global_norm` makes the total global, once for all
stages); `.grad` left set and a returned parameter are refused for it.

**Skipping non-finite steps** (a GradScaler, `skip_nonfinite=True`): the decision must be the
same on every rank, or their parameters part. A GradScaler's inf checks (which also unscale in
place) and skip_nonfinite's per-gradient norms are pointed at this rank's chunks, like
clipping's norms, so each rank checks 1/N of the averaged gradients; skip_nonfinite's total norm
is made global as clipping's is (`_global_norm`); then each flag (the checks' `found_inf`, the
skip flag, which the rank's own loss also sets) is replaced for everything that reads it after
it is final by its maximum over the group, one scalar all-reduce each (`_agree_on_skipping`): an
inf in any rank's chunk, or any rank's non-finite loss, skips the update everywhere, and the
GradScaler's scale evolves alike on every rank. With `offload=` (ZeRO-Offload) nothing more is
needed: the combined flag is what the update kernels read when `offload_optimizer` runs, so a
CPU-path bucket copies that flag to the host with its chunks' gradients and the host update of
this rank's chunks skips or applies as every other rank's does. With `accumulation_steps` the
updating call does this on the reduced sums, and an accumulating call's skip flag (its loss alone;
it has no update) is combined the same way (`_agree_on_counting_a_micro_batch`), so every rank
counts the same calls in `skipped_steps`. With `sequence_parallel=` combining over the data-parallel
group is enough: the chunks are reduced over both groups before the checks read them, so the
ranks of a sequence-parallel group check the same values, and their loss (ring attention's mean
over the sp group's tokens, all-reduced before anything reads it) is the same too.

What the pass cannot shard yet (other reads or writes of the gradients besides the update:
another norm; `.grad` left set after clipping or, stage 1, with a GradScaler; with stages 2 and
3, `.grad` left set at all) is refused with `UnsupportedError`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from graphoffload.aliasing import StorageMap, written_args, written_placeholders
from graphoffload.bucketing import greedy_buckets
from graphoffload.data_parallel import shard_rows
from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.errors import HostSumsUnsupportedError, UnsupportedError
from graphoffload.graph import TrainGraph, fake_mode_of, fake_value
from graphoffload.torch_private import recording_created_nodes
from graphoffload.passes.gradient_norms import norm_of_norms
from graphoffload.passes.update_kernels import UpdateKernel, update_kernels_to_rewrite
from graphoffload.passes.zero_params import (GatherReport, ShardedParam, classify_reads, gather_for_use,
                                              padded_flat, whole_from_gathered)

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass
class _Item:
    """One parameter of an update kernel: what the pass moves and where it sits in its bucket."""

    kernel: UpdateKernel | None   # None on an accumulating call with host sums (no update in its graph)
    index: int                  # in the kernel's lists
    name: str
    param: fx.Node
    grad: fx.Node
    offset: int = 0             # where its chunk starts in each rank's part of the bucket's flat buffers

    def __post_init__(self) -> None:
        # the whole parameter's shape, as made: stage 3 later makes the placeholder this rank's rows
        self._shape = list(self.param.meta["val"].shape)

    @property
    def shape(self) -> list[int]:
        return list(self._shape)

    @property
    def numel(self) -> int:
        return math.prod(self._shape)

    @property
    def scalar(self) -> bool:
        return not self.shape

    @property
    def row(self) -> int:
        """Elements of one row (along dim 0)."""
        return self.numel // self.shape[0] if self.shape and self.shape[0] else 1

    def chunk_rows(self, world: int) -> int:
        """Rows of a full chunk (the first ranks'): ceil(d0/N)."""
        return shard_rows(self.shape[0], world, 0)[1] if self.shape else 1

    def part(self, world: int) -> int:
        """Elements it takes in each rank's part of the flat buffers (a padded chunk)."""
        return self.chunk_rows(world) * self.row

    def local_shape(self, world: int, rank: int) -> list[int]:
        if self.scalar:
            return []
        return [shard_rows(self.shape[0], world, rank)[1], *self.shape[1:]]

    def local_numel(self, world: int, rank: int) -> int:
        """Elements of this rank's chunk."""
        return 1 if self.scalar else shard_rows(self.shape[0], world, rank)[1] * self.row


@dataclass
class _Bucket:
    items: list[_Item]
    part: int = 0               # elements of each rank's part of the flat buffers


class _Emitter:
    """Inserts nodes with `meta["val"]` computed on the graph's fake tensors and a phase."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.fake_mode = fake_mode_of(graph)

    def __call__(self, target: Any, args: tuple, like: fx.Node, phase: str = "comm",
                 param: tuple[str, ...] | None = None) -> fx.Node:
        node = self.graph.call_function(target, args)
        node.meta["val"] = fake_value(node, self.fake_mode)
        node.meta["phase"] = phase
        if "stack_trace" in like.meta:
            node.meta["stack_trace"] = like.meta["stack_trace"]
        if param is not None:
            node.meta["param"] = param
        return node


def _scaled_in_place(node: fx.Node) -> bool:
    """`grad.mul_(c)` or `_foreach_mul_(grads, c)` by a number or a 0-dim tensor (clipping's
    coefficient): scaling commutes with the reduction, so it may scale this rank's chunk."""
    if node.target not in (aten.mul_.Tensor, aten.mul_.Scalar, aten._foreach_mul_.Tensor, aten._foreach_mul_.Scalar):
        return False
    factor = node.args[1]
    return not node.kwargs and (not isinstance(factor, fx.Node) or factor.meta["val"].dim() == 0)


def _l2(node: fx.Node) -> bool:
    """An L2 norm of the whole tensor(s): `linalg_vector_norm(g, 2)` or `_foreach_norm(gs, 2)`."""
    if node.target is aten.linalg_vector_norm.default:
        return len(node.args) == 2 and node.args[1] == 2 and not node.kwargs
    return node.target is aten._foreach_norm.Scalar and node.args[1:] in ((), (2,)) and not node.kwargs


def _underlying(read: fx.Node) -> fx.Node:
    """The backward gradient an update kernel reads: `read` itself, or, when the kernel reads what
    clipping's `mul_` returned, the gradient the `mul_` scaled."""
    return read.args[0] if read.target in (aten.mul_.Tensor, aten.mul_.Scalar) else read


def _items(kernels: list[UpdateKernel], output: fx.Node, stage: int,
           skip_flag: fx.Node | None) -> tuple[list[_Item], _Clip | None, list[fx.Node], _Clip | None]:
    """Every parameter the kernels update, after checking that what else reads its gradient is
    what the pass can shard: the output (stage 1: `.grad` left set), `clip_grad_norm_`'s norms
    and in-place scaling (`_clipping`), a GradScaler's inf checks and skip_nonfinite's norms
    (`_gradient_readers`). Also returns the inf checks and skip_nonfinite's norm (`_skip_norm`)."""
    readers = set().union(*({k.node, *k.nodes} for k in kernels))
    items = []
    for k in kernels:
        names = k.node.meta.get("param") or tuple(f"#{i}" for i in range(len(k.params)))
        for i, (param, read) in enumerate(zip(k.params, k.grads)):
            grad = _underlying(read)
            if grad.meta.get("phase") != "backward" or written_args(grad) or (read is not grad
                                                                            and not _scaled_in_place(read)):
                changer = read if read is not grad else grad
                raise UnsupportedError(
                    f"ZeRO data parallelism: the gradient of {names[i]} is changed by {changer.name} ({changer.target}) "
                    f"at {_line(changer)} between backward and optimizer.step(); besides clip_grad_norm_ (an L2 "
                    "norm, then scaling by a number) changing gradients inside a ZeRO step is not supported yet")
            items.append(_Item(k, i, names[i], param, grad))
    checks, flag_norms = _gradient_readers(items, skip_flag)
    clip = _clipping(items, readers | set(checks) | set(flag_norms), output, stage)
    if checks and stage == 1 and any(output in it.grad.users for it in items):
        raise UnsupportedError(
            f"ZeRO stage 1 with a GradScaler and .grad left set after the step is not supported yet (the inf "
            f"checks at {_line(checks[0])} unscale this rank's chunks only, so .grad would hold rows of "
            "other scales): call optimizer.zero_grad() at the end of the step")
    return items, clip, checks, _skip_norm(flag_norms)


_INF_CHECK = aten._amp_foreach_non_finite_check_and_unscale_.default


def _gradient_readers(items: list[_Item], skip_flag: fx.Node | None) -> tuple[list[fx.Node], dict[fx.Node, _Item]]:
    """A GradScaler's inf checks of the gradients (`_amp_foreach_non_finite_check_and_unscale_`,
    which also unscale them in place) and skip_nonfinite's per-gradient norms (the L2 norms the
    skip flag is computed from, each with the item it norms): both may read this rank's chunks,
    as the norms' total is made global (`_global_norm`) and the flags are combined over the
    group (`_agree_on_skipping`)."""
    by_grad = {it.grad: it for it in items}
    checks: dict[fx.Node, None] = {}
    for it in items:
        for user in it.grad.users:
            if user.target is _INF_CHECK and all(g in by_grad for g in user.args[0]):
                checks[user] = None
    flag_norms: dict[fx.Node, _Item] = {}
    if skip_flag is not None:
        ancestors, stack = set(), [skip_flag]
        while stack:
            node = stack.pop()
            if node not in ancestors:
                ancestors.add(node)
                stack.extend(node.all_input_nodes)
        flag_norms = {u: it for it in items for u in it.grad.users
                      if u in ancestors and u.target is aten.linalg_vector_norm.default and u.args[1:2] == (2.0,)}
    return list(checks), flag_norms


def _skip_norm(terms: dict[fx.Node, _Item]) -> _Clip | None:
    """skip_nonfinite's global norm as `nonfinite.nonfinite_flag` traces it (per-gradient norms,
    stacked, normed again), in `_Clip`'s form, so that `_global_norm` makes its total global."""
    if not terms:
        return None
    total = norm_of_norms(terms)
    if total is None:
        raise UnsupportedError(
            f"ZeRO data parallelism: skip_nonfinite's gradient norm at {_line(next(iter(terms)))} is not one L2 "
            "norm of the per-gradient norms (gradients on several devices?); ZeRO makes it global from each "
            "rank's chunks and supports that form only for now: drop skip_nonfinite=True")
    return _Clip(terms, total, [])


@dataclass
class _Clip:
    """`clip_grad_norm_` (L2) as the step traced it: per-gradient norms (`terms`, each the norm of
    one item's gradient), stacked and normed again into `total`, from which the step computes a
    coefficient that `mul_`/`_foreach_mul_` (`scales`) apply to the gradients in place."""

    terms: dict[fx.Node, _Item]
    total: fx.Node
    scales: list[fx.Node]


def _clipping(items: list[_Item], readers: set[fx.Node], output: fx.Node, stage: int) -> _Clip | None:
    by_grad = {it.grad: it for it in items}
    terms: dict[fx.Node, _Item] = {}
    scales: dict[fx.Node, None] = {}
    for it in items:
        for user in it.grad.users:
            if user in readers or user in terms or user in scales:
                continue
            if user is output and stage == 1:   # .grad left set: the averaged gradient, as DDP leaves it
                continue
            if user is output:
                raise UnsupportedError(
                    f"ZeRO stage {stage} keeps only this rank's own gradients, but the step leaves {it.name}.grad "
                    "set after it returns: call optimizer.zero_grad() at the end of the step, or use "
                    "ZeRO(stage=1)")
            if _l2(user) and user.target is aten.linalg_vector_norm.default:
                terms[user] = it
                continue
            if _l2(user) and all(g in by_grad for g in user.args[0]):
                getitems = list(user.users)
                if all(u.target is operator.getitem for u in getitems):
                    terms.update((u, by_grad[user.args[0][u.args[1]]]) for u in getitems)
                    continue
            if _scaled_in_place(user) and all(g in by_grad for g in
                                              (user.args[0] if isinstance(user.args[0], list) else [user.args[0]])):
                scales[user] = None
                continue
            raise UnsupportedError(
                f"ZeRO data parallelism: the gradient of {it.name} is read by {user.name} ({user.target}) at "
                f"{_line(user)} besides optimizer.step(); ZeRO shards the gradients, and besides "
                "clip_grad_norm_ (L2 norm), a GradScaler and skip_nonfinite=True reading gradients inside a ZeRO "
                "step is not supported yet")
    if not terms and not scales:
        return None
    total = norm_of_norms(terms)
    if total is None or not _l2(total):
        where = next(iter(terms or scales))
        raise UnsupportedError(
            f"ZeRO data parallelism: the gradients are normed or scaled at {_line(where)} in a way other than "
            "clip_grad_norm_'s (one L2 norm of the per-gradient L2 norms, then scaling by a number): ZeRO "
            "computes the global norm from each rank's chunks, and this form is not supported yet")
    # .grad left set: read after clipping scaled it, or (stage 1) the average the output keeps
    if any(output in scale.users for scale in scales) or \
            (stage == 1 and any(output in it.grad.users for it in items)):
        raise UnsupportedError(
            f"ZeRO stage {stage} with clip_grad_norm_ and .grad left set after the step is not supported yet (the "
            "update clips this rank's chunks only, so .grad would hold unclipped rows): call optimizer.zero_grad() "
            "at the end of the step")
    return _Clip(terms, total, list(scales))


def _line(node: fx.Node) -> str:
    return user_line_of_stack_trace(node.meta.get("stack_trace")) or "an unknown line"


def _layout(items: list[_Item], position: dict[fx.Node, int], bucket_numel: int, world: int) -> list[_Bucket]:
    """Buckets in the order their gradients become final, and each chunk's offset in every
    rank's part of the bucket's flat buffers (the same layout on every rank)."""
    ordered = sorted(items, key=lambda it: (position[it.grad], it.kernel.node.name if it.kernel else "", it.index))
    groups = greedy_buckets(ordered, lambda it: it.numel, bucket_numel,
                            key=lambda it: (it.grad.meta["val"].dtype, it.param.meta["val"].dtype))
    buckets = []
    for group in groups:
        offset = 0
        for it in group:
            it.offset = offset
            offset += it.part(world)
        buckets.append(_Bucket(group, offset))
    return buckets


def _rows_by_rank(emit: _Emitter, it: _Item, full: fx.Node, world: int) -> fx.Node:
    """The whole tensor `full` (shaped like the parameter) as [world, part]: row r holds rank r's
    chunk, padded to ceil(d0/N) rows; a 0-dim one repeated in every rank's row."""
    if it.scalar:
        return emit(aten.expand.default, (emit(aten.reshape.default, (full, [1, 1]), full), [world, 1]), full)
    pad = it.chunk_rows(world) * world - it.shape[0]
    if pad:
        full = emit(aten.constant_pad_nd.default, (full, [0, 0] * (len(it.shape) - 1) + [0, pad]), full)
    return emit(aten.reshape.default, (full, [world, it.part(world)]), full)


def _padded_chunk(emit: _Emitter, it: _Item, chunk: fx.Node, world: int) -> fx.Node:
    """This rank's chunk (shaped `local_shape`), padded to ceil(d0/N) rows and flattened."""
    if it.scalar:
        return emit(aten.reshape.default, (chunk, [-1]), chunk)
    return padded_flat(emit, chunk, it.shape, it.chunk_rows(world), it.name, chunk)


def _local_rows(emit: _Emitter, it: _Item, full: fx.Node, world: int, rank: int, phase: str = "comm") -> fx.Node:
    """This rank's rows of `full` (a view; `full` itself when 0-dim)."""
    if it.scalar:
        return full
    start, rows = shard_rows(it.shape[0], world, rank)
    return emit(aten.slice.Tensor, (full, 0, start, start + rows), full, phase=phase, param=(it.name,))


def _summed(emit: _Emitter, bucket: _Bucket, tensors: list[fx.Node], group: str) -> list[fx.Node]:
    """One `all_reduce_coalesced` (a sum) of the bucket's `tensors` over `group`, waited for."""
    red = emit(c10d.all_reduce_coalesced.default, (tensors, "sum", group), bucket.items[-1].grad)
    out = []
    for i, it in enumerate(bucket.items):
        item = emit(operator.getitem, (red, i), it.grad, param=(it.name,))
        out.append(emit(c10d.wait_tensor.default, (item,), it.grad, param=(it.name,)))
    return out


def _reduce_gradients(emit: _Emitter, bucket: _Bucket, stage: int, rank: int, world: int, group: str,
                      sp_group: str | None = None, mesh_group: str | None = None,
                      sent: dict[fx.Node, fx.Node] | None = None
                      ) -> dict[fx.Node, tuple[fx.Node, fx.Node | None]]:
    """Stage 1: every gradient averaged; stage 2: this rank's chunks of them. Returns
    grad -> (this rank's chunk of its average, the whole average or None (stage 2)).

    `sp_group`: the gradients are partial sums over this sequence-parallel group too (ring
    attention left them to this pass): stage 1 sums the bucket over both dimensions in one
    `all_reduce_coalesced` over `mesh_group` (their ranks together); stages 2 and 3
    reduce-scatter over the data-parallel group first and then all-reduce this rank's part over
    `sp_group` (1/N of the bucket), which moves less than summing the whole bucket over it first
    (one reduce-scatter over both dimensions would cut each chunk once more, and an all-gather
    over sp would have to follow: two collectives again). `sent`: what this rank adds into the
    sums in place of a gradient (zeros for a gradient whole over sp, on all but one sp rank)."""
    sent = sent or {}
    last = bucket.items[-1].grad
    averaged = {}
    if stage == 1:
        grads = [sent.get(it.grad, it.grad) for it in bucket.items]
        for it, wait in zip(bucket.items, _summed(emit, bucket, grads, group if sp_group is None else mesh_group)):
            avg = emit(aten.div.Scalar, (wait, world), it.grad, param=(it.name,))
            averaged[it.grad] = (_local_rows(emit, it, avg, world, rank), avg)
        return averaged
    pieces = [_rows_by_rank(emit, it, sent.get(it.grad, it.grad), world) for it in bucket.items]
    flat = emit(aten.reshape.default, (emit(aten.cat.default, (pieces, 1), last), [-1]), last)
    red = emit(c10d.reduce_scatter_tensor.default, (flat, "sum", world, group), last)
    mine = emit(c10d.wait_tensor.default, (red,), last)
    if sp_group is not None:
        mine = emit(c10d.wait_tensor.default, (emit(c10d.all_reduce.default, (mine, "sum", sp_group), last),), last)
    mine = emit(aten.div.Scalar, (mine, world), last)
    for it in bucket.items:
        part = emit(aten.slice.Tensor, (mine, 0, it.offset, it.offset + it.local_numel(world, rank)), it.grad,
                    param=(it.name,))
        piece = emit(aten.view.default, (part, it.local_shape(world, rank)), it.grad, param=(it.name,))
        # a tensor of its own: fusion treats the update's gradients as written, so views of one
        # buffer would chain every update of the bucket after the one before
        averaged[it.grad] = (emit(aten.clone.default, (piece,), it.grad, param=(it.name,)), None)
    return averaged


def _global_norm(emit: _Emitter, clip: _Clip, rank: int, group: str) -> None:
    """Make clipping's (or skip_nonfinite's) total norm global. Its per-gradient norms now read this rank's chunks
    (the readers of each gradient were pointed at them), so the norm the step computes is the L2
    norm of this rank's chunks: square it, all-reduce the scalar (a sum) and take the root, for
    everything that read it (the coefficient, the step's outputs). A 0-dim parameter's gradient is
    whole on every rank: counted on rank 0 alone."""
    stack, total = clip.total.args[0], clip.total
    if rank:
        for term, it in clip.terms.items():
            if it.scalar:
                with emit.graph.inserting_before(term.next):
                    zeroed = emit(aten.mul.Tensor, (term, 0.0), term, phase="optimizer", param=(it.name,))
                stack.replace_input_with(term, zeroed)
    users = list(total.users)
    with emit.graph.inserting_before(total.next):   # (inserting_after would put each new node first)
        square = emit(aten.mul.Tensor, (total, total), total, phase="optimizer")
        summed = emit(c10d.wait_tensor.default, (emit(c10d.all_reduce.default, (square, "sum", group), total),), total)
        norm = emit(aten.sqrt.default, (summed,), total, phase="optimizer")
    for user in users:
        user.replace_input_with(total, norm)


def _skip_flag(graph: TrainGraph, output: fx.Node) -> fx.Node | None:
    """skip_nonfinite's flag (the output of kind `skipped`), if the step has one."""
    return next((value for spec, value in zip(graph.signature.outputs, output.args[0]) if spec.kind == "skipped"),
                None)


def _agree_on_skipping(emit: _Emitter, checks: list[fx.Node], skip_flag: fx.Node | None, group: str) -> list[str]:
    """Make every rank skip or apply the same update. A GradScaler's found_inf flag, set by inf
    checks of this rank's chunks, and skip_nonfinite's flag (this rank's loss, the norm of its
    chunks) are local: each is replaced, for everything that reads it after it is final (the
    update kernels' `found_inf`, the step-counter rollback, `GradScaler.update()`'s scale, the
    step's `skipped` output), by its maximum over the group (one `all_reduce` of a scalar, "max"),
    so a non-finite element anywhere in the averaged gradients, or one rank's non-finite loss,
    skips the update on every rank and the scale evolves alike. Returns the flags' names."""
    g = emit.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    finals: dict[fx.Node, fx.Node] = {}   # flag -> the last node that writes or makes it
    for check in checks:
        flag = check.args[1]
        finals[flag] = max(finals.get(flag, check), check, key=order.__getitem__)
    if skip_flag is not None:
        finals[skip_flag] = skip_flag
    for flag, final in finals.items():
        later = [u for u in flag.users if order.get(u, -1) > order[final]]
        with g.inserting_before(final.next):   # (inserting_after would put each new node first)
            reduced = emit(c10d.all_reduce.default, (flag, "max", group), final)
            agreed = emit(c10d.wait_tensor.default, (reduced,), final)
        for user in later:
            user.replace_input_with(flag, agreed)
    return [flag.name for flag in finals]


def _agree_on_counting_a_micro_batch(graph: TrainGraph, group: str) -> TrainGraph:
    """skip_nonfinite on an accumulating call (`accumulation_steps=k`; no update in its graph):
    its flag is this rank's loss alone, which single-process accumulation counts in
    `skipped_steps` (the window's update still runs unless its own call's flag is set: a
    non-finite gradient reaches it through the running sums' norm). Replaced in the output by
    its maximum over the group, so every rank counts the same calls."""
    g = graph.graph
    output = next(n for n in reversed(g.nodes) if n.op == "output")
    flag = _skip_flag(graph, output)
    if flag is None:
        return graph
    agreed = _agree_on_skipping(_Emitter(g), [], flag, group)
    g.lint()
    graph.note("zero", "accumulating call: skip_nonfinite's flag (this rank's loss) combined over the group (one "
               "all-reduce max of a scalar), so every rank counts the call alike", "nonfinite",
               checks=0, flags=tuple(agreed), skip_nonfinite=True)
    return graph


def _gather_parameters(emit: _Emitter, bucket: _Bucket, chunks: dict[fx.Node, fx.Node], world: int,
                       group: str) -> int:
    """All-gather the bucket's updated chunks; overwrite every (non 0-dim) parameter from them."""
    like = bucket.items[0].param
    flat = emit(aten.cat.default, ([_padded_chunk(emit, it, chunks[it.param], world) for it in bucket.items],), like)
    gathered = emit(c10d.wait_tensor.default,
                    (emit(c10d.all_gather_into_tensor.default, (flat, world, group), flat),), flat)
    by_rank = emit(aten.view.default, (gathered, [world, bucket.part]), flat)
    copied = 0
    for it in bucket.items:
        if it.scalar:   # every rank updated it alike
            continue
        rows = whole_from_gathered(emit, by_rank, it.offset, it.part(world), it.shape, it.chunk_rows(world), world,
                                   it.name, it.param)
        emit(aten.copy_.default, (it.param, rows), it.param, param=(it.name,))
        copied += 1
    return copied


def _defer_gathers(g: fx.Graph, buckets: list[_Bucket], update_views: set[fx.Node],
                   last_kernel: fx.Node) -> list[fx.Node | None]:
    """Per bucket, the node its deferred gather goes right before: the first reader of any of its
    parameters (forward's, in a training step), the update's views of this rank's rows aside; None
    (the gather stays after the update) when the step reads one of them after the last update, or
    nothing but the update reads them."""
    storages = StorageMap(g)
    updated_at = storages.position[last_kernel]
    placed: list[fx.Node | None] = []
    for bucket in buckets:
        params = [it.param for it in bucket.items if not it.scalar]
        late = [a for p in params for s in storages.of(p) for a in storages.accesses[s]
                if a.position > updated_at]
        readers = [u for p in params for u in p.users if u not in update_views and u in storages.position
                   and storages.position[u] < updated_at]
        placed.append(None if late or not readers else min(readers, key=storages.position.__getitem__))
    return placed


def _shard_state(emit: _Emitter, it: _Item, world: int, rank: int) -> int:
    """Give the item's state placeholders (not the step counter) this rank's chunk's shape.
    Returns their elements."""
    k, shape = it.kernel, it.local_shape(world, rank)
    numel = 0
    for pos in k.rule.list_positions[2:]:
        if pos == k.rule.steps_position or not k.node.args[pos]:
            continue
        state = k.node.args[pos][it.index]
        val = state.meta["val"]
        with emit.fake_mode:
            state.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
        numel += state.meta["val"].numel()
    return numel


def _sharded_param(node: fx.Node, name: str, world: int, rank: int, update: fx.Node | None) -> ShardedParam:
    """Stage 3's view of a (not 0-dim) parameter placeholder: its layout in the gather buffers,
    the same as its gradient's in the reduce-scatter (`_Item`: ceil(d0/N) rows a part)."""
    shape = tuple(node.meta["val"].shape)
    chunk_rows = shard_rows(shape[0], world, 0)[1]
    row = math.prod(shape[1:])
    return ShardedParam(node, name, shape, chunk_rows, chunk_rows * row,
                        (shard_rows(shape[0], world, rank)[1], *shape[1:]), update)


def _stage_3_params(items: list[_Item], position: dict[fx.Node, int], world: int, rank: int) -> list[ShardedParam]:
    """The parameters stage 3 shards (every updated one but 0-dim ones), after refusing reads of
    them it cannot shard yet (`classify_reads`), before the graph is changed."""
    sharded = [_sharded_param(it.param, it.name, world, rank, it.kernel.node) for it in items if not it.scalar]
    classify_reads(sharded, position)
    return sharded


def _accumulating_stage_3(graph: TrainGraph, dp: Any, updated: tuple[str, ...], whole: bool) -> TrainGraph:
    """Stage 3's accumulating call (`accumulation_steps=k`; no update in its graph): the
    parameters the window's update updates (`updated`, from capture's `accumulation` note; but
    0-dim ones) are this rank's rows here too, as on the updating call, and are gathered for
    forward and again for backward alike; the gradients go into the whole running sums with no
    collective (the module docstring says why)."""
    g = graph.graph
    placeholders = graph.placeholders()
    sharded = [_sharded_param(placeholders[s.name], s.target, dp.world_size, dp.rank, None)
               for s in graph.signature.inputs
               if s.kind == "param" and s.target in updated and placeholders[s.name].meta["val"].dim()]
    if not sharded:
        graph.note("zero", "accumulating call: no parameter to shard")
        return graph
    classify_reads(sharded, {n: i for i, n in enumerate(g.nodes)})
    gathers = gather_for_use(_Emitter(g), g, sharded, dp.world_size, dp.group_name, dp.bucket_numel, whole)
    g.lint()
    total = sum(p.numel for p in sharded)
    local = sum(math.prod(p.local_shape) for p in sharded)
    _note_params(graph, gathers, local, total, 0)
    return graph


def _chunk_sum(emit: _Emitter, s: fx.Node, it: _Item, world: int, rank: int) -> None:
    """Make the running-sum placeholder `s` (and the `zero_` that clears it) this rank's chunk's
    shape; `offload_optimizer` then moves it to the host (fp32)."""
    val = s.meta["val"]
    with emit.fake_mode:
        s.meta["val"] = torch.empty(it.local_shape(world, rank), dtype=val.dtype, device=val.device)
        for user in s.users:
            if user.target is aten.zero_.default:
                user.meta["val"] = torch.empty_like(s.meta["val"])


def _host_sum_items(graph: TrainGraph) -> tuple[list[_Item], dict[str, tuple[fx.Node, fx.Node]]]:
    """An accumulating call with host sums: each running sum's `sum.add_(grad)` (autograd's
    accumulation, its only use), as an item to reduce (no kernel: the call has no update), and
    name -> (sum placeholder, that add)."""
    placeholders = graph.placeholders()
    params = {s.target: placeholders[s.name] for s in graph.signature.inputs if s.kind == "param"}
    items, adds = [], {}
    for spec in graph.signature.inputs:
        if spec.kind != "grad_sum":
            continue
        s = placeholders[spec.name]
        add = next(iter(s.users), None)
        if len(s.users) != 1 or add.target is not aten.add_.Tensor or add.args[0] is not s or len(add.args) != 2 \
                or add.kwargs or add.users:
            raise HostSumsUnsupportedError(
                f"ZeRO with Offload(accumulate_on='host'): the accumulating call does more with the running gradient "
                f"sum of {spec.target} than add the micro-batch's gradient (at {_line(add) if add else 'no line'}); "
                "use Offload(accumulate_on='device')")
        items.append(_Item(None, 0, spec.target, params[spec.target], add.args[1]))
        adds[spec.target] = (s, add)
    return items, adds


def _accumulating_host_sums(graph: TrainGraph, ctx: PassContext, items: list[_Item],
                            adds: dict[str, tuple[fx.Node, fx.Node]]) -> TrainGraph:
    """An accumulating call with host sums (`Offload(accumulate_on="host")`): each bucket's
    gradients reduce-scattered right after its last one, as the updating call's are, and this
    rank's chunk of each average added into its running sum (made chunk-shaped) in place of the
    whole gradient; `offload_optimizer` turns each add into a copy to the host and an add there.
    With `sequence_parallel=` this rank's part is all-reduced over sp too, as on the updating
    call, so every call's chunk is the sum over both groups (ring attention lists the gradients
    it left partial on this call as on that one)."""
    dp = ctx.config.data_parallel
    g = graph.graph
    rank, world = dp.rank, dp.world_size
    sp_group, whole_over_sp = _sequence_parallel_group(graph, ctx, items)
    sent_by_one = {it.grad for it in whole_over_sp}
    position = {n: i for i, n in enumerate(g.nodes)}
    buckets = _layout(items, position, dp.bucket_numel, world)
    emit = _Emitter(g)
    for bucket in buckets:
        last = max((it.grad for it in bucket.items), key=position.__getitem__)
        with g.inserting_before(last.next):
            sent = _sent_by_sp_rank_0(emit, ctx, bucket, sent_by_one)
            averaged = _reduce_gradients(emit, bucket, 2, rank, world, dp.group_name, sp_group, ctx.mesh_group, sent)
        for it in bucket.items:
            s, add = adds[it.name]
            local = averaged[it.grad][0]
            _chunk_sum(emit, s, it, world, rank)
            with g.inserting_after(local):
                emit(aten.add_.Tensor, (s, local), add, phase="backward", param=(it.name,))
            g.erase_node(add)
    g.lint()
    _note_host_sums(graph, items, buckets, world, rank, update=False)
    if sp_group is not None:
        _note_two_dimensions(graph, ctx, 2, sp_group, whole_over_sp)
    return graph


def _sent_by_sp_rank_0(emit: _Emitter, ctx: PassContext, bucket: _Bucket,
                       sent_by_one: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """A gradient whole over sp: sp rank 0 sends it, the others zeros, so the sum over sp is it
    (exactly, for any sp size). Returns grad -> what this rank sends in its place."""
    if ctx.config.sequence_parallel is None or ctx.config.sequence_parallel.rank == 0:
        return {}
    return {it.grad: emit(aten.zeros_like.default, (it.grad,), it.grad, param=(it.name,))
            for it in bucket.items if it.grad in sent_by_one}


def _lift_host_sums(graph: TrainGraph) -> tuple[dict[str, fx.Node], dict[str, str]]:
    """The updating call with host sums: drop each device add `grad + sum` that made a gradient
    final (capture's hook), so the bucket collectives reduce the last micro-batch's gradient alone;
    `zero` adds this rank's chunk of the sum to its chunk after the reduction. Returns name -> sum,
    and each dropped add's node name -> the gradient's (what ring attention's `deferred_gradients`
    named is now that gradient)."""
    placeholders = graph.placeholders()
    sums, lifted = {}, {}
    for spec in graph.signature.inputs:
        if spec.kind != "grad_sum":
            continue
        s = placeholders[spec.name]
        finals = [u for u in s.users if u.target is aten.add.Tensor and u.args[1] is s and not u.kwargs]
        zeros = [u for u in s.users if u.target is aten.zero_.default and not u.users]
        if len(finals) != 1 or len(s.users) != 1 + len(zeros):
            other = next((u for u in s.users if u not in finals + zeros), next(iter(s.users), None))
            raise HostSumsUnsupportedError(
                f"ZeRO with Offload(accumulate_on='host'): the updating call reads the running gradient sum of "
                f"{spec.target} other than as `gradient + sum` (at {_line(other) if other else 'no line'}); use "
                "Offload(accumulate_on='device')")
        final = finals[0]
        lifted[final.name] = final.args[0].name
        final.replace_all_uses_with(final.args[0])
        graph.graph.erase_node(final)
        sums[spec.target] = s
    return sums, lifted


def _note_host_sums(graph: TrainGraph, items: list[_Item], buckets: list[_Bucket], world: int, rank: int,
                    update: bool) -> None:
    numel = sum(it.local_numel(world, rank) for it in items)
    graph.note("zero", f"host sums: {len(items)} running gradient sums are this rank's chunks ({numel:,} elements, "
               f"fp32 in host memory after offload_optimizer); {len(buckets)} gradient buckets reduce-scattered on "
               + ("this updating call (the last micro-batch), the sums added to the chunks on the host"
                  if update else "this accumulating call, this rank's chunks added into the sums"),
               "host_sums", sums=len(items), sum_numel=numel, buckets=len(buckets), update=update,
               collective="reduce_scatter_tensor")


def _note_params(graph: TrainGraph, gathers: GatherReport, local: int, total: int, reduced: int) -> None:
    """Stage 3's `params` note (`reduced`: the elements the gradients' reduce-scatters cover)."""
    # each rank sends and receives (N-1)/N of what a collective covers; DDP's all-reduce moves
    # twice the gradients: the ratio compares elements covered (the gathers' whole parameters,
    # the reduce-scatters' padded buffers)
    gathered_numel = sum(gathers.forward_buckets) + sum(gathers.backward_buckets)
    ratio = (gathered_numel + reduced) / (2 * total) if total else 0.0
    graph.note("zero", f"stage 3: {len(gathers.sharded)} parameters held as this rank's rows between steps "
               f"({local:,} of {total:,} elements); {len(gathers.forward_buckets)} parameter buckets gathered "
               f"before forward reads them and {len(gathers.backward_buckets)} again before backward does (the "
               f"next bucket's all-gather issued one bucket ahead; {len(gathers.kept)} parameters of the last "
               f"forward bucket kept for backward), largest {max(gathers.forward_buckets, default=0):,} "
               f"elements; {gathers.recomputed} forward views of parameters repeated in backward; a step's "
               f"collectives cover {ratio:.2f}x the elements of DDP's all-reduce"
               + ("" if reduced else " (an accumulating call: no gradient collective)"), "params",
               sharded=gathers.sharded, forward_buckets=gathers.forward_buckets,
               backward_buckets=gathers.backward_buckets, recomputed=gathers.recomputed, kept=gathers.kept,
               gathered_numel=gathered_numel, volume_vs_ddp=ratio)


def _whole_backward_buckets(ctx: PassContext) -> bool:
    """Stage 3 with `Offload(activations="auto")`: backward gathers each forward bucket whole (its
    biases too), so the activation planner's replays of forward find every parameter they read
    gathered again (zero_params, offload_activation_gathers)."""
    offload = ctx.config.offload
    return offload is not None and offload.activations == "auto"


def _sequence_parallel_group(graph: TrainGraph, ctx: PassContext, items: list[_Item],
                             renamed: dict[str, str] | None = None) -> tuple[str | None, list[_Item]]:
    """With `sequence_parallel=`: the group over which `ring_attention` left the gradients the
    update reads as partial sums (its `deferred_gradients` note), which this pass reduces over
    it besides the data-parallel group (None without sequence parallelism), and the items whose
    gradients it did not leave partial: whole already on every rank of the group (a parameter read
    off the split sequence, e.g. by a penalty on the loss, alone or besides a read on it, whose
    partial part ring attention summed where the two meet), so one rank of the group sends them.
    `renamed`: gradient nodes this pass replaced since ring attention named them (`_lift_host_sums`)."""
    if ctx.config.sequence_parallel is None:
        return None, []
    notes = graph.notes_of("ring_attention", "deferred_gradients")
    renamed = renamed or {}
    deferred = {renamed.get(name, name) for name in notes[0].fields["gradients"]} if notes else set()
    if ctx.config.data_parallel.stage == 1 and ctx.mesh_group is None:
        raise UnsupportedError("ZeRO stage 1 with sequence_parallel= all-reduces the gradients over both dimensions' "
                               "ranks: the pass needs PassContext(mesh_group=...), the name of a group over them "
                               "(offload_compile makes one)")
    group = notes[0].fields["group"] if notes else ctx.config.sequence_parallel.group_name
    return group, [it for it in items if it.grad.name not in deferred]


def _note_two_dimensions(graph: TrainGraph, ctx: PassContext, stage: int, sp_group: str,
                         whole_over_sp: list[_Item]) -> None:
    """The `two_dimensions` note: how each bucket's gradients are reduced over both groups
    (`stage`: how they are reduced, 2 for host sums whatever the ZeRO stage)."""
    dp = ctx.config.data_parallel
    world = dp.world_size
    order = ("the bucket all-reduced over both dimensions' ranks at once (one collective)" if stage == 1
             else "the bucket reduce-scattered over the data-parallel group, then this rank's part "
             "all-reduced over the sequence-parallel group (two collectives)")
    graph.note("zero", f"two dimensions: gradients are partial sums over the sequence-parallel group "
               f"{sp_group!r} ({ctx.config.sequence_parallel.world_size} ranks) and per-micro-batch over the "
               f"data-parallel group ({world} ranks); per bucket {order}, then divided by {world}"
               + (f"; {len(whole_over_sp)} gradients whole over the sequence-parallel group (read off the split "
                  "sequence), sent by its rank 0 alone" if whole_over_sp else ""),
               "two_dimensions", sequence_parallel_group=sp_group, data_parallel_group=dp.group_name,
               whole_over_sequence_parallel=tuple(it.name for it in whole_over_sp),
               mesh_group=ctx.mesh_group, sequence_parallel_world=ctx.config.sequence_parallel.world_size,
               data_parallel_world=world,
               gradient_collectives=(("all_reduce_coalesced", "mesh"),)
               if stage == 1 else (("reduce_scatter_tensor", "dp"), ("all_reduce", "sp")))


def _refuse_kept_gradient(items: list[_Item], output: fx.Node) -> None:
    """Host sums under ZeRO keep only this rank's chunk of each running sum, on the host: a
    gradient the step leaves on `.grad` (stage 1 allows it without host sums) would be the last
    micro-batch's average, not the window's. Refused."""
    kept = next((it for it in items if output in it.grad.users), None)
    if kept is not None:
        raise HostSumsUnsupportedError(
            f"ZeRO with Offload(accumulate_on='host') keeps only this rank's chunk of each running sum, on the host, "
            f"but the step leaves {kept.name}.grad set after it returns: call optimizer.zero_grad() at the end of "
            "the step, or use Offload(accumulate_on='device')")


def zero(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    graph = _zero(graph, ctx)
    choice = ctx.step_sums
    if ctx.config.data_parallel is not None and choice is not None:
        graph.note("zero", choice.describe(), "sum_choice", where=choice.where, budget=choice.budget,
                   device_peak=choice.device_peak, host_peak=choice.host_peak, host_refused=choice.host_refused,
                   unfitted=choice.unfitted)
    return graph


def _zero(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    dp = ctx.config.data_parallel
    if dp is None:
        return graph
    window = graph.notes_of("capture", "accumulation")
    host_sums = ctx.config.host_sums_under_zero and bool(window)
    if window and not window[0].fields["update"]:
        summed = _host_sum_items(graph) if host_sums else None   # before stage 3 makes parameters rows
        if dp.stage == 3:
            graph = _accumulating_stage_3(graph, dp, window[0].fields["updated"], _whole_backward_buckets(ctx))
        if summed is not None and summed[0]:
            graph = _accumulating_host_sums(graph, ctx, *summed)
        return _agree_on_counting_a_micro_batch(graph, dp.group_name)
    kernels = update_kernels_to_rewrite(graph, "zero", "shard")
    if not kernels:
        return graph
    g = graph.graph
    rank, world, group = dp.rank, dp.world_size, dp.group_name
    output = next(n for n in g.nodes if n.op == "output")
    skip_flag = _skip_flag(graph, output)
    sums, lifted = _lift_host_sums(graph) if host_sums else ({}, {})
    items, clip, checks, skip_norm = _items(kernels, output, dp.stage, skip_flag)
    if sums:
        _refuse_kept_gradient(items, output)
    sp_group, whole_over_sp = _sequence_parallel_group(graph, ctx, items, lifted)
    sent_by_one = {it.grad for it in whole_over_sp}   # (gradients whole over sp)
    position = {n: i for i, n in enumerate(g.nodes)}
    sharded = _stage_3_params(items, position, world, rank) if dp.stage == 3 else []
    buckets = _layout(items, position, dp.bucket_numel, world)
    emit = _Emitter(g)

    # the update's parameters: this rank's rows of each, views made right after the inputs (so
    # they pin no update late), through which the kernels write; stage 3: the placeholders
    # themselves, which hold this rank's rows alone
    chunks: dict[fx.Node, fx.Node] = {it.param: it.param for it in items}
    if dp.stage != 3:
        last_input = [n for n in g.nodes if n.op == "placeholder"][-1]
        with g.inserting_after(last_input):
            for it in reversed(items):   # (inserting_after puts each new node first)
                chunks[it.param] = _local_rows(emit, it, it.param, world, rank, phase="optimizer")
        for it in items:
            it.kernel.node.replace_input_with(it.param, chunks[it.param])
    state_numel = sum(_shard_state(emit, it, world, rank) for it in items)

    # gradients: each bucket's collective right after its last gradient; the update reads this
    # rank's chunk of the average, the step's outputs (stage 1's .grad) the whole average
    # (with host sums every stage reduce-scatters, and this rank's chunk of the sum is added to its
    # chunk of the average, `chunk + sum`, which offload_optimizer drains on the host)
    readers = {it.grad: list(it.grad.users) for it in items}
    for bucket in buckets:
        last = max((it.grad for it in bucket.items), key=position.__getitem__)
        with g.inserting_before(last.next):   # (inserting_after would put each new node first)
            sent = _sent_by_sp_rank_0(emit, ctx, bucket, sent_by_one)
            averaged = _reduce_gradients(emit, bucket, 2 if sums else dp.stage, rank, world, group, sp_group,
                                         ctx.mesh_group, sent)
        for it in bucket.items if sums else ():
            local, _ = averaged[it.grad]
            _chunk_sum(emit, sums[it.name], it, world, rank)
            with g.inserting_after(local):
                added = emit(aten.add.Tensor, (local, sums[it.name]), local, phase="backward", param=(it.name,))
            averaged[it.grad] = (added, None)
        for grad, (local, whole) in averaged.items():
            for user in readers[grad]:
                user.replace_input_with(grad, whole if user is output else local)

    if clip is not None:
        _global_norm(emit, clip, rank, group)
    if skip_norm is not None:   # the flag's norm: global, as clipping's (its finiteness alone is read)
        _global_norm(emit, skip_norm, rank, group)
    agreed = _agree_on_skipping(emit, checks, skip_flag, group) if checks or skip_flag is not None else []

    total = sum(it.numel for it in items)
    local = sum(it.local_numel(world, rank) for it in items)
    padded = sum(b.part for b in buckets) * world
    copied = 0
    if dp.stage == 3:   # parameters: gathered before forward and backward read them (zero_params)
        gathers = gather_for_use(emit, g, sharded, world, group, dp.bucket_numel, _whole_backward_buckets(ctx))
    else:   # parameters: gathered after the last update, in bucket order (or deferred: below)
        last_kernel = max((k.node for k in kernels), key=position.__getitem__)
        offload = ctx.config.offload
        before = _defer_gathers(g, buckets, set(chunks.values()), last_kernel) \
            if offload is not None and offload.overlap_next_step else [None] * len(buckets)
        with g.inserting_before(last_kernel.next):
            for bucket, first in zip(buckets, before):
                if first is None:
                    copied += _gather_parameters(emit, bucket, chunks, world, group)
        for b, (bucket, first) in enumerate(zip(buckets, before)):
            if first is None:
                continue
            # packed from the rows the parameter holds at that point
            with recording_created_nodes(graph.gm) as made, g.inserting_before(first):
                rows = {it.param: _local_rows(emit, it, it.param, world, rank) for it in bucket.items}
                copied += _gather_parameters(emit, bucket, rows, world, group)
            for node in made:
                node.meta["deferred_gather"] = b
        deferred = sum(first is not None for first in before)
    g.lint()
    written = written_placeholders(g)
    inputs = tuple(s if s.mutable or s.name not in written else type(s)(s.kind, s.name, s.target, True)
                   for s in graph.signature.inputs)
    graph = graph.with_signature(inputs=inputs)

    collective = "all-reduce" if dp.stage == 1 and not sums else "reduce-scatter"
    gathered = "parameters gathered before use (below)" if dp.stage == 3 else \
        f"one {collective} and one all-gather each; {copied} parameters overwritten from the gathered chunks"
    graph.note("zero", f"ZeRO stage {dp.stage}, rank {rank} of {world}: updates its dim-0 chunk of each of "
               f"{len(items)} parameters ({local:,} of {total:,} elements; optimizer state {state_numel:,} "
               f"elements besides step counters); {len(buckets)} gradient buckets, {gathered}", "shards",
               stage=dp.stage, rank=rank, world=world, buckets=len(buckets), gradient_collective=collective,
               params=len(items), local_numel=local, numel=total, state_numel=state_numel,
               bucket_parts=tuple(b.part for b in buckets), padded_numel=padded)
    if sp_group is not None:
        _note_two_dimensions(graph, ctx, 2 if sums else dp.stage, sp_group, whole_over_sp)
    if dp.stage == 3:
        _note_params(graph, gathers, local, total, padded)
    elif ctx.config.offload is not None and ctx.config.offload.overlap_next_step:
        graph.note("zero", f"Offload(overlap_next_step=True): {deferred} of {len(buckets)} buckets' all-gathers of "
                   "the updated chunks run at the start of the next call, right before forward first reads the "
                   "bucket's parameters (synchronize() runs them between calls)"
                   + (f"; {len(buckets) - deferred} stay after the update, their parameters read after it in the "
                      "step" if deferred < len(buckets) else ""), "deferred_gathers",
                   buckets=deferred, kept=len(buckets) - deferred)
    if sums:
        _note_host_sums(graph, items, buckets, world, rank, update=True)
    if clip is not None:
        graph.note("zero", f"clip_grad_norm_: the global L2 norm of {len(clip.terms)} gradients from this rank's "
                   "chunks of their averages (squares summed, one all-reduce of a scalar), the clip coefficient "
                   f"applied to the chunks by {len(clip.scales)} in-place scalings", "clip",
                   terms=len(clip.terms), scales=len(clip.scales), total=clip.total.name)
    if agreed:
        graph.note("zero", f"{len(checks)} GradScaler inf checks read this rank's chunks of the averaged gradients"
                   + (" and skip_nonfinite's norms read them (their total made global as clipping's)"
                      if skip_norm is not None else "")
                   + f"; {len(agreed)} skip flags combined over the group (one all-reduce max of a scalar each), "
                   "so every rank skips or applies the same update", "nonfinite",
                   checks=len(checks), flags=tuple(agreed), skip_nonfinite=skip_flag is not None)
    if padded > 1.25 * total:
        graph.note("zero", f"the padded buffers hold {padded:,} elements for {total:,} parameter elements: "
                   f"parameters with fewer rows (dim 0) than about {world} ranks, or 0-dim ones, are padded "
                   "to a chunk per rank", "padding", padded_numel=padded, numel=total)
    return graph
