"""ring_attention's rule table: how each op propagates a sequence split or a partial sum.

The pass walks the graph once; what it does at a node depends on the op alone, so that
knowledge lives here, one `Rule` per op in `RULES` (as JAX keeps one rule per primitive in
`primitive_jvps` / `primitive_transposes`). A rule says:

* `partials`: how a partial sum in its inputs passes through: `"one"` (linear in a single
  partial input, the others the same on every rank), `"all"` (linear when every tensor input
  is partial), `"none"` (partial inputs are all-reduced first);
* `over_sequence`: what a full-shaped output of a sharded input is: `"sum"` (a partial sum),
  `"mean"` (a partial sum averaged over the ranks), `"refuse"` (an error);
* `align`: how full inputs are sharded where they meet a sharded one (broadcast dimensions for
  elementwise ops, the contracted dimension of a matmul, an index tensor and its data);
* `mixes_positions`: whether the op combines values at different positions along a dimension
  (then that dimension must not be the split sequence: only attention may do that);
* `sizes`: how its size arguments become the local length (views, `expand`, slices);
* `seed_index`: the argument whose full batch tensor spanning the sequence starts the split;
* `rewrite`: a replacement of the whole propagation (attention -> ring attention, the loss).

An op without a rule takes `FALLBACK`, the elementwise rule: partial inputs all-reduced, full
inputs aligned by broadcasting when torch tags the op pointwise, sizes untouched, the output's
split read from the shapes the op computes on the local inputs; a full-shaped output of a
sharded input is refused. Ops that combine positions along the sequence carry a
`mixes_positions` rule, so they are refused with the op named rather than computing something
else on each rank's part.

A node's `Spec` is one of three frozen values: `Shard` (this rank's part of the sequence),
`PARTIAL` (full shape, a partial sum over this rank's tokens) or `REPLICATED` (the full value,
the same on every rank). A node with several outputs has one `Spec` per output.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import fx

from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.errors import UnsupportedError
from graphoffload.graph import fake_value
from graphoffload.ops.attention import ATTENTION, ATTENTION_BACKWARD

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


# ---------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Shard:
    """The value is this rank's part of the sequence along `dim`, whose full size is
    outer * seq_len * inner (a flattened dim such as batch x sequence has outer = batch)."""

    dim: int
    outer: int = 1
    inner: int = 1


@dataclass(frozen=True)
class Partial:
    """The full shape, holding a partial sum over this rank's tokens: the sum over the ranks
    (an all-reduce) is the value."""

    def __repr__(self) -> str:   # as error messages have always named it
        return "partial"


@dataclass(frozen=True)
class Replicated:
    """The full value, the same on every rank: everything before the first sharded tensor."""


PARTIAL = Partial()
REPLICATED = Replicated()
Spec = Shard | Partial | Replicated


class Sharding(Protocol):
    """What a rule sees of the pass's walk (`ring_attention._Sharder`)."""

    graph: fx.Graph
    fake_mode: Any
    seq: int                # the full sequence length
    world: int              # ranks the sequence is split across
    group: str              # their process group's name
    layout: str
    timeout_s: float
    counts: Counter

    def spec(self, node: fx.Node) -> Spec: ...
    def set_spec(self, node: fx.Node, spec: Spec | tuple[Spec, ...]) -> None: ...
    def full_shape(self, node: fx.Node) -> torch.Size | None: ...
    def full_size(self, node: fx.Node, shard: Shard) -> int: ...
    def shard_of(self, node: fx.Node, shard: Shard) -> fx.Node: ...
    def new_node(self, target: Any, args: tuple, kwargs: dict | None = None, phase: str | None = None,
                 like: fx.Node | None = None) -> fx.Node: ...
    def propagate(self, node: fx.Node) -> None: ...


Align = Callable[[Sharding, fx.Node, dict[fx.Node, Spec], list[tuple[fx.Node, Shard]]], None]
Sizes = Callable[[Sharding, fx.Node, Shard], Shard | None]


