"""ring_attention: split the step's sequence across the ranks of a `SequenceParallel` group.

The captured graph computes the whole sequence. This pass makes each rank compute its 1/N of
it (zigzag or contiguous layout, `runtime/ring_attention.py`):

* **Seeds.** The token embedding (`aten.embedding` of a batch tensor) is where activations
  start: its indices are sharded along the sequence, so every activation after it is a shard.
* **Propagation.** Nodes are visited in order. A node whose inputs are all full stays full
  (position ids, rotary tables, labels, their shift inside the model: cheap, and computed on
  the whole sequence, so no chunk loses its boundary target). Where a full tensor first meets a
  sharded one (an elementwise op, the loss's targets, an embedding gradient's indices) it is
  sharded there, by the same layout, so positions become each rank's global positions. Size
  arguments (`view`, `expand`, `slice_backward`) are rewritten to the local length, and every
  node's `meta["val"]` is recomputed on the graph's fake tensors. Ops that combine positions
  along the split sequence (a cumulative sum, a softmax over it, a convolution) are rejected.
* **Attention** is the only op that needs the other ranks: each attention node pair is
  retargeted by the rule table `RING_RULES` to the ring ops.
* **Reductions over the sequence** (weight gradients: `mm`, `sum`, embedding and norm
  backward) give partial sums; linear ops keep them partial, anything else gets an
  all-reduce first. Parameter gradients are all-reduced in buckets (one
  `_c10d_functional.all_reduce_coalesced` + `wait_tensor` per optimizer update kernel, right
  after its last gradient is produced), so every rank applies the same update.
* **The loss** (`nll_loss_forward`, i.e. cross-entropy, with mean reduction) becomes the sum
  over local tokens, all-reduced with the token count: the mean over all tokens of all ranks,
  and its backward divides by the global count.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from graphoffload.aliasing import written_args
from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.errors import UnsupportedError, describe
from graphoffload.graph import TrainGraph, fake_mode_of
from graphoffload.bucketing import greedy_buckets
from graphoffload.passes.update_kernels import kernel_rule
from graphoffload.ops.attention import ATTENTION, ATTENTION_BACKWARD
from graphoffload.ops.ring_attention import chunk_ranges

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
# Rule table (JAX-style): each captured attention op and the ring op that replaces it. The
# pass appends (layout, group name, timeout) to the arguments it keeps.
RING_RULES = {
    ATTENTION: torch.ops.graphoffload.ring_attention.default,
    ATTENTION_BACKWARD: torch.ops.graphoffload.ring_attention_backward.default,
}


@dataclass(frozen=True)
class Shard:
    """The value is this rank's part of the sequence along `dim`, whose full size is
    outer * seq_len * inner (a flattened dim such as batch x sequence has outer = batch)."""

    dim: int
    outer: int = 1
    inner: int = 1


PARTIAL = "partial"   # full shape, but a partial sum over this rank's tokens

VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# ops whose output is linear in a single partial input (others replicated)
LINEAR_UNARY = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
                aten.transpose.int, aten.permute.default, aten.detach.default, aten.clone.default,
                aten.alias.default, aten.neg.default, aten._to_copy.default, aten.unsqueeze.default,
                aten.squeeze.dim, aten.squeeze.default, aten.sum.dim_IntList, aten.sum.default,
                aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.expand.default,
                aten.zero_.default}   # zero: every rank's zeros sum to zero
# linear when every tensor input is partial (add_: a partial added into a running partial sum)
LINEAR_SUM = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor}
# ops that sum over the sequence when it is sharded: their full-shaped outputs are partial
REDUCING = {aten.sum.dim_IntList, aten.sum.default, aten.mm.default, aten.bmm.default, aten.addmm.default,
            aten.embedding_dense_backward.default, aten.native_layer_norm_backward.default}
LEFT_ALIGNED = {aten.embedding_dense_backward.default: (1, 0), aten.nll_loss_forward.default: (1, 0),
                aten.nll_loss_backward.default: (2, 1)}   # op: (index tensor position, data position)
# ops that combine values at different positions along their `dim`/`dims` argument: on one
# rank's part of the sequence they keep its shape but compute something else
ALONG_DIM = {aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default, aten.cummax.default,
             aten.cummin.default, aten._softmax.default, aten._log_softmax.default, aten.sort.default,
             aten.sort.stable, aten.roll.default, aten.flip.default, aten.gather.default}


class _Sharder:
    def __init__(self, graph: TrainGraph, sp: Any):
        self.tg = graph
        self.g = graph.graph
        self.sp = sp
        self.rank, self.world, self.group = sp.rank, sp.world_size, sp.group_name
        self.fake_mode = fake_mode_of(self.g)
        self.orig = {n: n.meta.get("val") for n in self.g.nodes}   # full-sequence values
        # gradient accumulation's running sums (accumulation_steps=k) hold each rank's partial sum
        # over the window: nothing reduces them until the update adds the last micro-batch's
        # gradient, so gradients cross the group once per update, not once per micro-batch
        self.grad_sums = {n for n in self.g.nodes if n.op == "placeholder"
                          and graph.signature.input(n.name).kind == "grad_sum"}
        self.spec: dict[fx.Node, Any] = {n: PARTIAL for n in self.grad_sums}
        self.shards: dict[tuple[fx.Node, Shard], fx.Node] = {}
        self.reduced: dict[fx.Node, fx.Node] = {}
        self.counts: Counter = Counter()
        attn = [n for n in self.g.nodes if n.op == "call_function" and n.target == ATTENTION]
        if not attn:
            raise UnsupportedError("sequence_parallel was given but the step has no attention "
                                   "(F.scaled_dot_product_attention) to split")
        lengths = {n.args[0].meta["val"].shape[-2] for n in attn}
        if len(lengths) != 1:
            raise UnsupportedError(f"attention calls see different sequence lengths {sorted(lengths)}; "
                                   "sequence parallelism needs one")
        self.seq = lengths.pop()
        try:
            chunk_ranges(sp.layout, 0, self.world, self.seq)
        except ValueError as exc:
            raise UnsupportedError(f"sequence parallelism: {exc}; pad the batch's sequence to such a length") from exc
        batch = {n for n in self.g.nodes if n.op == "placeholder" and graph.signature.input(n.name).kind == "batch"}
        self.from_batch: set[fx.Node] = set()
        for n in self.g.nodes:
            if n in batch or any(i in self.from_batch for i in n.all_input_nodes):
                self.from_batch.add(n)
        # parameter gradients in the order they are produced, cut into all-reduce buckets of at
        # most `bucket_numel` elements; each bucket goes right after its last gradient
        self.position = {n: i for i, n in enumerate(self.g.nodes)}
        grads: dict[fx.Node, None] = {}
        for node in self.g.nodes:
            if kernel_rule(node) is not None:
                grads.update((g, None) for g in node.args[1] if isinstance(g, fx.Node))
        self.buckets: dict[fx.Node, list[fx.Node]] = {
            bucket[-1]: bucket for bucket in greedy_buckets(sorted(grads, key=self.position.__getitem__),
                                                            lambda g: g.meta["val"].numel(), sp.bucket_numel)}

    # ------------------------------------------------------------------ helpers

    def _new(self, target: Any, args: tuple, kwargs: dict | None = None, phase: str | None = None,
             like: fx.Node | None = None) -> fx.Node:
        node = self.g.call_function(target, args, kwargs or {})
        a, k = fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*a, **k)
        if phase:
            node.meta["phase"] = phase
        if like is not None:
            for key in ("stack_trace", "grad_of"):
                if key in like.meta:
                    node.meta[key] = like.meta[key]
        return node

    def shard_of(self, node: fx.Node, s: Shard) -> fx.Node:
        """This rank's part of full-sequence `node` (inserted right after it, made once)."""
        key = (node, s)
        if key in self.shards:
            return self.shards[key]
        shape = list(node.meta["val"].shape)
        phase = node.meta.get("phase") if node.meta.get("phase") not in ("input", None) else "forward"
        anchor = node
        if node.op == "placeholder":
            anchor = [n for n in self.g.nodes if n.op == "placeholder"][-1]

        def emit(target: Any, args: tuple) -> fx.Node:
            nonlocal anchor
            with self.g.inserting_after(anchor):
                anchor = self._new(target, args, phase=phase, like=node)
            return anchor

        x, d = node, s.dim
        if s.outer != 1 or s.inner != 1:
            x = emit(aten.view.default, (x, shape[:s.dim] + [s.outer, self.seq, s.inner] + shape[s.dim + 1:]))
            d = s.dim + 1
        parts = [emit(aten.slice.Tensor, (x, d, a, b))
                 for a, b in chunk_ranges(self.sp.layout, self.rank, self.world, self.seq)]
        out = parts[0] if len(parts) == 1 else emit(aten.cat.default, (parts, d))
        if s.outer != 1 or s.inner != 1:
            local = list(shape)
            local[s.dim] //= self.world
            out = emit(aten.reshape.default, (out, local))
        self.shards[key] = out
        self.spec[out] = s
        self.counts["sharded"] += 1
        return out

    def reduce(self, node: fx.Node, mean: bool = False) -> fx.Node:
        """All-reduce a partial value (made once, right after it); `mean`: average over ranks."""
        if node in self.reduced:
            return self.reduced[node]
        with self.g.inserting_after(node):
            red = self._new(c10d.all_reduce.default, (node, "sum", self.group), phase="comm", like=node)
        with self.g.inserting_after(red):
            wait = self._new(c10d.wait_tensor.default, (red,), phase="comm", like=node)
        if mean:   # gloo has no average: sum, then divide by the ranks
            with self.g.inserting_after(wait):
                wait = self._new(aten.div.Scalar, (wait, self.world), phase=node.meta.get("phase"), like=node)
        self.reduced[node] = wait
        self.spec[wait] = None
        self.counts["partials"] += 1
        return wait

    # ------------------------------------------------------------------ propagation

    def run(self) -> None:
        for node in list(self.g.nodes):
            if node.op == "call_function":
                self.visit(node)
                if node in self.buckets:
                    self.reduce_gradients(node)
            elif node.op == "output":
                self.finish(node)

    def visit(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            src = self.spec.get(node.args[0])
            if isinstance(src, tuple):
                self.spec[node] = src[node.args[1]]
                node.meta["val"] = node.args[0].meta["val"][node.args[1]]
            return
        inputs = node.all_input_nodes
        specs = {n: self.spec.get(n) for n in inputs}
        seed = node.target == aten.embedding.default and len(node.args) > 1 and node.args[1] in self.from_batch \
            and specs[node.args[1]] is None and self.seq in node.args[1].meta["val"].shape
        if not seed and not any(s is not None for s in specs.values()):
            return
        if seed:
            idx = node.args[1]
            shape = idx.meta["val"].shape
            # the batch's sequence dimension as the user declared it; else the last of that length
            # (token ids are (batch, seq): with batch == seq, the later one)
            dim = self.sp.seq_dim if self.sp.seq_dim < len(shape) and shape[self.sp.seq_dim] == self.seq \
                else max(i for i, n in enumerate(shape) if n == self.seq)
            node.update_arg(1, self.shard_of(idx, Shard(dim)))
            self.counts["seeds"] += 1
        if node.target in RING_RULES:
            return self.attention(node)
        if node.target == aten.nll_loss_forward.default and isinstance(specs.get(node.args[0]), Shard):
            return self.loss(node)
        self.generic(node)

    def _full_size(self, node: fx.Node, s: Shard) -> int:
        return self.orig[node].shape[s.dim] if node in self.orig else s.outer * self.seq * s.inner

    def generic(self, node: fx.Node) -> None:
        target = node.target
        specs = {n: self.spec.get(n) for n in node.all_input_nodes}
        partial = [n for n, s in specs.items() if s == PARTIAL]
        sharded = [(n, s) for n, s in specs.items() if isinstance(s, Shard)]
        tensors = [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        linear = (target in LINEAR_UNARY and len(partial) == 1 and not sharded and
                  all(specs[n] is None for n in tensors if n not in partial)) or \
                 (target in LINEAR_SUM and len(partial) == len(tensors))
        if partial and not linear:
            if any(n in self.grad_sums for n in written_args(node)):
                # reducing the running sum first would leave the write in a copy and the sum as it was
                where = user_line_of_stack_trace(node.meta.get("stack_trace")) or "an unknown line"
                raise UnsupportedError(
                    f"sequence parallelism with accumulation_steps: {node.name} ({target}) at {where} writes into "
                    "a running gradient sum, which holds each rank's partial sum until the update, with a value "
                    "that is not a partial sum; accumulate inside the step instead (a loop over micro-batches)")
            for n in partial:
                node.replace_input_with(n, self.reduce(n))
            specs = {n: self.spec.get(n) for n in node.all_input_nodes}
            partial = []
        if sharded:
            self.meet(node, specs, sharded)
        self.rewrite_sizes(node)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        try:
            with self.fake_mode:
                val = target(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported with the op and the user's line
            where = user_line_of_stack_trace(node.meta.get("stack_trace")) or "an unknown line"
            raise UnsupportedError(
                f"sequence parallelism cannot split {node.name} ({target}) at {where}: "
                f"{describe(exc)}") from exc
        node.meta["val"] = val
        orig = self.orig.get(node)
        if isinstance(val, (tuple, list)):
            self.spec[node] = tuple(self.out_spec(node, o, v, sharded, partial) for o, v in zip(orig, val))
        else:
            self.spec[node] = self.out_spec(node, orig, val, sharded, partial)
        if self.spec[node] == "mean":
            self.spec[node] = PARTIAL
            users = list(node.users)
            wait = self.reduce(node, mean=True)
            for u in users:
                u.replace_input_with(node, wait)

    def out_spec(self, node, orig, val, sharded, partial) -> Any:
        if not isinstance(val, torch.Tensor):
            return None
        full, local = tuple(orig.shape), tuple(val.shape)
        diff = [d for d in range(len(full)) if full[d] != local[d]]
        if not diff:
            if sharded:
                if node.target in REDUCING:
                    return PARTIAL
                if node.target in (aten.mean.dim, aten.mean.default):
                    return "mean"
                raise UnsupportedError(f"sequence parallelism: {node.name} ({node.target}) reduces over the "
                                       "split sequence in a way graphoffload cannot combine across ranks")
            return PARTIAL if partial else None
        if len(diff) != 1 or local[diff[0]] * self.world != full[diff[0]]:
            raise UnsupportedError(f"sequence parallelism: {node.name} ({node.target}) changed shape "
                                   f"{list(full)} -> {list(local)} in a way that is not a split of the sequence")
        d = diff[0]
        if node.target in VIEWS and self._view_structure is not None:
            return self._view_structure
        for n, s in sharded:
            if self._full_size(n, s) == full[d]:
                return Shard(d, s.outer, s.inner)
        if full[d] % self.seq == 0:
            return Shard(d, full[d] // self.seq, 1)
        raise UnsupportedError(f"sequence parallelism: cannot tell how {node.name} ({node.target}) splits the sequence")

    _view_structure: Shard | None = None

    def meet(self, node: fx.Node, specs: dict, sharded: list) -> None:
        """Shard the full inputs that line up with a sharded input's sequence dimension."""
        ref_node, ref = sharded[0]
        ref_full = self._full_size(ref_node, ref)
        target = node.target
        if target in (aten.mm.default, aten.bmm.default, aten.addmm.default):
            a, b = node.args[-2], node.args[-1]
            sa, sb = specs.get(a), specs.get(b)
            if isinstance(sa, Shard) and sa.dim == a.meta["val"].dim() - 1 and sb is None:
                node.replace_input_with(b, self.shard_of(b, Shard(b.meta["val"].dim() - 2, sa.outer, sa.inner)))
            elif isinstance(sb, Shard) and sb.dim == b.meta["val"].dim() - 2 and sa is None:
                node.replace_input_with(a, self.shard_of(a, Shard(a.meta["val"].dim() - 1, sb.outer, sb.inner)))
            return
        if target in LEFT_ALIGNED:
            index_pos, data_pos = LEFT_ALIGNED[target]
            idx, data = node.args[index_pos], node.args[data_pos]
            sd = specs.get(data)
            if isinstance(idx, fx.Node) and specs.get(idx) is None and isinstance(sd, Shard):
                ishape = idx.meta["val"].shape
                if sd.dim < len(ishape) and ishape[sd.dim] == self._full_size(data, sd):
                    node.replace_input_with(idx, self.shard_of(idx, sd))
            return
        if target in RING_RULES or torch.Tag.pointwise not in getattr(target, "tags", ()):
            # broadcasting lines dimensions up only for elementwise ops: an embedding's table
            # as wide as the sequence is long is not a full-sequence tensor
            return
        out_ndim = max(n.meta["val"].dim() for n in specs if isinstance(n.meta.get("val"), torch.Tensor))
        pos = ref.dim + out_ndim - ref_node.meta["val"].dim()
        for n, s in specs.items():
            if s is not None or not isinstance(n.meta.get("val"), torch.Tensor):
                continue
            shape = n.meta["val"].shape
            d = pos - (out_ndim - len(shape))
            if 0 <= d < len(shape) and shape[d] == ref_full and shape[d] > 1:
                node.replace_input_with(n, self.shard_of(n, Shard(d, ref.outer, ref.inner)))

    def rewrite_sizes(self, node: fx.Node) -> None:
        """Size arguments that name the sequence length become the local length."""
        self._view_structure = None
        target = node.target
        x = node.args[0] if node.args else None
        s = self.spec.get(x) if isinstance(x, fx.Node) else None
        if not isinstance(s, Shard):
            return
        full_in = self.orig[x].shape if x in self.orig else None
        if self._mixes_positions(node, s.dim):
            where = user_line_of_stack_trace(node.meta.get("stack_trace")) or "an unknown line"
            raise UnsupportedError(f"sequence parallelism: {node.name} ({target}) at {where} combines positions "
                                   "along the split sequence dimension; only attention may do that")
        if target in VIEWS:
            out = list(self.orig[node].shape)
            in_shape = list(full_in)
            stride = s.inner * math.prod(in_shape[s.dim + 1:])
            span = stride * self.seq
            for e in range(len(out)):
                p, n = math.prod(out[e + 1:]), out[e]
                if p <= stride and stride % p == 0 and span <= p * n and (p * n) % span == 0:
                    self._view_structure = Shard(e, (n * p) // span, stride // p)
                    out[e] = n // self.world
                    node.update_arg(1, out)
                    return
            raise UnsupportedError(f"sequence parallelism: {node.name} reshapes {in_shape} to "
                                   f"{list(self.orig[node].shape)}, splitting the sequence dimension")
        if target == aten.expand.default:
            out = list(self.orig[node].shape)
            out[s.dim + len(out) - x.meta["val"].dim()] //= self.world
            node.update_arg(1, out)
        elif target in (aten.slice_backward.default, aten.select_backward.default):
            sizes, dim = list(node.args[1]), node.args[2]
            d = s.dim if target == aten.slice_backward.default or s.dim < dim else s.dim + 1
            if d == dim:
                raise UnsupportedError(f"sequence parallelism: {node.name} slices along the split sequence")
            sizes[d] //= self.world
            node.update_arg(1, sizes)
        elif target in (aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.split.Tensor,
                        aten.split_with_sizes.default, aten.index_select.default):
            at = 2 if target in (aten.split.Tensor, aten.split_with_sizes.default) else 1
            dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
            dim = dim % x.meta["val"].dim()
            if dim == s.dim and not (target == aten.slice.Tensor and (len(node.args) < 3 or node.args[2] in (0, None))
                                     and (len(node.args) < 4 or node.args[3] >= full_in[dim])
                                     and (len(node.args) < 5 or node.args[4] == 1)):
                raise UnsupportedError(f"sequence parallelism: {node.name} ({target}) takes part of the split "
                                       "sequence dimension; only whole-sequence slices are supported")

    @staticmethod
    def _mixes_positions(node: fx.Node, seq_dim: int) -> bool:
        ndim = node.args[0].meta["val"].dim()
        if node.target == aten.convolution.default:   # (input, weight, bias, stride, padding, ...)
            axis = seq_dim - 2
            return axis >= 0 and (node.args[1].meta["val"].shape[seq_dim] > 1 or node.args[3][axis] != 1
                                  or node.args[4][axis] != 0)
        if node.target not in ALONG_DIM:
            return False
        for i, arg in enumerate(node.target._schema.arguments):
            if arg.name in ("dim", "dims"):
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
                dims = value if isinstance(value, (list, tuple)) else [value]
                # roll with no dims rolls the flattened tensor
                return not dims or seq_dim in {d % ndim for d in dims}
        return False

    # ------------------------------------------------------------------ attention and loss

    def attention(self, node: fx.Node) -> None:
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
        q_len, k_len = (self._global_length(t, t.meta["val"].dim() - 2) for t in (q, k))
        if q_len != k_len:
            where = user_line_of_stack_trace(node.meta.get("stack_trace")) or "an unknown line"
            raise UnsupportedError(f"sequence parallelism: attention {node.name} at {where} attends {q_len} "
                                   f"queries to {k_len} keys; ring attention splits self-attention over the "
                                   "sequence (queries and keys of the same length) only")
        local = []
        for t in tensors:
            st = self.spec.get(t)
            seq_dim = t.meta["val"].dim() - (1 if t is lse else 2)
            if st is None:
                t = self.shard_of(t, Shard(seq_dim))
            elif st != Shard(seq_dim):
                raise UnsupportedError(f"sequence parallelism: attention {node.name} gets {t.name} split as {st}")
            local.append(t)
        extra = (bool(causal), scale, self.sp.layout, self.group, float(self.sp.timeout_s))
        node.target = RING_RULES[node.target]
        node.args = (*local, *extra)
        node.kwargs = {}
        a = fx.map_arg(node.args, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = node.target(*a)
        self.spec[node] = tuple(Shard(v.dim() - (1 if forward and i == 1 else 2)) for i, v in enumerate(node.meta["val"]))
        self.counts["fwd" if forward else "bwd"] += 1

    def _global_length(self, t: fx.Node, seq_dim: int) -> int:
        n = t.meta["val"].shape[seq_dim]
        return n * self.world if self.spec.get(t) == Shard(seq_dim) else n

    def loss(self, node: fx.Node) -> None:
        """Cross-entropy's mean over all ranks' tokens: local sum and count, all-reduced together."""
        args = list(node.args) + [None] * (5 - len(node.args))
        inp, target, weight, reduction, ignore_index = args
        self.meet(node, {n: self.spec.get(n) for n in node.all_input_nodes}, [(inp, self.spec[inp])])
        target = node.args[1]
        if reduction == 0:
            return self.generic(node)
        phase = node.meta.get("phase")
        dtype = node.meta["val"][0].dtype
        # sums and counts of bf16/fp16 losses are added and divided in fp32 and rounded once, as
        # eager's kernel does: a bf16 count is inexact beyond 256 tokens
        wide = torch.promote_types(dtype, torch.float32)

        def cast(t: fx.Node, to: torch.dtype) -> fx.Node:
            if t.meta["val"].dtype == to:
                return t
            return self._new(aten._to_copy.default, (t,), {"dtype": to}, like=node, phase=phase)

        with self.g.inserting_before(node):
            local = self._new(aten.nll_loss_forward.default, (inp, target, weight, 2, ignore_index), like=node,
                              phase=phase)
            total = cast(self._new(operator.getitem, (local, 0), like=node, phase=phase), wide)
            count = cast(self._new(operator.getitem, (local, 1), like=node, phase=phase), wide)
            both = self._new(aten.stack.default, ([total, count],), like=node, phase=phase)
            red = self._new(c10d.all_reduce.default, (both, "sum", self.group), phase="comm", like=node)
            wait = self._new(c10d.wait_tensor.default, (red,), phase="comm", like=node)
            g_total = self._new(aten.select.int, (wait, 0, 0), like=node, phase=phase)
            g_count = self._new(aten.select.int, (wait, 0, 1), like=node, phase=phase)
            value = g_total if reduction == 2 else self._new(aten.div.Tensor, (g_total, g_count), like=node,
                                                              phase=phase)
            value, g_count = cast(value, dtype), cast(g_count, dtype)
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(value if user.args[1] == 0 else g_count)
                self.g.erase_node(user)
        self.g.erase_node(node)
        self.counts["losses"] += 1

    # ------------------------------------------------------------------ gradients and outputs

    def reduce_gradients(self, last: fx.Node) -> None:
        grads = []
        for g in self.buckets[last]:
            if self.spec.get(g) == PARTIAL:
                grads.append(g)
            elif isinstance(self.spec.get(g), Shard):
                raise UnsupportedError(f"sequence parallelism: the gradient {g.name} of parameter "
                                       f"{g.meta.get('param')} is split along the sequence; parameters whose "
                                       "shape follows the sequence length are not supported")
        if not grads:
            return
        with self.g.inserting_after(last):
            red = self._new(c10d.all_reduce_coalesced.default, (grads, "sum", self.group), phase="comm", like=last)
        after = red
        waits = []
        for i, g in enumerate(grads):
            with self.g.inserting_after(after):
                item = self._new(operator.getitem, (red, i), phase="comm", like=g)
            with self.g.inserting_after(item):
                wait = self._new(c10d.wait_tensor.default, (item,), phase="comm", like=g)
            if "param" in g.meta:
                wait.meta["param"] = g.meta["param"]
                item.meta["param"] = g.meta["param"]
            after = wait
            waits.append(wait)
            self.spec[wait] = None
            self.reduced[g] = wait
        for g, wait in zip(grads, waits):
            g.replace_all_uses_with(wait, delete_user_cb=lambda u: u is not red)
        self.counts["buckets"] += 1
        self.counts["grads"] += len(grads)

    def finish(self, output: fx.Node) -> None:
        outs = list(output.args[0])
        for i, o in enumerate(outs):
            if isinstance(o, fx.Node) and self.spec.get(o) == PARTIAL:
                outs[i] = self.reduce(o)
            elif isinstance(o, fx.Node) and isinstance(self.spec.get(o), Shard):
                self.counts["sharded_outputs"] += 1
        output.args = (outs,)


def ring_attention(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    sp = ctx.config.sequence_parallel
    if sp is None:
        return graph
    sharder = _Sharder(graph, sp)
    sharder.run()
    graph.gm.recompile()
    c = sharder.counts
    graph.note("ring_attention", f"rank {sharder.rank} of {sharder.world}, {sp.layout} layout: the sequence of "
               f"{sharder.seq} tokens is split into {sharder.seq // sharder.world} per rank")
    graph.note("ring_attention", f"{c['fwd']} attention forward and {c['bwd']} backward nodes -> ring attention "
               f"({sharder.world - 1} key/value exchanges forward, {2 * sharder.world - 1} backward, each)",
               "attention", forward=c["fwd"], backward=c["bwd"])
    graph.note("ring_attention", f"{c['seeds']} token embedding(s) split; {c['sharded']} full-sequence tensors "
               "(positions, labels, rotary tables) sharded where they meet the split sequence")
    graph.note("ring_attention", f"{c['grads']} parameter gradients all-reduced in {c['buckets']} buckets; "
               f"{c['losses']} loss(es) averaged over all ranks' tokens; {c['partials']} other partial sums "
               "all-reduced", "reductions", gradients=c["grads"], gradient_buckets=c["buckets"],
               losses=c["losses"], other_partials=c["partials"])
    if c["sharded_outputs"]:
        graph.note("ring_attention", f"{c['sharded_outputs']} step outputs are this rank's part of the sequence")
    return graph
