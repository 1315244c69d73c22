"""`SharedBatch`: a worker's batch that crosses to the training process as one shared-memory buffer.

torch sends each shared tensor of a batch to the main process as its own file descriptor, one
socket round trip each. All tensors of our batches are views of one buffer, so a `SharedBatch`
pickles as that buffer (one descriptor) plus each tensor's place in it, and unpickles into a
plain dict whose tensors are views of the received buffer: no copy on either side.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

import torch

from .shared_ring import Lease, received_block


class Placed(NamedTuple):
    """Where a tensor lies in the shared buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SharedBatch(dict):  # type: ignore[type-arg]
    """A batch dict whose tensors are views of `buffer` (a flat uint8 tensor in shared memory).

    With a `lease` the buffer is a block of the worker's ring (`shared_ring.py`), which the
    training process already holds after its first batch: only the block's place is sent.
    `placed_keys` names the entries that hold views of the buffer (all when None); the others,
    such as the per-sample metadata, pickle as they are without being searched for tensors.
    """

    def __init__(
        self,
        batch: dict[str, Any],
        buffer: torch.Tensor,
        lease: Lease | None = None,
        placed_keys: Collection[str] | None = None,
    ) -> None:
        super().__init__(batch)
        self.buffer = buffer
        self.lease = lease
        self.placed_keys = frozenset(batch if placed_keys is None else placed_keys)

    def __reduce__(self) -> tuple[Any, ...]:
        base = self.buffer.data_ptr()
        end = base + self.buffer.numel()
        skeleton = {key: placed(value, base, end) if key in self.placed_keys else value for key, value in self.items()}
        keys = tuple(self.placed_keys)
        if self.lease is not None:
            return rebuild_leased_batch, (*self.lease.ring.handoff(self.lease), skeleton, keys)
        return rebuild_batch, (self.buffer, skeleton, keys)


def rebuild_leased_batch(
    token: str,
    slot: int,
    generation: int,
    block: torch.Tensor | None,
    flags: torch.Tensor | None,
    nbytes: int,
    skeleton: dict[str, Any],
    placed_keys: tuple[str, ...],
) -> dict[str, Any]:
    """The batch dict again, its tensors views of the worker's ring block."""
    return rebuild_batch(received_block(token, slot, generation, block, flags, nbytes), skeleton, placed_keys)


def placed(value: Any, base: int, end: int) -> Any:
    """`value` with each contiguous view of the buffer (also in a list or dict) replaced by its `Placed`.

    Anything else, including tensors added to the batch by other code, pickles as usual.
    """
    if isinstance(value, torch.Tensor):
        start = value.data_ptr()
        inside = value.is_contiguous() and base <= start and start + value.numel() * value.element_size() <= end
        return Placed(start - base, value.dtype, tuple(value.shape)) if inside else value
    if isinstance(value, list):
        return [placed(v, base, end) for v in value]
    if type(value) is dict:
        return {k: placed(v, base, end) for k, v in value.items()}
    return value


def rebuild_batch(buffer: torch.Tensor, skeleton: dict[str, Any], placed_keys: tuple[str, ...]) -> dict[str, Any]:
    """The batch dict again, its tensors views of the received `buffer`."""
    return {key: _unplaced(value, buffer) if key in placed_keys else value for key, value in skeleton.items()}


def _unplaced(value: Any, buffer: torch.Tensor) -> Any:
    """Inverse of `placed`."""
    if isinstance(value, Placed):
        numel = 1
        for size in value.shape:
            numel *= size
        nbytes = numel * value.dtype.itemsize
        return buffer[value.offset : value.offset + nbytes].view(value.dtype).view(value.shape)
    if isinstance(value, list):
        return [_unplaced(v, buffer) for v in value]
    if type(value) is dict:
        return {k: _unplaced(v, buffer) for k, v in value.items()}
    return value
