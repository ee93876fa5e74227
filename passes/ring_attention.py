"""ring_attention: split the step's sequence across the ranks of a `SequenceParallel` group.

The captured graph computes the whole sequence. This pass makes each rank compute its 1/N of
it (zigzag or contiguous layout, `runtime/ring_attention.py`). It walks the graph once, giving
each node a `Spec` (this rank's `Shard` of the sequence, a `PARTIAL` sum over its tokens, or
`REPLICATED`); what it does at a node is that op's rule in `ring_attention_rules.RULES`, or
the elementwise `FALLBACK` for an op without one:

* **Seeds.** The token embedding (`aten.embedding` of a batch tensor) is where activations
  start: its indices are sharded along the sequence, so every activation after it is a shard.
* **Propagation.** A node whose inputs are all replicated stays so (position ids, rotary
  tables, labels, their shift inside the model: cheap, and computed on the whole sequence, so
  no chunk loses its boundary target). Where a full tensor first meets a sharded one (an
  elementwise op, the loss's targets, an embedding gradient's indices) it is sharded there, by
  the same layout, so positions become each rank's global positions. Size arguments (`view`,
  `expand`, `slice_backward`) are rewritten to the local length, and every node's
  `meta["val"]` is recomputed on the graph's fake tensors. Ops that combine positions along
  the split sequence (a cumulative sum, a softmax over it, a convolution) are rejected.
* **Attention** is the only op that needs the other ranks: its rule retargets each attention
  node pair to the ring ops.
* **Reductions over the sequence** (weight gradients: `mm`, `sum`, embedding and norm
  backward) give partial sums; linear ops keep them partial, anything else gets an
  all-reduce first. Parameter gradients are all-reduced in buckets (one
  `_c10d_functional.all_reduce_coalesced` + `wait_tensor` per optimizer update kernel, right
  after its last gradient is produced), so every rank applies the same update.
  With `data_parallel=` (ZeRO over the other dimension of a mesh) the pass leaves the
  parameter gradients partial and lists them in a `deferred_gradients` note: the `zero` pass
  reduces them over both groups in its own bucket collectives. An accumulating call of
  `accumulation_steps` has no update to read gradients, yet `zero` may reduce its gradients too
  (host running sums, which it reduce-scatters every call): there the note lists the gradients
  backward adds into the running sums of the parameters the window's update updates (capture's
  `accumulation` note, `updated`), the ones the updating call's update reads, so both calls
  tell `zero` the same thing.
* **The loss** (`nll_loss_forward`, i.e. cross-entropy, with mean reduction) becomes the sum
  over local tokens, all-reduced with the token count: the mean over all tokens of all ranks,
  and its backward divides by the global count.
"""
from __future__ import annotations

import operator
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from graphoffload.aliasing import written_args
from graphoffload.bucketing import greedy_buckets
from graphoffload.errors import UnsupportedError, describe
from graphoffload.graph import TrainGraph, fake_mode_of, fake_value
from graphoffload.ops.attention import ATTENTION
from graphoffload.ops.ring_attention import chunk_ranges
from graphoffload.passes.ring_attention_rules import PARTIAL, REPLICATED, Rule, Shard, Spec, rule_for, user_line
from graphoffload.passes.update_kernels import kernel_rule

