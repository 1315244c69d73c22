"""How the way a shard was written changes how fast it reads back from the page cache.

Usage: python -m benchmarks.write_pattern [--reads 200] [--rounds 2]

Writes one 32 MiB file of random bytes three ways, then reads `--reads` random 0.9 MB ranges of it
(one sample of the `small` preset) with `preadv` from the page cache, and prints microseconds per
read. `one`: a single write (as `cache pack` writes a shard now, in 8 MiB pieces); `tar`: a 512-byte
header then the member, as a tar writer with large copies does; `16k`: tarfile's default copy size;
`8k`: what reached the file through tarfile and Python's default 8 KiB buffer (how `cache pack`
wrote shards before 2026-12-05). On kernels whose page cache uses large folios for the file system
(ext4 on Linux 6.18 here), small writes leave small folios that every read then walks.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

FILE_BYTES, READ_BYTES, MEMBER_BYTES = 32 << 20, 900_000, 909_000


def write_one(fd: int, data: bytes) -> None:
    os.write(fd, data)


def write_tar(fd: int, data: bytes) -> None:
    position = 0
    while position < len(data):
        os.write(fd, data[position : position + 512])
        position += 512
        os.write(fd, data[position : position + MEMBER_BYTES])
        position += MEMBER_BYTES


def pieces(size: int) -> Callable[[int, bytes], None]:
    """Writes of `size` bytes each."""

    def write(fd: int, data: bytes) -> None:
        for position in range(0, len(data), size):
            os.write(fd, data[position : position + size])

    return write


PATTERNS: dict[str, Callable[[int, bytes], None]] = {
    "one": write_one,
    "tar": write_tar,
    "16k": pieces(16 << 10),
    "8k": pieces(8 << 10),
}


def read_cost(path: Path, reads: int) -> float:
    """Microseconds per `preadv` of READ_BYTES at random 512-aligned offsets (best of three passes)."""
    buffer = bytearray(READ_BYTES)
    offsets = [random.randrange(FILE_BYTES - READ_BYTES) & ~511 for _ in range(reads)]
    descriptor = os.open(path, os.O_RDONLY)
    try:
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for offset in offsets:
                os.preadv(descriptor, [buffer], offset)
            best = min(best, time.perf_counter() - started)
    finally:
        os.close(descriptor)
    return best / reads * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=200, help="random reads per file")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each writing and reading every pattern")
    arguments = parser.parse_args()
    data = os.urandom(FILE_BYTES)
    with tempfile.TemporaryDirectory() as folder:
        for number in range(arguments.rounds):
            for name, write in PATTERNS.items():
                path = Path(folder) / name
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    write(descriptor, data)
                    os.fsync(descriptor)
                finally:
                    os.close(descriptor)
                cost = read_cost(path, arguments.reads)
                print(f"round {number} written {name:>3}: {cost:6.1f} us per 0.9 MB read from the page cache")
                path.unlink()


if __name__ == "__main__":
    main()
