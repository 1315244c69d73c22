"""Fill a batch's buffer sample by sample, checking each packed member's checksum in the same pass.

Each sample (a row of the batch) is filled on its own: its tensors still in a file are read in
file order, a contiguous run of them with one `preadv`; tensors in fetched bytes or in memory are
copied. Right after, while those bytes are still in the CPU caches, a packed member's XXH3-64 is
computed over the header it was parsed from and the tensors as they now lie in the batch
(`MemberCheck.digest`): each byte of the member is read once. A row that does not match comes
back as a `Mismatch`, for the dataset to read its member again before it counts as damaged.

In the training process a batch's rows are split between this thread and one helper thread when
the process may use two cores: the kernel copies and the hashing both run without the GIL, and one
thread falls well short of the memory bandwidth. Loader workers fill alone: the other workers
already keep the cores busy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..contract.file_tensor import FileTensor
from ..errors import CacheFormatError
from ..payload.member_check import Buffer, MemberCheck
from .buffer import BatchBuffer, Part, usable_cores

Placed = tuple[int, FileTensor | torch.Tensor]  # (offset in the buffer, one of the sample's tensors)
# Handing rows to a second thread costs a thread wake-up and GIL hand-offs; for smaller batches that
# eats what the second copy saves (interleaved runs, docs/performance.md).
PARALLEL_READ_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Mismatch:
    """A row whose member did not hash to its checksum as read into the batch (`found` None: the read failed)."""

    row: int
    check: MemberCheck
    found: int | None
    placed: tuple[tuple[int, FileTensor], ...]  # the member's tensors in the row: (offset in the buffer, tensor)

    def patch(self, buffer: BatchBuffer, member: Buffer) -> None:
        """Put the member's tensors, from its bytes read again (and checked), in their places in the batch."""
        data = memoryview(member)
        for start, tensor in self.placed:
            begin = tensor.offset - self.check.base
            buffer.view[start : start + tensor.nbytes] = data[begin : begin + tensor.nbytes]


def fill_rows(
    buffer: BatchBuffer, rows: Sequence[Sequence[Placed]], checks: Sequence[MemberCheck | None]
) -> list[Mismatch]:
    """Fill every row's tensors into their places and check each row's member; the rows that do not match."""
    order = list(range(len(rows)))
    big = len(rows) > 1 and sum(_row_bytes(row) for row in rows) >= PARALLEL_READ_MIN_BYTES
    helper = _second_reader() if big and not buffer.shared else None
    if helper is None:
        found = [fill_row(buffer, row, rows[row], checks[row]) for row in order]
    else:
        mine, theirs = halves_by_bytes(order, [_row_bytes(row) for row in rows])
        pending: Future[list[Mismatch | None]] = helper.submit(_fill_each, buffer, theirs, rows, checks)
        try:
            found = _fill_each(buffer, mine, rows, checks)
        finally:
            wait([pending])  # the helper must be done with the buffer before anyone reuses it
        found += pending.result()
    return sorted((m for m in found if m is not None), key=lambda mismatch: mismatch.row)


def _fill_each(
    buffer: BatchBuffer, order: Sequence[int], rows: Sequence[Sequence[Placed]], checks: Sequence[MemberCheck | None]
) -> list[Mismatch | None]:
    """`fill_row` for the rows in `order`."""
    return [fill_row(buffer, row, rows[row], checks[row]) for row in order]


def fill_row(buffer: BatchBuffer, row: int, parts: Sequence[Placed], check: MemberCheck | None) -> Mismatch | None:
    """Copy one sample's tensors into the buffer, then check its member (None: no check, or it matches).

    A check covers the sample's `FileTensor`s (its member's tensors); anything else it holds (an
    edit mask read while the sample was checked) is hashed from the member where it lies.
    """
    in_files: list[Part] = []
    placed: list[tuple[int, FileTensor]] = []
    for start, source in parts:
        if type(source) is not FileTensor:
            buffer.copy(start, source)  # type: ignore[arg-type]
            continue
        placed.append((start, source))
        if source.memory is not None:
            buffer.view[start : start + source.nbytes] = source.memory[source.offset : source.offset + source.nbytes]
            continue
        held = check.held(source.offset, source.nbytes) if check is not None else b""
        if held:  # read with the member's header already: copied from there, only the rest from the file
            buffer.view[start : start + len(held)] = held
        if len(held) < source.nbytes:  # the rest, from the file
            in_files.append((source.offset + len(held), start + len(held), source.nbytes - len(held), source))
    try:
        read_in_file_order(buffer, in_files)
    except CacheFormatError:  # the file ended early: a truncated shard, which the member's re-read shows
        if check is None:
            raise
        return Mismatch(row, check, None, tuple(placed))
    if check is None:
        return None
    view = buffer.view
    found = check.digest([(tensor.offset, view[start : start + tensor.nbytes]) for start, tensor in placed])
    return None if found == check.expected else Mismatch(row, check, found, tuple(placed))


def read_in_file_order(buffer: BatchBuffer, parts: list[Part]) -> None:
    """Read tensors still in files: sorted by file and offset, each contiguous run with one `preadv`."""
    parts.sort(key=lambda part: (part[3].descriptor, part[0]))
    run: list[Part] = []
    for part in parts:
        if run and (run[-1][0] + run[-1][2] != part[0] or run[-1][3].descriptor != part[3].descriptor):
            buffer.read_run(run)
            run = []
        run.append(part)
    if run:
        buffer.read_run(run)


def halves_by_bytes(order: Sequence[int], sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Split rows into two groups of about equal bytes (largest first, each to the lighter group)."""
    groups: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for row in sorted(order, key=lambda r: -sizes[r]):
        lighter = 0 if loads[0] <= loads[1] else 1
        groups[lighter].append(row)
        loads[lighter] += sizes[row]
    return groups


def _row_bytes(parts: Sequence[Placed]) -> int:
    """Bytes one row's tensors take."""
    total = 0
    for _, source in parts:
        total += source.nbytes if isinstance(source, FileTensor) else source.numel() * source.element_size()
    return total


_READER: tuple[int, ThreadPoolExecutor] | None = None
_READER_LOCK = threading.Lock()


def _second_reader() -> ThreadPoolExecutor | None:
    """The one helper thread that fills rows beside the calling thread, or None on a single core.

    Made per process: a forked child inherits the executor but not its thread.
    """
    global _READER
    if usable_cores() < 2:
        return None
    with _READER_LOCK:
        if _READER is None or _READER[0] != os.getpid():
            _READER = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="image-edit-data-read"))
        return _READER[1]