def user_line(node: fx.Node) -> str:
    """The user's source line that made `node`, for error messages."""
    return user_line_of_stack_trace(node.meta.get("stack_trace")) or "an unknown line"


# ---------------------------------------------------------------------- align: full inputs meet a shard


def align_broadcast(sharding: Sharding, node: fx.Node, specs: dict[fx.Node, Spec],
                    sharded: list[tuple[fx.Node, Shard]]) -> None:
    """Elementwise ops: a full input whose broadcast dimension lines up with the sharded
    input's sequence dimension (and has its full size) is sharded the same way."""
    if torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        # broadcasting lines dimensions up only for elementwise ops: an embedding's table
        # as wide as the sequence is long is not a full-sequence tensor
        return
    ref_node, ref = sharded[0]
    ref_full = sharding.full_size(ref_node, ref)
    out_ndim = max(n.meta["val"].dim() for n in specs if isinstance(n.meta.get("val"), torch.Tensor))
    pos = ref.dim + out_ndim - ref_node.meta["val"].dim()
    for n, spec in specs.items():
        if spec != REPLICATED or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        shape = n.meta["val"].shape
        dim = pos - (out_ndim - len(shape))
        if 0 <= dim < len(shape) and shape[dim] == ref_full and shape[dim] > 1:
            node.replace_input_with(n, sharding.shard_of(n, Shard(dim, ref.outer, ref.inner)))


def align_matmul(sharding: Sharding, node: fx.Node, specs: dict[fx.Node, Spec],
                 sharded: list[tuple[fx.Node, Shard]]) -> None:
    """mm/bmm/addmm contracting the sequence: the full operand is sharded along its side of
    the contraction (the product is then a partial sum)."""
    a, b = node.args[-2], node.args[-1]
    sa, sb = specs.get(a, REPLICATED), specs.get(b, REPLICATED)
    if isinstance(sa, Shard) and sa.dim == a.meta["val"].dim() - 1 and sb == REPLICATED:
        node.replace_input_with(b, sharding.shard_of(b, Shard(b.meta["val"].dim() - 2, sa.outer, sa.inner)))
    elif isinstance(sb, Shard) and sb.dim == b.meta["val"].dim() - 2 and sa == REPLICATED:
        node.replace_input_with(a, sharding.shard_of(a, Shard(a.meta["val"].dim() - 1, sb.outer, sb.inner)))


def align_indexed(index_pos: int, data_pos: int) -> Align:
    """Ops whose index tensor is left-aligned with their data (an embedding gradient's ids, a
    loss's targets): full indices spanning the data's split dimension are sharded alike."""
    def align(sharding: Sharding, node: fx.Node, specs: dict[fx.Node, Spec],
              sharded: list[tuple[fx.Node, Shard]]) -> None:
        idx, data = node.args[index_pos], node.args[data_pos]
        data_spec = specs.get(data, REPLICATED)
        if isinstance(idx, fx.Node) and specs.get(idx, REPLICATED) == REPLICATED and isinstance(data_spec, Shard):
            idx_shape = idx.meta["val"].shape
            if data_spec.dim < len(idx_shape) and idx_shape[data_spec.dim] == sharding.full_size(data, data_spec):
                node.replace_input_with(idx, sharding.shard_of(idx, data_spec))
    return align


# ---------------------------------------------------------------------- ops that mix positions


def never_mixes(node: fx.Node, seq_dim: int) -> bool:
    return False


