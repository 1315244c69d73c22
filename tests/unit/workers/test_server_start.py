"""With workers, the fork server starts when the cache opens, so its imports overlap what comes before the pool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import ROOT
from support.caches import tiny_cache

CHILD = """
import os, sys, time
from image_edit_data import ImageEditDataloaderConfig

def children() -> list[str]:
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as listed:
            for pid in listed.read().split():
                with open(f"/proc/{pid}/cmdline", "rb") as command:
                    found.append(command.read().replace(b"\\0", b" ").decode())
    return found

workers = int(sys.argv[2])
ImageEditDataloaderConfig(cache_dir=sys.argv[1], num_workers=workers).open_dataset()
print(sum("multiprocessing.forkserver" in command for command in children()))
"""


def servers_after_opening(cache: Path, workers: int) -> int:
    """Fork servers a fresh process runs right after opening the cache with `workers` workers (no loader built)."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache), str(workers)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    return int(result.stdout.strip().splitlines()[-1])


def test_opening_a_cache_with_workers_starts_the_fork_server_and_without_workers_does_not(tmp_path: Path) -> None:
    cache = tiny_cache(tmp_path / "cache", counts=(4,))
    assert servers_after_opening(cache, 2) == 1
    assert servers_after_opening(cache, 0) == 0
