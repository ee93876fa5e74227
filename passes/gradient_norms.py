"""The global gradient norm as the step traces it (a norm of per-gradient norms), recognised once.

`clip_grad_norm_` (per-tensor or foreach form) and `skip_nonfinite`'s flag both take one norm per
gradient and then the global norm as the norm of their `stack`. Passes that move where a gradient
lives can still serve that global norm from pieces: `zero` from each rank's chunks (the total made
global by one all-reduce), the host gradient sums of `offload_optimizer` from norms taken on the
host. Either is only exact when the per-gradient norms are read by nothing but that stack, and
the stack by nothing but the global norm: any other read (a logged `p.grad.norm()`) needs the
whole gradient where it was. Both passes ask `norm_of_norms`, so they agree on the form.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx

aten = torch.ops.aten


def norm_order(norm: fx.Node) -> float | None:
    """The order of `linalg_vector_norm(x[, ord])`, when it is a number (2 when not given)."""
    order = norm.args[1] if len(norm.args) > 1 else 2.0
    return float(order) if isinstance(order, (int, float)) else None


def norm_of_norms(norms: Iterable[fx.Node], exactly: bool = True) -> fx.Node | None:
    """The global norm over the per-gradient norms `norms`, or None when they are not read that way.

    Matches `total = linalg_vector_norm(stack([n0, n1, ...])[, ord])` where every node of `norms`
    is read by that one `aten.stack` and by nothing else, and the stack is read by `total` alone,
    a `linalg_vector_norm` of all its elements (at most an order argument: no dim, keepdim or
    dtype; the stack's dim is free, as a norm of every element does not depend on it). Returns
    `total`. With `exactly` the stack must hold `norms` and nothing more (what `zero` shards);
    without it, other norms may sit in the same stack (the host path asks one gradient at a time).
    Neither the per-gradient norms' form nor the total's order is checked here: `norm_order` gives
    the order for callers that need it to match."""
    norms = list(norms)
    if not norms or any(len(n.users) != 1 for n in norms):
        return None
    stacks = {next(iter(n.users)) for n in norms}
    if len(stacks) != 1:
        return None
    stack = stacks.pop()
    if stack.target is not aten.stack.default or (exactly and set(stack.args[0]) != set(norms)):
        return None
    totals = list(stack.users)
    if len(totals) != 1 or totals[0].target is not aten.linalg_vector_norm.default \
            or totals[0].args[0] is not stack or len(totals[0].args) > 2 or totals[0].kwargs:
        return None
    return totals[0]