def mixes_along_dim(node: fx.Node, seq_dim: int) -> bool:
    """Ops that combine values at different positions along their `dim`/`dims` argument: on
    one rank's part of the sequence they keep its shape but compute something else."""
    ndim = node.args[0].meta["val"].dim()
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name in ("dim", "dims"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            dims = value if isinstance(value, (list, tuple)) else [value]
            # roll with no dims rolls the flattened tensor
            return not dims or seq_dim in {d % ndim for d in dims}
    return False


def mixes_convolution(node: fx.Node, seq_dim: int) -> bool:
    """A convolution mixes positions along a spatial axis unless its kernel is 1 wide there,
    with stride 1 and no padding. Arguments: (input, weight, bias, stride, padding, ...)."""
    axis = seq_dim - 2
    return axis >= 0 and (node.args[1].meta["val"].shape[seq_dim] > 1 or node.args[3][axis] != 1
                          or node.args[4][axis] != 0)


# ---------------------------------------------------------------------- sizes


def keep_sizes(sharding: Sharding, node: fx.Node, shard: Shard) -> Shard | None:
    return None


def view_sizes(sharding: Sharding, node: fx.Node, shard: Shard) -> Shard | None:
    """The output dimension that holds the whole sequence gets the local length; returns how
    the sequence sits in it (the output's `Shard`)."""
    out = list(sharding.full_shape(node))
    in_shape = list(sharding.full_shape(node.args[0]))
    stride = shard.inner * math.prod(in_shape[shard.dim + 1:])
    span = stride * sharding.seq
    for dim in range(len(out)):
        inner, size = math.prod(out[dim + 1:]), out[dim]
        if inner <= stride and stride % inner == 0 and span <= inner * size and (inner * size) % span == 0:
            out[dim] = size // sharding.world
            node.update_arg(1, out)
            return Shard(dim, (size * inner) // span, stride // inner)
    raise UnsupportedError(f"sequence parallelism: {node.name} reshapes {in_shape} to "
                           f"{list(sharding.full_shape(node))}, splitting the sequence dimension")


def expand_sizes(sharding: Sharding, node: fx.Node, shard: Shard) -> Shard | None:
    out = list(sharding.full_shape(node))
    out[shard.dim + len(out) - node.args[0].meta["val"].dim()] //= sharding.world
    node.update_arg(1, out)
    return None


def slice_backward_sizes(sharding: Sharding, node: fx.Node, shard: Shard) -> Shard | None:
    """slice_backward/select_backward(grad, sizes, dim, ...): the full input's sizes, split
    like the gradient (select removed `dim`, so dimensions from it on shift by one)."""
    sizes, sliced = list(node.args[1]), node.args[2]
    dim = shard.dim if node.target == aten.slice_backward.default or shard.dim < sliced else shard.dim + 1
    if dim == sliced:
        raise UnsupportedError(f"sequence parallelism: {node.name} slices along the split sequence")
    sizes[dim] //= sharding.world
    node.update_arg(1, sizes)
    return None


def whole_sequence_only(dim_position: int) -> Sizes:
    """Slicing ops (their dimension argument at `dim_position`) may take the whole split
    sequence dimension (a no-op slice) but no part of it."""
    def check(sharding: Sharding, node: fx.Node, shard: Shard) -> Shard | None:
        dim = node.args[dim_position] if len(node.args) > dim_position else node.kwargs.get("dim", 0)
        dim = dim % node.args[0].meta["val"].dim()
        full = sharding.full_shape(node.args[0])
        if dim == shard.dim and not (node.target == aten.slice.Tensor
                                     and (len(node.args) < 3 or node.args[2] in (0, None))
                                     and (len(node.args) < 4 or node.args[3] >= full[dim])
                                     and (len(node.args) < 5 or node.args[4] == 1)):
            raise UnsupportedError(f"sequence parallelism: {node.name} ({node.target}) takes part of the split "
                                   "sequence dimension; only whole-sequence slices are supported")
        return None
    return check


# ---------------------------------------------------------------------- rewrites: attention and the loss


# each captured attention op and the ring op that replaces it; the rewrite appends (layout,
# group name, timeout) to the arguments it keeps
RING_OPS = {
    ATTENTION: torch.ops.graphoffload.ring_attention.default,
    ATTENTION_BACKWARD: torch.ops.graphoffload.ring_attention_backward.default,
}


def _global_length(sharding: Sharding, t: fx.Node, seq_dim: int) -> int:
    n = t.meta["val"].shape[seq_dim]
    return n * sharding.world if sharding.spec(t) == Shard(seq_dim) else n


def ring_attention_rewrite(sharding: Sharding, node: fx.Node) -> None:
    """Attention (forward or backward) -> the ring op over each rank's q, k, v (and out, lse)."""
    forward = node.target == ATTENTION
    args = list(node.args) + [None] * (9 - len(node.args))
    if forward:
        q, k, v, mask, causal, scale = args[:6]
        tensors, lse = [q, k, v], None
    else:
        dout, q, k, v, out, lse, mask, causal, scale = args[:9]
        tensors = [dout, q, k, v, out, lse]
    if mask is not None:
        raise UnsupportedError(f"sequence parallelism: attention {node.name} has an attention mask; ring "
                               "attention supports is_causal=True or no mask")
    q_len, k_len = (_global_length(sharding, t, t.meta["val"].dim() - 2) for t in (q, k))
    if q_len != k_len:
        raise UnsupportedError(f"sequence parallelism: attention {node.name} at {user_line(node)} attends {q_len} "
                               f"queries to {k_len} keys; ring attention splits self-attention over the "
                               "sequence (queries and keys of the same length) only")
    local = []
    for t in tensors:
        spec = sharding.spec(t)
        seq_dim = t.meta["val"].dim() - (1 if t is lse else 2)
        if spec == REPLICATED:
            t = sharding.shard_of(t, Shard(seq_dim))
        elif spec != Shard(seq_dim):
            raise UnsupportedError(f"sequence parallelism: attention {node.name} gets {t.name} split as {spec}")
        local.append(t)
    extra = (bool(causal), scale, sharding.layout, sharding.group, float(sharding.timeout_s))
    node.target = RING_OPS[node.target]
    node.args = (*local, *extra)
    node.kwargs = {}
    node.meta["val"] = fake_value(node, sharding.fake_mode)
    sharding.set_spec(node, tuple(Shard(v.dim() - (1 if forward and i == 1 else 2))
                                  for i, v in enumerate(node.meta["val"])))
    sharding.counts["fwd" if forward else "bwd"] += 1


def loss_rewrite(sharding: Sharding, node: fx.Node) -> None:
    """Cross-entropy (`nll_loss_forward`) of sharded logits with mean or sum reduction: the
    local sum and token count, all-reduced together, so the mean is over all ranks' tokens."""
    inp = node.args[0]
    if not isinstance(sharding.spec(inp), Shard):
        return sharding.propagate(node)
    args = list(node.args) + [None] * (5 - len(node.args))
    _, target, weight, reduction, ignore_index = args
    RULES[node.target].align(sharding, node, {n: sharding.spec(n) for n in node.all_input_nodes},
                             [(inp, sharding.spec(inp))])
    target = node.args[1]
    if reduction == 0:
        return sharding.propagate(node)
    phase = node.meta.get("phase")
    dtype = node.meta["val"][0].dtype
    # sums and counts of bf16/fp16 losses are added and divided in fp32 and rounded once, as
    # eager's kernel does: a bf16 count is inexact beyond 256 tokens
    wide = torch.promote_types(dtype, torch.float32)

    def new(target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        return sharding.new_node(target, args, kwargs, like=node, phase=phase)

    def cast(t: fx.Node, to: torch.dtype) -> fx.Node:
        return t if t.meta["val"].dtype == to else new(aten._to_copy.default, (t,), {"dtype": to})

    with sharding.graph.inserting_before(node):
        local = new(aten.nll_loss_forward.default, (inp, target, weight, 2, ignore_index))
        total = cast(new(operator.getitem, (local, 0)), wide)
        count = cast(new(operator.getitem, (local, 1)), wide)
        both = new(aten.stack.default, ([total, count],))
        red = sharding.new_node(c10d.all_reduce.default, (both, "sum", sharding.group), phase="comm", like=node)
        wait = sharding.new_node(c10d.wait_tensor.default, (red,), phase="comm", like=node)
        global_total = new(aten.select.int, (wait, 0, 0))
        global_count = new(aten.select.int, (wait, 0, 1))
        value = global_total if reduction == 2 else new(aten.div.Tensor, (global_total, global_count))
        value, global_count = cast(value, dtype), cast(global_count, dtype)
    for user in list(node.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(value if user.args[1] == 0 else global_count)
            sharding.graph.erase_node(user)
    sharding.graph.erase_node(node)
    sharding.counts["losses"] += 1


# ---------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Rule:
    """How one op propagates the sequence split and partial sums (module docstring)."""

    partials: Literal["none", "one", "all"] = "none"
    over_sequence: Literal["refuse", "sum", "mean"] = "refuse"
    align: Align = align_broadcast
    mixes_positions: Callable[[fx.Node, int], bool] = never_mixes
    sizes: Sizes = keep_sizes
    seed_index: int | None = None
    rewrite: Callable[[Sharding, fx.Node], None] | None = None


# the elementwise rule, for every op without one of its own: partial inputs all-reduced, full
# inputs aligned by broadcasting if torch tags the op pointwise, sizes untouched, a full-shaped
# output of a sharded input refused
FALLBACK = Rule()

RULES: dict[Any, Rule] = {
    # linear in a single partial input (the others replicated); views rewrite their sizes
    **dict.fromkeys((aten.view.default, aten._unsafe_view.default, aten.reshape.default),
                    Rule(partials="one", sizes=view_sizes)),
    **dict.fromkeys((aten.t.default, aten.transpose.int, aten.permute.default, aten.detach.default,
                     aten.clone.default, aten.alias.default, aten.neg.default, aten._to_copy.default,
                     aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.mul.Tensor,
                     aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
                     aten.zero_.default), Rule(partials="one")),   # zero: every rank's zeros sum to zero
    aten.expand.default: Rule(partials="one", sizes=expand_sizes),
    # summing over the sequence gives a partial sum, as does summing partial sums
    aten.sum.dim_IntList: Rule(partials="one", over_sequence="sum"),
    aten.sum.default: Rule(partials="one", over_sequence="sum"),
    # linear when every tensor input is partial (add_: a partial added into a running partial sum)
    **dict.fromkeys((aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor), Rule(partials="all")),
    # weight gradients: contractions over the sequence
    **dict.fromkeys((aten.mm.default, aten.bmm.default, aten.addmm.default),
                    Rule(over_sequence="sum", align=align_matmul)),
    aten.embedding_dense_backward.default: Rule(over_sequence="sum", align=align_indexed(1, 0)),
    aten.native_layer_norm_backward.default: Rule(over_sequence="sum"),
    **dict.fromkeys((aten.mean.dim, aten.mean.default), Rule(over_sequence="mean")),
    # the token embedding starts the split; the loss is averaged over all ranks' tokens
    aten.embedding.default: Rule(seed_index=1),
    aten.nll_loss_forward.default: Rule(align=align_indexed(1, 0), rewrite=loss_rewrite),
    aten.nll_loss_backward.default: Rule(align=align_indexed(2, 1)),
    **dict.fromkeys(RING_OPS, Rule(rewrite=ring_attention_rewrite)),
    # sizes that name the sequence, slices that may not cut it
    **dict.fromkeys((aten.slice_backward.default, aten.select_backward.default), Rule(sizes=slice_backward_sizes)),
    **dict.fromkeys((aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.index_select.default),
                    Rule(sizes=whole_sequence_only(1))),
    **dict.fromkeys((aten.split.Tensor, aten.split_with_sizes.default), Rule(sizes=whole_sequence_only(2))),
    # combining positions along the sequence: refused
    **dict.fromkeys((aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default, aten.cummax.default,
                     aten.cummin.default, aten._softmax.default, aten._log_softmax.default, aten.sort.default,
                     aten.sort.stable, aten.roll.default, aten.flip.default, aten.gather.default),
                    Rule(mixes_positions=mixes_along_dim)),
    aten.convolution.default: Rule(mixes_positions=mixes_convolution),
}


def rule_for(target: Any) -> Rule:
    """The op's rule; `FALLBACK` (elementwise propagation) for an op without one."""
    return RULES.get(target, FALLBACK)
