"""`BatchBuffer`: the one block of memory a batch's tensors live in, and the copies into it.

In the training process it is ordinary memory from a small pool, filled with `preadv` (file pages
-> buffer) and memcpy. In a loader worker it is a block of the worker's shared-memory ring, filled
the same way, or a one-off shared block while every ring block is still held. Only public torch
API: `torch.frombuffer` and `share_memory_()` (an interleaved A/B found no gain in torch's private
shared-memory calls or a `sendfile`-filled one-off block; docs/performance.md). What is copied
where, and by how many threads, is `fill.py`'s.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from .._retry import with_read_retries
from ..contract.file_tensor import FileTensor, read_into
from .shared_ring import Lease, shared_bytes, worker_ring

Part = tuple[int, int, int, FileTensor]  # (offset in its file, offset in the buffer, bytes, the tensor they belong to)


class BufferPool:
    """The training process's batch memory, reused once no tensor of an earlier batch holds it.

    Fresh memory for every batch costs a page fault and a zeroed page per 4 KiB, which takes longer
    than copying the batch into it. A pooled block is lent to torch through `torch.frombuffer` on a
    numpy view of it, which torch keeps for as long as any tensor uses it; a finalizer on that view
    flags the block free again, as the workers' rings do (`shared_ring.py`). A batch kept by the
    caller is never overwritten: its block just stays lent.
    """

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self.blocks: list[np.ndarray] = []
        self.lent: list[bool] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of `nbytes` uninitialised bytes."""
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        with self.lock:
            free = [i for i in range(len(self.blocks)) if not self.lent[i]]
            fitting = [i for i in free if nbytes <= self.blocks[i].nbytes <= 2 * nbytes]
            if fitting:
                slot = min(fitting, key=lambda i: self.blocks[i].nbytes)
            elif len(self.blocks) < self.capacity:
                slot = len(self.blocks)
                self.blocks.append(np.empty(nbytes, dtype=np.uint8))
                self.lent.append(False)
            elif free:  # replace the smallest free block: batch sizes have moved on
                slot = min(free, key=lambda i: self.blocks[i].nbytes)
                self.blocks[slot] = np.empty(nbytes, dtype=np.uint8)
            else:  # every block is held by a batch still alive
                return torch.empty(nbytes, dtype=torch.uint8)
            self.lent[slot] = True
            owner = self.blocks[slot][:nbytes]
            weakref.finalize(owner, self.lent.__setitem__, slot, False)
            return torch.frombuffer(owner, dtype=torch.uint8)


POOL = BufferPool()


class BatchBuffer:
    """`nbytes` uninitialised bytes as a flat uint8 tensor; `shared` puts them in shared memory."""

    def __init__(self, nbytes: int, shared: bool) -> None:
        self.shared = shared
        self.lease: Lease | None = None
        if not shared:
            self.tensor = POOL.take(nbytes)
        elif nbytes and (lease := worker_ring().lend(nbytes)) is not None:
            self.lease, self.tensor = lease, lease.tensor
        else:  # every ring block is still held: a one-off block
            self.tensor = shared_bytes(nbytes)
        self.array = self.tensor.numpy()
        self.view = memoryview(self.array)  # type: ignore[arg-type]  # numpy arrays are buffers

    def zero(self, start: int, end: int) -> None:
        """Zero `[start, end)` (the padding of a short prompt row)."""
        self.array[start:end] = 0

    def copy(self, start: int, source: torch.Tensor) -> None:
        """Copy an in-memory tensor's bytes to `start`: one copy, without torch's thread pool."""
        if not source.is_contiguous():
            count = source.numel() * source.element_size()
            self.tensor[start : start + count].view(source.dtype).view(source.shape).copy_(source)
            return
        data = memoryview(source.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        self.view[start : start + len(data)] = data

    def read_run(self, run: Sequence[Part]) -> None:
        """Scatter one contiguous byte range of a file into the tensors' places: one `preadv`."""
        buffers = [self.view[start : start + nbytes] for _, start, nbytes, _ in run]
        descriptor, offset = run[0][3].descriptor, run[0][0]
        if with_read_retries(lambda: os.preadv(descriptor, buffers, offset), run[0][3].display) == sum(
            len(b) for b in buffers
        ):
            return
        for offset, start, nbytes, tensor in run:  # a short read (signal, or the file changed): part by part
            read_into(tensor.descriptor, offset, self.view[start : start + nbytes], tensor.display)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
