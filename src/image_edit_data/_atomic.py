"""Atomic file writes: a crash leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_writer(path: str | Path, mode: str = "wb", buffering: int = -1) -> Iterator[IO]:
    """Open a hidden temporary file beside `path`; on success fsync it and rename it over `path`.

    `buffering` is `open`'s: the stream's buffer size in bytes (-1: Python's default, 8 KiB).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, mode, buffering) as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    with atomic_writer(path) as stream:
        stream.write(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write UTF-8 `text` to `path` atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))
