"""`FileTensor`: a tensor whose bytes are still in an open payload file, read once into the batch."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..errors import fail


@dataclass(frozen=True, slots=True)
class FileTensor:
    """Shape, dtype and byte range of a tensor in an open file (a checked safetensors entry or `.pt` storage).

    It answers the questions the contract checks ask of a tensor (`shape`, `ndim`, `dtype`,
    `is_floating_point()`), so a payload can be validated before any of its bytes are read; the
    batch then reads them straight from the file into its own memory (`read_into`).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    descriptor: int
    offset: int
    nbytes: int
    display: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def is_complex(self) -> bool:
        return self.dtype.is_complex

    def materialize(self) -> torch.Tensor:
        """The tensor in memory of its own."""
        out = torch.empty(self.shape, dtype=self.dtype)
        destination = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        read_into(self.descriptor, self.offset, destination, self.display)
        return out


def read_into(descriptor: int, offset: int, destination: memoryview, display: str) -> None:
    """Fill `destination` from `descriptor` at `offset`: one kernel copy, page cache -> destination."""
    done = 0
    while done < len(destination):
        count = os.preadv(descriptor, [destination[done:]], offset + done)
        if count == 0:
            fail(display, "payload", f"file ended {len(destination) - done} bytes early (it changed while being read)")
        done += count