if TYPE_CHECKING:
    from graphoffload.passes.manager import PassContext

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class _Sharder:
    """The walk over the graph: each node's `Spec`, the shards and all-reduces it inserted.
    What it does at a node is the node's rule (`ring_attention_rules.rule_for`)."""

    def __init__(self, train_graph: TrainGraph, sp: Any, defer_gradients: bool = False, host_sums: bool = False):
        self.train_graph = train_graph
        # with ZeRO (`data_parallel=`) over the other dimension of a mesh, the parameter
        # gradients' partial sums are left to the `zero` pass, which reduces them over both groups
        self.defer_gradients = defer_gradients
        # ZeRO's host sums (`CompileConfig.host_sums_under_zero`): `zero` replaces each add into a
        # running sum by its own reduction of the gradient and a host add, so those adds are left as
        # they are, whatever the gradient's spec (a gradient whole over sp too)
        self.host_sums = host_sums
        self.deferred: list[str] = []
        self.graph = train_graph.graph
        self.sp = sp
        self.rank, self.world, self.group = sp.rank, sp.world_size, sp.group_name
        self.layout, self.timeout_s = sp.layout, sp.timeout_s
        self.fake_mode = fake_mode_of(self.graph)
        self.full_values = {n: n.meta.get("val") for n in self.graph.nodes}   # full-sequence values
        # gradient accumulation's running sums (accumulation_steps=k) hold each rank's partial sum
        # over the window: nothing reduces them until the update adds the last micro-batch's
        # gradient, so gradients cross the group once per update, not once per micro-batch
        self.grad_sums = {n for n in self.graph.nodes if n.op == "placeholder"
                          and train_graph.signature.input(n.name).kind == "grad_sum"}
        self.specs: dict[fx.Node, Spec] = {n: PARTIAL for n in self.grad_sums}
        self.output_specs: dict[fx.Node, tuple[Spec, ...]] = {}   # nodes with several outputs
        self.shards: dict[tuple[fx.Node, Shard], fx.Node] = {}
        self.reduced: dict[fx.Node, fx.Node] = {}
        self.counts: Counter = Counter()
        attn = [n for n in self.graph.nodes if n.op == "call_function" and n.target == ATTENTION]
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
        batch = {n for n in self.graph.nodes
                 if n.op == "placeholder" and train_graph.signature.input(n.name).kind == "batch"}
        self.from_batch: set[fx.Node] = set()
        for n in self.graph.nodes:
            if n in batch or any(i in self.from_batch for i in n.all_input_nodes):
                self.from_batch.add(n)
        # parameter gradients in the order they are produced, cut into all-reduce buckets of at
        # most `bucket_numel` elements; each bucket goes right after its last gradient
        self.position = {n: i for i, n in enumerate(self.graph.nodes)}
        grads: dict[fx.Node, None] = {}
        for node in self.graph.nodes:
            if kernel_rule(node) is not None:
                grads.update((self._produced(grad), None) for grad in node.args[1] if isinstance(grad, fx.Node))
        self.buckets: dict[fx.Node, list[fx.Node]] = {
            bucket[-1]: bucket for bucket in greedy_buckets(sorted(grads, key=self.position.__getitem__),
                                                            lambda grad: grad.meta["val"].numel(),
                                                            sp.bucket_numel)}

    def _produced(self, grad: fx.Node) -> fx.Node:
        """The gradient as backward produced it: with ZeRO (`defer_gradients`), the gradient
        clipping's in-place `mul_` scaled (the update reads what `mul_` returned), so it is taken
        as reduced from where backward makes it, before clipping's norms read it."""
        if self.defer_gradients and grad.target in (aten.mul_.Tensor, aten.mul_.Scalar):
            return grad.args[0]
        return grad

    # ------------------------------------------------------------------ what rules see

    def spec(self, node: fx.Node) -> Spec:
        return self.specs.get(node, REPLICATED)

    def set_spec(self, node: fx.Node, spec: Spec | tuple[Spec, ...]) -> None:
        if isinstance(spec, tuple):
            self.output_specs[node] = spec
        else:
            self.specs[node] = spec

    def full_shape(self, node: fx.Node) -> torch.Size | None:
        """`node`'s shape in the captured graph (the whole sequence); None for a node the pass made."""
        return self.full_values[node].shape if node in self.full_values else None

    def full_size(self, node: fx.Node, shard: Shard) -> int:
        """The full size of `node`'s split dimension."""
        full = self.full_shape(node)
        return full[shard.dim] if full is not None else shard.outer * self.seq * shard.inner

    def new_node(self, target: Any, args: tuple, kwargs: dict | None = None, phase: str | None = None,
                 like: fx.Node | None = None) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs or {})
        node.meta["val"] = fake_value(node, self.fake_mode)
        if phase:
            node.meta["phase"] = phase
        if like is not None:
            for key in ("stack_trace", "grad_of"):
                if key in like.meta:
                    node.meta[key] = like.meta[key]
        return node

    def shard_of(self, node: fx.Node, shard: Shard) -> fx.Node:
        """This rank's part of full-sequence `node` (inserted right after it, made once)."""
        key = (node, shard)
        if key in self.shards:
            return self.shards[key]
        shape = list(node.meta["val"].shape)
        phase = node.meta.get("phase") if node.meta.get("phase") not in ("input", None) else "forward"
        anchor = node
        if node.op == "placeholder":
            anchor = [n for n in self.graph.nodes if n.op == "placeholder"][-1]

        def emit(target: Any, args: tuple) -> fx.Node:
            nonlocal anchor
            with self.graph.inserting_after(anchor):
                anchor = self.new_node(target, args, phase=phase, like=node)
            return anchor

        x, dim = node, shard.dim
        if shard.outer != 1 or shard.inner != 1:
            x = emit(aten.view.default, (x, shape[:shard.dim] + [shard.outer, self.seq, shard.inner]
                                         + shape[shard.dim + 1:]))
            dim = shard.dim + 1
        parts = [emit(aten.slice.Tensor, (x, dim, start, end))
                 for start, end in chunk_ranges(self.layout, self.rank, self.world, self.seq)]
        out = parts[0] if len(parts) == 1 else emit(aten.cat.default, (parts, dim))
        if shard.outer != 1 or shard.inner != 1:
            local = list(shape)
            local[shard.dim] //= self.world
            out = emit(aten.reshape.default, (out, local))
        self.shards[key] = out
        self.specs[out] = shard
        self.counts["sharded"] += 1
        return out

    def reduce(self, node: fx.Node, mean: bool = False) -> fx.Node:
        """All-reduce a partial value (made once, right after it); `mean`: average over ranks."""
        if node in self.reduced:
            return self.reduced[node]
        with self.graph.inserting_after(node):
            red = self.new_node(c10d.all_reduce.default, (node, "sum", self.group), phase="comm", like=node)
        with self.graph.inserting_after(red):
            wait = self.new_node(c10d.wait_tensor.default, (red,), phase="comm", like=node)
        if mean:   # gloo has no average: sum, then divide by the ranks
            with self.graph.inserting_after(wait):
                wait = self.new_node(aten.div.Scalar, (wait, self.world), phase=node.meta.get("phase"), like=node)
        self.reduced[node] = wait
        self.specs[wait] = REPLICATED
        self.counts["partials"] += 1
        return wait

    # ------------------------------------------------------------------ the walk

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "call_function":
                self.visit(node)
                if node in self.buckets:
                    self.reduce_gradients(node)
            elif node.op == "output":
                self.finish(node)

    def visit(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            source, position = node.args
            if source in self.output_specs:
                self.specs[node] = self.output_specs[source][position]
                node.meta["val"] = source.meta["val"][position]
            return
        summed = self._summed_gradient(node)
        if summed is not None:
            self.specs[node] = self.spec(summed)
            return
        rule = rule_for(node.target)
        ids = node.args[rule.seed_index] if rule.seed_index is not None and len(node.args) > rule.seed_index \
            else None
        seed = ids in self.from_batch and self.spec(ids) == REPLICATED and self.seq in ids.meta["val"].shape
        # a node with several outputs that the walk has specs for counts as touched by the split
        if not seed and all(self.spec(n) == REPLICATED and n not in self.output_specs
                            for n in node.all_input_nodes):
            return
        if seed:
            shape = ids.meta["val"].shape
            # the batch's sequence dimension as the user declared it; else the last of that length
            # (token ids are (batch, seq): with batch == seq, the later one)
            dim = self.sp.seq_dim if self.sp.seq_dim < len(shape) and shape[self.sp.seq_dim] == self.seq \
                else max(i for i, n in enumerate(shape) if n == self.seq)
            node.update_arg(rule.seed_index, self.shard_of(ids, Shard(dim)))
            self.counts["seeds"] += 1
        if rule.rewrite is not None:
            return rule.rewrite(self, node)
        self.propagate(node)

    def _summed_gradient(self, node: fx.Node) -> fx.Node | None:
        """With ZeRO's host sums: the gradient a running sum's add adds (the accumulating call's
        `sum.add_(grad)`, the updating call's `grad + sum`, as capture binds the sums), else None."""
        if not self.host_sums or node.kwargs or len(node.args) != 2:
            return None
        if node.target is aten.add_.Tensor and node.args[0] in self.grad_sums and isinstance(node.args[1], fx.Node):
            return node.args[1]
        if node.target is aten.add.Tensor and node.args[1] in self.grad_sums and isinstance(node.args[0], fx.Node):
            return node.args[0]
        return None

    def propagate(self, node: fx.Node) -> None:
        """The rule's standard propagation: partial inputs kept (linear ops) or all-reduced,
        full inputs aligned with a sharded one, size arguments rewritten, the value recomputed
        on the local inputs and its `Spec` read from the shape change."""
        rule = rule_for(node.target)
        target = node.target
        specs = {n: self.spec(n) for n in node.all_input_nodes}
        partial = [n for n, spec in specs.items() if spec == PARTIAL]
        sharded = [(n, spec) for n, spec in specs.items() if isinstance(spec, Shard)]
        tensors = [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        linear = (rule.partials == "one" and len(partial) == 1 and not sharded and
                  all(specs[n] == REPLICATED for n in tensors if n not in partial)) \
            or (rule.partials == "all" and len(partial) == len(tensors))
        if partial and not linear:
            if any(n in self.grad_sums for n in written_args(node)):
                # reducing the running sum first would leave the write in a copy and the sum as it was
                raise UnsupportedError(
                    f"sequence parallelism with accumulation_steps: {node.name} ({target}) at {user_line(node)} "
                    "writes into a running gradient sum, which holds each rank's partial sum until the update, with "
                    "a value that is not a partial sum; accumulate inside the step instead (a loop over "
                    "micro-batches)")
            for n in partial:
                node.replace_input_with(n, self.reduce(n))
            specs = {n: self.spec(n) for n in node.all_input_nodes}
            partial = []
        if sharded:
            rule.align(self, node, specs, sharded)
        view_shard = self.rewrite_sizes(node, rule)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        try:
            with self.fake_mode:
                val = target(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported with the op and the user's line
            raise UnsupportedError(
                f"sequence parallelism cannot split {node.name} ({target}) at {user_line(node)}: "
                f"{describe(exc)}") from exc
        node.meta["val"] = val
        full = self.full_values.get(node)
        if isinstance(val, (tuple, list)):
            self.output_specs[node] = tuple(self.output_spec(node, rule, f, v, sharded, partial, view_shard)
                                            for f, v in zip(full, val))
            return
        self.specs[node] = self.output_spec(node, rule, full, val, sharded, partial, view_shard)
        if rule.over_sequence == "mean" and sharded and self.specs[node] == PARTIAL:
            users = list(node.users)
            wait = self.reduce(node, mean=True)
            for user in users:
                user.replace_input_with(node, wait)

    def output_spec(self, node: fx.Node, rule: Rule, full: Any, val: Any, sharded: list[tuple[fx.Node, Shard]],
                    partial: list[fx.Node], view_shard: Shard | None) -> Spec:
        """A value's `Spec` from its full and local shapes: the one dimension that shrank by the
        ranks is the split one; none shrank: a sum over the split sequence is partial."""
        if not isinstance(val, torch.Tensor):
            return REPLICATED
        full_shape, local = tuple(full.shape), tuple(val.shape)
        diff = [d for d in range(len(full_shape)) if full_shape[d] != local[d]]
        if not diff:
            if sharded:
                if rule.over_sequence != "refuse":   # a mean is a partial sum divided by the ranks
                    return PARTIAL
                raise UnsupportedError(f"sequence parallelism: {node.name} ({node.target}) reduces over the "
                                       "split sequence in a way graphoffload cannot combine across ranks")
            return PARTIAL if partial else REPLICATED
        if len(diff) != 1 or local[diff[0]] * self.world != full_shape[diff[0]]:
            raise UnsupportedError(f"sequence parallelism: {node.name} ({node.target}) changed shape "
                                   f"{list(full_shape)} -> {list(local)} in a way that is not a split of the sequence")
        dim = diff[0]
        if view_shard is not None:
            return view_shard
        for n, shard in sharded:
            if self.full_size(n, shard) == full_shape[dim]:
                return Shard(dim, shard.outer, shard.inner)
        if full_shape[dim] % self.seq == 0:
            return Shard(dim, full_shape[dim] // self.seq, 1)
        raise UnsupportedError(f"sequence parallelism: cannot tell how {node.name} ({node.target}) splits the sequence")

    def rewrite_sizes(self, node: fx.Node, rule: Rule) -> Shard | None:
        """When the first argument is sharded: refuse an op that combines positions along the
        split dimension, and let the rule rewrite size arguments (a view returns how the
        sequence sits in its output)."""
        x = node.args[0] if node.args else None
        shard = self.spec(x) if isinstance(x, fx.Node) else None
        if not isinstance(shard, Shard):
            return None
        if rule.mixes_positions(node, shard.dim):
            raise UnsupportedError(f"sequence parallelism: {node.name} ({node.target}) at {user_line(node)} "
                                   "combines positions along the split sequence dimension; only attention may do that")
        return rule.sizes(self, node, shard)

    # ------------------------------------------------------------------ gradients and outputs

    def reduce_gradients(self, last: fx.Node) -> None:
        """All-reduce the partial gradients of the bucket that ends at `last`, right after it."""
        grads = []
        for grad in self.buckets[last]:
            if self.spec(grad) == PARTIAL:
                grads.append(grad)
            else:
                self._refuse_split(grad)
        if not grads:
            return
        if self.defer_gradients:
            # ZeRO over another group reduces them, over both groups (passes/zero.py): from here
            # on they are taken as the sums over this sequence-parallel group they will be
            changed = [g for g in grads if g.meta.get("phase") != "backward"]
            if changed:
                raise UnsupportedError(
                    f"ZeRO data parallelism with sequence_parallel=: the update reads {changed[0].name} "
                    f"({changed[0].target}, at {user_line(changed[0])}), a gradient changed after backward other "
                    "than by clip_grad_norm_'s scaling; ZeRO reduces the gradients over both groups and cannot "
                    "reduce a changed one yet: drop the change, or one of data_parallel= and sequence_parallel=")
            for grad in grads:
                self.specs[grad] = REPLICATED
                self.deferred.append(grad.name)
            return
        with self.graph.inserting_after(last):
            red = self.new_node(c10d.all_reduce_coalesced.default, (grads, "sum", self.group), phase="comm",
                                like=last)
        after = red
        waits = []
        for i, grad in enumerate(grads):
            with self.graph.inserting_after(after):
                item = self.new_node(operator.getitem, (red, i), phase="comm", like=grad)
            with self.graph.inserting_after(item):
                wait = self.new_node(c10d.wait_tensor.default, (item,), phase="comm", like=grad)
            if "param" in grad.meta:
                wait.meta["param"] = grad.meta["param"]
                item.meta["param"] = grad.meta["param"]
            after = wait
            waits.append(wait)
            self.specs[wait] = REPLICATED
            self.reduced[grad] = wait
        for grad, wait in zip(grads, waits):
            grad.replace_all_uses_with(wait, delete_user_cb=lambda user: user is not red)
        self.counts["buckets"] += 1
        self.counts["grads"] += len(grads)

    def defer_summed_gradients(self, updated: tuple[str, ...]) -> None:
        """An accumulating call under ZeRO: list the gradients that backward adds into the running
        sums (`sum.add_(grad)`, as capture binds the sums) of the parameters the window's update
        updates, those that are partial sums over this group, left as they are: with device sums
        the sums stay partial until the updating call (a whole gradient added into one was refused by
        the walk), with host sums `zero` reduces each call's over both groups (a whole one, of a
        parameter read off the split sequence, sent by sp rank 0 alone)."""
        signature = self.train_graph.signature
        for s in sorted(self.grad_sums, key=self.position.__getitem__):
            if signature.input(s.name).target not in updated:
                continue
            for add in s.users:
                if add.target is not aten.add_.Tensor or add.args[0] is not s or not isinstance(add.args[1], fx.Node):
                    continue
                grad = add.args[1]
                self._refuse_split(grad)
                if self.spec(grad) == PARTIAL:
                    self.deferred.append(grad.name)

    def _refuse_split(self, grad: fx.Node) -> None:
        if isinstance(self.spec(grad), Shard):
            raise UnsupportedError(f"sequence parallelism: the gradient {grad.name} of parameter "
                                   f"{grad.meta.get('param')} is split along the sequence; parameters whose "
                                   "shape follows the sequence length are not supported")

    def finish(self, output: fx.Node) -> None:
        """Partial step outputs are all-reduced; sharded ones stay this rank's part."""
        outs = list(output.args[0])
        for i, out in enumerate(outs):
            if isinstance(out, fx.Node) and self.spec(out) == PARTIAL:
                outs[i] = self.reduce(out)
            elif isinstance(out, fx.Node) and isinstance(self.spec(out), Shard):
                self.counts["sharded_outputs"] += 1
        output.args = (outs,)


def ring_attention(graph: TrainGraph, ctx: PassContext) -> TrainGraph:
    sp = ctx.config.sequence_parallel
    if sp is None:
        return graph
    sharder = _Sharder(graph, sp, defer_gradients=ctx.config.data_parallel is not None,
                       host_sums=ctx.config.host_sums_under_zero)
    sharder.run()
    window = graph.notes_of("capture", "accumulation")
    if sharder.defer_gradients and window and not window[0].fields["update"]:
        sharder.defer_summed_gradients(window[0].fields["updated"])
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
    if sharder.defer_gradients:
        graph.note("ring_attention", f"{len(sharder.deferred)} parameter gradients left as this rank's partial sums "
                   f"over the sequence-parallel group {sp.group_name!r}: the zero pass reduces them over it and the "
                   "data-parallel group", "deferred_gradients", gradients=tuple(sharder.deferred), group=sp.group_name)
    if c["sharded_outputs"]:
        graph.note("ring_attention", f"{c['sharded_outputs']} step outputs are this rank's part of the sequence")
    return graph
