"""Shared-memory batch blocks that a loader worker reuses once the training process is done with them.

A fresh shared-memory block per batch costs the worker a new zeroed page per 4 KiB and the training
process a descriptor hand-off per batch; together that is more than reading the batch. Instead each
worker keeps a ring of blocks. A block travels to the training process once; after that a batch
names only (ring, slot). In the training process the batch's tensors are built on a numpy view of
the block through `torch.frombuffer`, which holds that view until the last tensor of the batch is
freed; a finalizer on the view then flags the slot free in a small shared array the worker reads
before lending the block again. A batch the trainer keeps therefore keeps its block.
"""

from __future__ import annotations

import os
import secrets
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CAPACITY = 8  # blocks per worker: batches in flight (prefetch) plus those the trainer still holds
FREE, LENT = 0, 1


def shared_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of shared memory as a flat uint8 tensor (their contents are to be overwritten)."""
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


@dataclass
class Lease:
    """One batch's use of a ring block: `tensor` is the block's first `nbytes` bytes."""

    ring: WorkerRing
    slot: int
    generation: int
    tensor: torch.Tensor

    def cancel(self) -> None:
        """Give the block back unused (the batch failed before it was sent)."""
        self.ring.flags[self.slot] = FREE


class WorkerRing:
    """A loader worker's reusable batch blocks (one ring per worker process)."""

    def __init__(self) -> None:
        self.token = f"{os.getpid()}:{secrets.token_hex(8)}"
        self.flag_tensor = shared_bytes(CAPACITY)
        self.flags = self.flag_tensor.numpy()
        self.flags[:] = FREE
        self.flags_sent = False
        self.blocks: list[torch.Tensor | None] = [None] * CAPACITY
        self.generations = [0] * CAPACITY
        self.sent = [False] * CAPACITY

    def lend(self, nbytes: int) -> Lease | None:
        """A free block of at least `nbytes` (a new one if none fits), or None when every slot is lent."""
        free = [slot for slot in range(CAPACITY) if self.flags[slot] == FREE]
        fitting = [slot for slot in free if self.fits(slot, nbytes)]
        if fitting:
            slot = min(fitting, key=lambda s: self.size(s))
        elif free:  # an empty slot first, else replace the smallest free block
            slot = min(free, key=lambda s: (self.blocks[s] is not None, self.size(s)))
            self.blocks[slot] = shared_bytes(nbytes)
            self.generations[slot] += 1
            self.sent[slot] = False
        else:
            return None
        self.flags[slot] = LENT
        block = self.blocks[slot]
        assert block is not None  # set above when the slot was empty
        return Lease(self, slot, self.generations[slot], block[:nbytes])

    def size(self, slot: int) -> int:
        block = self.blocks[slot]
        return 0 if block is None else block.numel()

    def fits(self, slot: int, nbytes: int) -> bool:
        """Whether the slot's block holds `nbytes` without wasting more than half of itself."""
        return nbytes <= self.size(slot) <= 2 * nbytes

    def handoff(self, lease: Lease) -> tuple[Any, ...]:
        """What the training process needs to find the lease's block: the block and flags only the first time."""
        block = None if self.sent[lease.slot] else self.blocks[lease.slot]
        flags = None if self.flags_sent else self.flag_tensor
        self.sent[lease.slot] = self.flags_sent = True
        return self.token, lease.slot, lease.generation, block, flags, lease.tensor.numel()


RING: WorkerRing | None = None


def worker_ring() -> WorkerRing:
    """This worker process's ring (created on first use, after the fork)."""
    global RING
    if RING is None or not RING.token.startswith(f"{os.getpid()}:"):
        RING = WorkerRing()
    return RING


class _ReceivedRing:
    """The training process's view of one worker's ring: its flags and the blocks received so far."""

    def __init__(self, flags: torch.Tensor) -> None:
        self.flag_tensor = flags
        self.flags = flags.numpy()
        self.blocks: dict[int, tuple[int, torch.Tensor]] = {}


RECEIVED: dict[str, _ReceivedRing] = {}


def received_block(
    token: str, slot: int, generation: int, block: torch.Tensor | None, flags: torch.Tensor | None, nbytes: int
) -> torch.Tensor:
    """The batch's bytes in the training process, flagged free again when its last tensor is freed."""
    ring = RECEIVED.get(token)
    if ring is None:
        if flags is None:
            raise RuntimeError(f"a batch names worker ring {token}, which this process never received")
        _forget_exited_workers()
        ring = RECEIVED[token] = _ReceivedRing(flags)
    if block is not None:
        ring.blocks[slot] = (generation, block)
    held_generation, held = ring.blocks.get(slot, (None, None))
    if held is None or held_generation != generation:
        raise RuntimeError(f"worker ring {token} slot {slot}: block {generation} was never received")
    owner = held[:nbytes].numpy()
    weakref.finalize(owner, release, ring.flags, slot)
    return torch.frombuffer(owner, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)


def release(flags: np.ndarray, slot: int) -> None:
    """Flag a block free for its worker (runs when the batch's last tensor is freed)."""
    flags[slot] = FREE


def _forget_exited_workers() -> None:
    """Drop the rings of workers that have exited (their blocks live on only in batches still held)."""
    for token in list(RECEIVED):
        pid = int(token.split(":", 1)[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            del RECEIVED[token]
        except PermissionError:
            pass
