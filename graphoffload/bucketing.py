"""Greedy bucketing, shared by everything that groups tensors by size in the order they come.

Items come in the order they become ready (a gradient final in backward, an update whose
gradients are, a parameter of a param group); each bucket takes the next items while their
elements fit in `limit`, so a bucket closes as early as its last item allows. An item larger
than `limit` gets a bucket of its own; with `key`, items of different keys never share one.
Capture splits each param group's update into subgroups this way, `fuse_optimizer` buckets
updates and `ring_attention` gradient all-reduces.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

T = TypeVar("T")


def greedy_buckets(items: Iterable[T], numel: Callable[[T], int], limit: int,
                   key: Callable[[T], Hashable] | None = None) -> list[list[T]]:
    """Consecutive runs of `items` of at most `limit` elements each (one item may exceed it
    alone), each run of one `key` where a key is given."""
    buckets: list[list[T]] = []
    size = 0
    last_key: Hashable = None
    for item in items:
        n = numel(item)
        k = key(item) if key is not None else None
        if buckets and k == last_key and size + n <= limit:
            buckets[-1].append(item)
            size += n
        else:
            buckets.append([item])
            size = n
        last_key = k
    return buckets
