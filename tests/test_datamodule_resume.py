"""Exact mid-epoch resume through real, hard-killed Lightning runs (1 process and 2-process DDP on gloo).

Each scenario runs the fit harness until it dies right after the step-k checkpoint, then resumes
from that checkpoint; per rank, the batches trained before the kill followed by those trained
after the resume must equal an uninterrupted run's batches: nothing skipped, nothing repeated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cachefactory import tiny_cache

HARNESS = Path(__file__).with_name("fit_harness.py")
pytestmark = pytest.mark.slow


def run(cache: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(HARNESS), str(cache), str(out), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def records(out: Path, devices: int) -> list[list[tuple[int, list[int]]]]:
    """Per rank, (epoch, sample ids) of every training batch, in order."""
    result = []
    for rank in range(devices):
        lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
        result.append([(line["epoch"], line["ids"]) for line in map(json.loads, lines)])
    return result


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("cache"), counts=(13, 11, 9))


@pytest.fixture(scope="module")
def baselines(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[list[tuple[int, list[int]]]]]:
    """Uninterrupted 3-epoch runs; the data order does not depend on workers or accumulation."""
    result = {}
    for devices in (1, 2):
        out = tmp_path_factory.mktemp(f"baseline{devices}")
        done = run(cache, out, "--devices", str(devices))
        assert done.returncode == 0, done.stderr[-3000:]
        result[devices] = records(out, devices)
    return result


SCENARIOS = [
    # devices, workers before kill, workers after resume, accumulate, kill at optimizer step
    pytest.param(1, 0, 0, 1, 4, id="1proc-nw0-epoch1-mid"),
    pytest.param(1, 0, 0, 1, 19, id="1proc-nw0-epoch2-mid"),
    pytest.param(1, 0, 0, 1, 15, id="1proc-nw0-epoch-boundary"),
    pytest.param(1, 2, 2, 1, 19, id="1proc-nw2-epoch2-mid"),
    pytest.param(1, 2, 2, 1, 30, id="1proc-nw2-epoch-boundary"),
    pytest.param(1, 0, 0, 2, 10, id="1proc-nw0-accumulate2"),
    pytest.param(1, 2, 0, 1, 6, id="1proc-workers-2-to-0"),
    pytest.param(1, 2, 4, 1, 20, id="1proc-workers-2-to-4"),
    pytest.param(2, 2, 2, 1, 11, id="ddp-nw2-epoch2-mid"),
    pytest.param(2, 0, 0, 1, 8, id="ddp-nw0-epoch-boundary"),
    pytest.param(2, 2, 2, 2, 6, id="ddp-nw2-accumulate2"),
    pytest.param(2, 0, 2, 1, 5, id="ddp-workers-0-to-2"),
]


@pytest.mark.parametrize(("devices", "workers", "resume_workers", "accumulate", "kill_at"), SCENARIOS)
def test_killed_and_resumed_run_trains_on_the_same_batches_as_an_uninterrupted_one(
    cache: Path,
    baselines: dict[int, list[list[tuple[int, list[int]]]]],
    tmp_path: Path,
    devices: int,
    workers: int,
    resume_workers: int,
    accumulate: int,
    kill_at: int,
) -> None:
    common = ["--devices", str(devices), "--accumulate", str(accumulate)]
    killed = run(cache, tmp_path, *common, "--num-workers", str(workers), "--kill-at-step", str(kill_at))
    assert killed.returncode == 17, killed.stderr[-3000:]
    before = records(tmp_path, devices)
    assert all(0 < len(b) < len(full) for b, full in zip(before, baselines[devices])), "killed mid-run"
    ckpt = tmp_path / "ckpt" / f"step={kill_at}.ckpt"
    resumed = run(cache, tmp_path, *common, "--num-workers", str(resume_workers), "--ckpt", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = records(tmp_path, devices)
    for rank in range(devices):
        assert after[rank] == baselines[devices][rank], f"rank {rank} diverged after resuming at step {kill_at}"


def test_resuming_with_a_changed_data_config_says_what_changed(cache: Path, tmp_path: Path) -> None:
    killed = run(cache, tmp_path, "--kill-at-step", "3")
    assert killed.returncode == 17, killed.stderr[-3000:]
    resumed = run(cache, tmp_path, "--seed", "7", "--ckpt", str(tmp_path / "ckpt" / "step=3.ckpt"))
    assert resumed.returncode != 0
    assert "seed: checkpoint 42, now 7" in resumed.stderr
    assert "on_resume_mismatch='restart_epoch'" in resumed.stderr
