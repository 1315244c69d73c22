"""A loader worker that stops answering becomes an error naming the rank and the worker, never a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT
from support.caches import tiny_cache
from support.processes import SeenWorkers, alive
from support.stuck_workers import STUCK_SECONDS, DiesAtStartUp, ReadTimesOut, StuckAtStartUp, StuckInBatch

from image_edit_data import ImageEditDataloaderConfig
from image_edit_data.workers import LoaderWorkerTimeoutError
from image_edit_data.workers.start import wait_for_server

# Long enough that a healthy worker always answers, even with the other test worker running a DDP fit on the same
# 2 cores; each test waits it out about once (claims that follow one timeout share its test). The fork server's own
# imports are waited for before any clock starts (`server_loaded`): under that load they alone can take longer.
TIMEOUT = 4.0
SRC = ROOT / "src"

pytestmark = pytest.mark.slow  # each test waits out a timeout and the shutdown of a stuck worker


@pytest.fixture(scope="module", autouse=True)
def server_loaded() -> None:
    """This process's fork server, started and done importing, so a timeout measures workers, not the server."""
    wait_for_server(None)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("cache"), counts=(12, 12))


def config(cache_dir: Path) -> ImageEditDataloaderConfig:
    return ImageEditDataloaderConfig(cache_dir=str(cache_dir), num_workers=2, worker_timeout=TIMEOUT)


def test_a_worker_stuck_in_a_batch_raises_naming_it_ends_only_its_own_pool_and_the_loader_runs_again(
    cache_dir: Path,
) -> None:
    """One timeout waited out for what follows it: the error names rank, worker and batch, long before the stuck
    worker would answer; the stuck loader's pool is gone while the workers of a loader started after it (a
    validation loader's persistent workers, say) go on; the next pass starts a new pool at the first batch not
    consumed."""
    cfg = config(cache_dir)
    dataset = StuckInBatch(str(cache_dir), worker=1, step=3)  # batches go to workers in turn: 1, 3, ... to worker 1
    built = cfg.build_for(dataset=dataset, dp_rank=1, dp_world_size=2, batch_size=2)
    other = cfg.build_for(dataset=None, dp_rank=0, dp_world_size=1, batch_size=2)
    stuck_batches, other_batches = iter(built.dataloader), iter(other.dataloader)
    with SeenWorkers() as old:
        got = [next(stuck_batches)["metadata"]["position"]]
    with SeenWorkers() as other_workers:
        first = next(other_batches)  # this pool starts after the stuck loader's
    started = time.monotonic()
    with pytest.raises(
        LoaderWorkerTimeoutError,
        match=rf"rank 1: a loader worker did not answer within worker_timeout={TIMEOUT:g} s: "
        r"worker 1 of 2 has been loading batch 3 of epoch 0 for \d+ s",
    ) as raised:
        for batch in stuck_batches:
            got.append(batch["metadata"]["position"])
    assert got == [[0, 0], [0, 1], [0, 2]]  # everything before the stuck batch arrived
    assert time.monotonic() - started < STUCK_SECONDS / 2  # the loader did not wait for the worker
    # Gone while the error is still held (by a supervisor's handler, say), the stuck worker too.
    assert raised.value is not None and len(old.seen) == 2 and old.still_running() == []
    # The position stays at the first batch not trained on, so a restarted run resumes exactly there.
    assert built.sampler.state_dict()["consumed"] == 3

    assert len(other_workers.seen) == 2 and other_workers.still_running() == sorted(other_workers.seen)
    rest = [batch["metadata"]["position"][1] for batch in other_batches]
    assert [first["metadata"]["position"][1], *rest] == list(range(len(other.sampler)))
    other.dataloader.close()

    old_table = built.dataloader.watch.table
    dataset.stuck_step = -1
    built.sampler.set_epoch(0)
    with SeenWorkers() as new:
        rest = [batch["metadata"]["position"][1] for batch in built.dataloader]
    assert rest == list(range(3, len(built.sampler)))
    assert len(new.seen) == 2 and not new.seen & old.seen
    # A worker of the old pool writes only to its own table, never into the new pool's.
    assert built.dataloader.watch.table.data_ptr() != old_table.data_ptr()
    built.dataloader.close()


def test_workers_stuck_at_start_up_raise_naming_each_one_and_are_gone(cache_dir: Path) -> None:
    built = config(cache_dir).build_for(
        dataset=StuckAtStartUp(str(cache_dir)), dp_rank=0, dp_world_size=1, batch_size=2
    )
    started = time.monotonic()
    with (
        SeenWorkers() as workers,
        pytest.raises(
            LoaderWorkerTimeoutError,
            match=r"rank 0: .*worker 0 of 2 never started \(stuck in start-up\); worker 1 of 2 never started",
        ) as raised,
    ):
        next(iter(built.dataloader))
    assert time.monotonic() - started < STUCK_SECONDS / 2
    assert raised.value is not None and len(workers.seen) == 2 and workers.still_running() == []


def test_a_worker_error_that_mentions_a_timeout_is_that_error_not_a_worker_timeout(cache_dir: Path) -> None:
    dataset = ReadTimesOut(str(cache_dir), step=1)
    built = config(cache_dir).build_for(dataset=dataset, dp_rank=0, dp_world_size=1, batch_size=2)
    started = time.monotonic()
    caught = r"(?s)Caught RuntimeError in DataLoader worker process 1.*read timed out"
    with pytest.raises(RuntimeError, match=caught) as error:
        list(built.dataloader)
    assert not isinstance(error.value, LoaderWorkerTimeoutError)
    assert time.monotonic() - started < TIMEOUT  # reported as it came, not after waiting out worker_timeout
    built.dataloader.close()


def test_workers_that_die_at_start_up_fail_the_loader_within_seconds_naming_the_fix(cache_dir: Path) -> None:
    """A fork server's workers are not children of the training process: torch's liveness check finds them gone."""
    cfg = ImageEditDataloaderConfig(cache_dir=str(cache_dir), num_workers=2)  # worker_timeout: the default 600 s
    built = cfg.build_for(dataset=DiesAtStartUp(str(cache_dir)), dp_rank=0, dp_world_size=1, batch_size=2)
    started = time.monotonic()
    with (
        SeenWorkers() as workers,
        pytest.raises(
            RuntimeError,
            match=r"exited unexpectedly before the pool delivered its first batch; .*each worker imports the main "
            r"module again.*`if __name__ == \"__main__\":`",
        ),
    ):
        next(iter(built.dataloader))
    assert time.monotonic() - started < 30
    assert workers.still_running() == []


KILLED_OWNER = """
import json, os, signal, sys
from image_edit_data import ImageEditDataloaderConfig

if __name__ == "__main__":
    cache, start = sys.argv[1], sys.argv[2]
    built = ImageEditDataloaderConfig(cache_dir=cache, num_workers=2, multiprocessing_context=start).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    next(iter(built.dataloader))
    print(json.dumps([w.pid for w in built.dataloader._iterator._workers]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("start", ["forkserver", "fork"])
def test_workers_end_when_their_training_process_is_killed(tmp_path: Path, cache_dir: Path, start: str) -> None:
    """A killed run leaves no workers behind (a fork server's workers do not have the run as parent)."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_OWNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, str(script), str(cache_dir), start], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    workers = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(workers) == 2
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if alive(pid)]
