"""`BatchBuffer`: the one block of memory a batch's tensors live in, and the copies into it.

In the training process it is ordinary memory, filled with `preadv` (file pages -> buffer) and
memcpy; a big batch's files are read two at a time when the process may use two cores, since one
thread's kernel copy out of the page cache falls well short of the memory bandwidth. In a
loader worker it is a block of the worker's shared-memory ring, filled the same way once its pages
are in place. A one-off shared block (every ring block still held) is filled through its file
instead: the kernel copies file pages into it with `sendfile` and tensors with `pwrite`, so its
fresh pages are never first zeroed and then faulted in one by one, as writing through the mapping
would make them.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch
import torch.multiprocessing

from ..errors import fail
from ..payload.file_tensor import FileTensor, read_into
from . import shared_ring
from .shared_ring import Lease, worker_ring

Part = tuple[int, int, FileTensor]  # (offset in its file, offset in the buffer, tensor)
# Handing files to a second thread costs a thread wake-up and GIL hand-offs; for smaller batches that
# eats what the second copy saves (interleaved runs, docs/read-path.md).
PARALLEL_READ_MIN_BYTES = 8 << 20


class BufferPool:
    """The training process's batch memory, reused once no tensor of an earlier batch holds it.

    Fresh memory for every batch costs a page fault and a zeroed page per 4 KiB, which takes longer
    than copying the batch into it. A pooled block is lent to torch through `torch.frombuffer`,
    which keeps a reference to the numpy array for as long as any tensor uses it; the array's
    reference count therefore says when the block is free again. A batch kept by the caller is
    never overwritten: its block just stays lent.
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
        if shared_ring.PUBLIC_MEMORY:
            return self.take_flagged(nbytes)
        with self.lock:
            free = [i for i in range(len(self.blocks)) if sys.getrefcount(self.blocks[i]) <= 2]  # list + argument
            fitting = [i for i in free if nbytes <= self.blocks[i].nbytes <= 2 * nbytes]
            if fitting:
                block = self.blocks[min(fitting, key=lambda i: self.blocks[i].nbytes)]
            else:
                block = np.empty(nbytes, dtype=np.uint8)
                if len(self.blocks) < self.capacity:
                    self.blocks.append(block)
                elif free:  # replace the smallest free block: batch sizes have moved on
                    self.blocks[min(free, key=lambda i: self.blocks[i].nbytes)] = block
            return torch.frombuffer(block, dtype=torch.uint8, count=nbytes)

    def take_flagged(self, nbytes: int) -> torch.Tensor:
        """`take`, with each block flagged free by a finalizer on the view lent to torch."""
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
            else:
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
        self.descriptor: int | None = None
        self.lease: Lease | None = None
        if not shared:
            self.tensor = POOL.take(nbytes)
        elif nbytes and (lease := worker_ring().lend(nbytes)) is not None:
            self.lease, self.tensor = lease, lease.tensor  # its pages are in place after first use: fill by mapping
        elif shared_ring.PUBLIC_MEMORY:
            self.tensor = shared_ring._shared_bytes(nbytes)
        else:  # every ring block is still held: a one-off block
            storage = torch.UntypedStorage._new_shared(nbytes)
            self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
            if (
                nbytes
                and not shared_ring.PUBLIC_MEMORY
                and torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
            ):
                self.descriptor = storage._share_fd_cpu_()[0]  # the file behind the mapping, still ours
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
        if self.descriptor is None:
            self.view[start : start + len(data)] = data
            return
        done = 0
        while done < len(data):
            done += os.pwrite(self.descriptor, data[done:], start + done)

    def read_files(self, files: Sequence[Sequence[Part]]) -> None:
        """Read every file's tensors into their places; two files at a time in the training process.

        The helper thread reads about half the bytes while this thread reads the rest; both copies
        run in the kernel without the GIL. In a worker the other workers already keep the cores busy.
        """
        big = len(files) > 1 and sum(_file_bytes(parts) for parts in files) >= PARALLEL_READ_MIN_BYTES
        helper = _second_reader() if big and not self.shared and not shared_ring.PUBLIC_MEMORY else None
        if helper is None:
            self.read_each(files)
            return
        mine, theirs = halves_by_bytes(files)
        pending: Future[None] = helper.submit(self.read_each, theirs)
        try:
            self.read_each(mine)
        finally:
            wait([pending])  # the helper must be done with the buffer before anyone reuses it
        pending.result()

    def read_each(self, files: Sequence[Sequence[Part]]) -> None:
        """Read several files' tensors into their places, one file after another."""
        for parts in files:
            self.read(parts)

    def read(self, parts: Sequence[Part]) -> None:
        """Read one file's tensors (sorted by file offset) into their places."""
        if self.descriptor is not None:
            try:
                for file_offset, start, tensor in parts:
                    self.send(self.descriptor, file_offset, start, tensor)
                return
            except OSError as error:
                if error.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                # A file system that cannot splice its pages: read through the mapping instead.
        run: list[Part] = []
        for part in parts:
            if run and run[-1][0] + run[-1][2].nbytes != part[0]:
                self.read_run(run)
                run = []
            run.append(part)
        if run:
            self.read_run(run)

    def read_run(self, run: Sequence[Part]) -> None:
        """Scatter one contiguous byte range of a file into the tensors' places: one `preadv`."""
        first = run[0][2]
        buffers = [self.view[start : start + tensor.nbytes] for _, start, tensor in run]
        if os.preadv(first.descriptor, buffers, first.offset) == sum(len(b) for b in buffers):
            return
        for _, start, tensor in run:  # a short read (signal, or the file changed): finish part by part
            read_into(tensor.descriptor, tensor.offset, self.view[start : start + tensor.nbytes], tensor.display)

    @staticmethod
    def send(descriptor: int, file_offset: int, start: int, tensor: FileTensor) -> None:
        """Copy one tensor from its file into the shared-memory file `descriptor` at `start`, inside the kernel."""
        os.lseek(descriptor, start, os.SEEK_SET)
        done = 0
        while done < tensor.nbytes:
            count = os.sendfile(descriptor, tensor.descriptor, file_offset + done, tensor.nbytes - done)
            if count == 0:
                fail(
                    tensor.display,
                    "payload",
                    f"file ended {tensor.nbytes - done} bytes early (it changed while being read)",
                )
            done += count


def halves_by_bytes(files: Sequence[Sequence[Part]]) -> tuple[list[Sequence[Part]], list[Sequence[Part]]]:
    """Split files into two groups of about equal bytes (largest first, each to the lighter group)."""
    groups: tuple[list[Sequence[Part]], list[Sequence[Part]]] = ([], [])
    loads = [0, 0]
    for nbytes, parts in sorted(((_file_bytes(p), p) for p in files), key=lambda sized: -sized[0]):
        lighter = 0 if loads[0] <= loads[1] else 1
        groups[lighter].append(parts)
        loads[lighter] += nbytes
    return groups


def _file_bytes(parts: Sequence[Part]) -> int:
    """Bytes one file's tensors take."""
    return sum(tensor.nbytes for _, _, tensor in parts)


_READER: tuple[int, ThreadPoolExecutor] | None = None
_READER_LOCK = threading.Lock()


def _second_reader() -> ThreadPoolExecutor | None:
    """The one helper thread that reads files beside the calling thread, or None on a single core.

    Made per process: a forked child inherits the executor but not its thread.
    """
    global _READER
    if usable_cores() < 2:
        return None
    with _READER_LOCK:
        if _READER is None or _READER[0] != os.getpid():
            _READER = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="image-edit-data-read"))
        return _READER[1]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
