"""A host arena: offloaded state lives in a few large allocations, as views into them.

One pinned allocation per tensor is what a naive offload does, and it is expensive twice:
torch's caching host allocator rounds every pinned request up to a power of two (a 48 MiB
weight's fp32 moments and master weights take 64 MiB each, up to 2x the host RAM the state
needs), and the first call makes thousands of pinned allocations, each a slow driver call.
So the host state asks for its tensors up front (`reserve`), gets one allocation sized to
their exact total (each tensor's bytes rounded up to 64 for alignment), and hands out views
into it (`empty`). A later request that was not reserved gets an allocation of its own size.

On a GPU the allocation is ordinary memory registered with the driver (`cudaHostRegister`,
exact size, no rounding; pinned as far as copies and `is_pinned()` are concerned), falling
back to torch's pinned allocator if registration fails. On a machine without one, or with
`Offload(pin_memory=False)`, it is plain memory: the same code path, which is what the CPU
tests exercise.

Each view is a tensor of its own storage that begins at the view's first byte (made through
numpy, sharing the allocation and keeping it alive), not a view at a storage offset into the
allocation's storage. Under ZeRO `optimizer.state` holds these views as the local tensors of
`Shard(0)` DTensors, and torch (2.11 to 2.13) gives a DTensor its local tensor's storage offset:
a storage-less wrapper with a non-zero offset has a non-null `data_ptr()`, which `torch.save`
and `copy.deepcopy` take for a tensor with storage ("invalid python storage"). A storage of its
own also means `torch.save` of the state writes each tensor's bytes, not the whole allocation.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch import Tensor

ALIGN = 64   # bytes: a cache line, and enough for every dtype's alignment


def aligned_bytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    nbytes = math.prod(shape) * dtype.itemsize
    return -(-nbytes // ALIGN) * ALIGN


def _unregister(chunks: list[Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for chunk in chunks:
        cudart.cudaHostUnregister(chunk.data_ptr())


class HostArena:
    """Host tensors carved from a few large (pinned) allocations."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.chunks: list[Tensor] = []        # uint8 buffers, in allocation order
        self._registered: list[Tensor] = []   # chunks pinned by cudaHostRegister (unregistered with the arena)
        self._offset = 0                      # next free byte of the last chunk
        if pin:
            weakref.finalize(self, _unregister, self._registered)

    @property
    def allocated_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def _allocate(self, nbytes: int) -> None:
        chunk = None
        if self.pin:
            chunk = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes and int(torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), nbytes, 0)) == 0:
                self._registered.append(chunk)
            else:   # registration refused (e.g. a locked-memory limit): torch's allocator, rounded up
                chunk = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.chunks.append(chunk if chunk is not None else torch.empty(nbytes, dtype=torch.uint8))
        self._offset = 0

    def _room(self) -> int:
        return self.chunks[-1].numel() - self._offset if self.chunks else 0

    def reserve(self, tensors: Iterable[tuple[Iterable[int], torch.dtype]]) -> None:
        """Make room, in one allocation, for the tensors (shape, dtype) about to be requested."""
        total = sum(aligned_bytes(shape, dtype) for shape, dtype in tensors)
        if total > self._room():
            self._allocate(total)

    def empty(self, shape: Iterable[int], dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous host tensor, a view into the arena."""
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.chunks or aligned_bytes(shape, dtype) > self._room():
            self._allocate(max(aligned_bytes(shape, dtype), ALIGN))
        if nbytes == 0:   # no bytes to place (a rank's empty ZeRO chunk): a tensor of its own
            return torch.empty(shape, dtype=dtype)
        chunk = self.chunks[-1]
        start = self._offset
        self._offset += aligned_bytes(shape, dtype)
        return torch.from_numpy(chunk.numpy()[start:start + nbytes]).view(dtype).view(shape)

    def holds(self, t: Tensor) -> bool:
        """Whether `t` is a view into this arena (an empty host tensor has nothing to place: it is)."""
        if t.device.type != "cpu":
            return False
        if t.numel() == 0:
            return True
        first = t.data_ptr()
        return any(c.data_ptr() <= first < c.data_ptr() + c.numel() for c in self.chunks)
