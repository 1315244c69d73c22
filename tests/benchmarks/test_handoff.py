"""benchmarks/handoff.py: CPU time per batch in the training process and in the workers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.caches import tiny_cache

from benchmarks import REPO, child_environment


@pytest.mark.slow  # the script runs as users run it, in a process of its own, with a worker
def test_the_hand_off_script_prints_cpu_per_batch_for_ours_and_for_torch_alone(tmp_path: Path) -> None:
    cache = tiny_cache(tmp_path / "cache", counts=(100,))  # 25 batches: warm-up and timed batches fit
    command = [sys.executable, "-m", "benchmarks.handoff", str(cache), "--num-workers", "0", "1", "--batches", "5"]
    printed = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=300, cwd=REPO, env=child_environment()
    ).stdout
    labels = [line.split(" wall ")[0].strip() for line in printed.splitlines()]
    assert labels == ["ours, 0 workers", "ours, 1 workers", "torch's hand-off alone, 1 workers"]
    for line in printed.splitlines():
        wall, main, workers, worker_main, worker_other = map(float, re.findall(r"(\d+\.\d+)", line))
        assert wall > 0 and main > 0
        assert workers == pytest.approx(worker_main + worker_other, abs=0.011)
        if "0 workers" in line:  # CPU time comes in 10 ms ticks: a few tiny batches in a worker may show 0.00
            assert workers == 0
