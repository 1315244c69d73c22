"""Exact mid-epoch resume through Lightning runs that die right after a checkpoint, then resume from it.

Per rank, the batches trained before the kill followed by those trained after the resume must equal
an uninterrupted run's batches: nothing skipped, nothing repeated. One-process scenarios run inside
the test process (the kill is an exception raised right after the checkpoint is written, which unwinds
through Lightning like a crash), workers changing across the resume and gradient accumulation among
them. Real processes killed for real are test_resume_fuzz.py's (DDP with workers, killed in three ways:
after a checkpoint at an epoch's end, while writing one, SIGKILL mid-step), which covers the one-process
hard kill this file once ran too; a DDP mixture fit killed hard is test_mixture_fit.py's.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from support.fits import FitOptions, Records, SimulatedKill, fit, planned, records

from image_edit_data import ResumeMismatchError


@pytest.fixture(scope="module")
def baseline_one_process(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Records:
    """An uninterrupted 3-epoch run; the data order does not depend on workers or accumulation."""
    out = tmp_path_factory.mktemp("baseline1")
    fit(FitOptions(str(cache), str(out), in_process=True))
    return records(out, 1)


IN_PROCESS = [
    # workers before the kill, workers after the resume, accumulate, kill at optimizer step
    pytest.param(0, 0, 1, 4, id="nw0-epoch1-mid"),
    pytest.param(0, 0, 1, 19, id="nw0-epoch2-mid"),
    pytest.param(0, 0, 1, 15, id="nw0-epoch-boundary"),
    pytest.param(2, 2, 1, 30, id="nw2-epoch-boundary"),
    pytest.param(2, 2, 1, 19, id="nw2-epoch2-mid"),
    pytest.param(0, 0, 2, 10, id="nw0-accumulate2"),
    pytest.param(2, 0, 1, 6, id="workers-2-to-0"),
    pytest.param(2, 4, 1, 20, id="workers-2-to-4"),
]


@pytest.mark.parametrize(("workers", "resume_workers", "accumulate", "kill_at"), IN_PROCESS)
def test_a_run_resumed_after_a_crash_trains_on_the_same_batches_as_an_uninterrupted_one(
    cache: Path,
    baseline_one_process: Records,
    tmp_path: Path,
    workers: int,
    resume_workers: int,
    accumulate: int,
    kill_at: int,
) -> None:
    options = FitOptions(str(cache), str(tmp_path), accumulate=accumulate, in_process=True)
    with pytest.raises(SimulatedKill):
        fit(options | {"num_workers": workers, "kill_at_step": kill_at})
    assert 0 < len(records(tmp_path, 1)[0]) < len(baseline_one_process[0]), "killed mid-run"
    ckpt = tmp_path / "ckpt" / f"step={kill_at}.ckpt"
    fit(options | {"num_workers": resume_workers, "ckpt": str(ckpt)})
    assert records(tmp_path, 1) == baseline_one_process, f"diverged after resuming at step {kill_at}"


def test_an_uninterrupted_run_trains_on_the_planned_batches(cache: Path, baseline_one_process: Records) -> None:
    plans = [planned(cache, 1, epoch)[0] for epoch in range(3)]
    assert baseline_one_process == [[(epoch, ids) for epoch in range(3) for ids in plans[epoch]]]


def test_resuming_with_a_changed_data_config_says_what_changed(cache: Path, tmp_path: Path) -> None:
    options = FitOptions(str(cache), str(tmp_path), in_process=True)
    with pytest.raises(SimulatedKill):
        fit(options | {"kill_at_step": 3})
    with pytest.raises(ResumeMismatchError, match=r"seed: checkpoint 42, now 7.*on_resume_mismatch='restart_epoch'"):
        fit(options | {"seed": 7, "ckpt": str(tmp_path / "ckpt" / "step=3.ckpt")})


def test_after_a_refused_resume_a_fit_with_workers_leaves_no_worker_processes(cache: Path, tmp_path: Path) -> None:
    """The refusal comes before Lightning's loader request, which would otherwise leak a patch that keeps iterators."""
    options = FitOptions(str(cache), str(tmp_path / "run"), in_process=True)
    with pytest.raises(SimulatedKill):
        fit(options | {"kill_at_step": 3})
    with pytest.raises(ResumeMismatchError):
        fit(options | {"seed": 7, "ckpt": str(tmp_path / "run" / "ckpt" / "step=3.ckpt")})
    fit(FitOptions(str(cache), str(tmp_path / "later"), epochs=1, num_workers=2, in_process=True))
    assert multiprocessing.active_children() == []
