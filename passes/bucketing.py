"""Greedy bucketing, shared by the passes that group gradients or updates by size.

Items come in the order they become ready (a gradient final in backward, an update whose
gradients are); each bucket takes the next items while their elements fit in `limit`, so a
bucket closes as early as its last item allows. An item larger than `limit` gets a bucket of
its own. `fuse_optimizer` buckets updates this way, `ring_attention` gradient all-reduces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def greedy_buckets(items: Iterable[T], numel: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive runs of `items` of at most `limit` elements each (one item may exceed it alone)."""
    buckets: list[list[T]] = []
    size = 0
    for item in items:
        n = numel(item)
        if buckets and size + n <= limit:
            buckets[-1].append(item)
            size += n
        else:
            buckets.append([item])
            size = n
    return buckets
