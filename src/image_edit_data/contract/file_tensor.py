"""`FileTensor`: a tensor whose bytes are still in its payload (a file or fetched bytes), read once into the batch."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .._retry import with_read_retries
from ..errors import fail


@dataclass(frozen=True, slots=True)
class FileTensor:
    """Shape, dtype and byte range of a tensor in an open file or fetched bytes (a safetensors entry or `.pt` storage).

    It answers the questions the contract checks ask of a tensor (`shape`, `ndim`, `dtype`,
    `is_floating_point()`), so a payload can be validated before any of its bytes are read; the
    batch then copies them straight from the file (or from `memory`) into its own memory (`read_into`).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    descriptor: int  # -1 when the bytes are in `memory`
    offset: int  # in the file, or in `memory`
    nbytes: int
    display: str
    memory: memoryview | None = None  # the payload's bytes, when they were fetched rather than left in a file

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
        self.copy_to(memoryview(out.view(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
        return out

    def copy_to(self, destination: memoryview) -> None:
        """Copy the tensor's bytes into `destination` (exactly `nbytes` long)."""
        if self.memory is not None:
            destination[:] = self.memory[self.offset : self.offset + self.nbytes]
        else:
            read_into(self.descriptor, self.offset, destination, self.display)


def read_into(descriptor: int, offset: int, destination: memoryview, display: str) -> None:
    """Fill `destination` from `descriptor` at `offset`: one kernel copy, page cache -> destination."""
    done = 0
    while done < len(destination):
        part, at = destination[done:], offset + done
        count = with_read_retries(lambda: os.preadv(descriptor, [part], at), display)  # noqa: B023  (called at once)
        if count == 0:
            fail(display, "payload", f"file ended {len(destination) - done} bytes early (it changed while being read)")
        done += count
