"""One DDP fit, hard-killed at several seeded-random steps and resumed each time, trains on exactly the
batches of an uninterrupted fit.

Every attempt runs the fit harness (2 gloo ranks, 2 loader workers each, a checkpoint every
`CKPT_EVERY` steps) in its own record directory; all attempts share one checkpoint directory. An
attempt dies in one of three ways: `os._exit` right after a checkpoint, `os._exit` halfway through
writing a checkpoint (a truncated file is left at the checkpoint's path), or SIGKILL to its whole
process group while every rank is inside a training step. The next attempt resumes from the newest
checkpoint that `torch.load` can read.

Stitching: a killed attempt's records run past the checkpoint the next attempt resumes from (the
batches after the last complete checkpoint died with it). So the training history of a rank is,
for each attempt in order, its records with `start < step <= end`, where `start` is the checkpoint
step it resumed from and `end` is the one the next attempt resumed from (no end for the last run).

Set RESUME_FUZZ_SEED to try another kill schedule.

Schedules in which a run resumed at an epoch's last batch is itself killed and resumed matter most:
Lightning 2.6.6 then stops counting the next epoch as started (`epoch_progress.started` lags), so any
resume logic that reads Lightning's epoch counters replays an epoch; the data module does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from support import SUPPORT
from support.caches import tiny_cache
from support.fits import DIED_WHILE_SAVING, KILLED_AFTER_CHECKPOINT, planned

HARNESS = SUPPORT / "fits.py"
SEED = int(os.environ.get("RESUME_FUZZ_SEED", "20240611"))
RANKS = 2
EPOCHS = 3
STEPS_PER_EPOCH = 8  # per rank: buckets of 13, 11 and 9 samples, batch size 2, 2 ranks, drop_last
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH
CKPT_EVERY = 2  # divides STEPS_PER_EPOCH, so every epoch's last batch gets a checkpoint
# Two kills by default (a checkpoint left half-written just after an epoch's end, then a SIGKILL in the first step of
# the run resumed from that end): each attempt is a DDP start, the suite's budget. RESUME_FUZZ_KILLS=6 adds random
# ones of all three kinds.
KILLS = max(2, int(os.environ.get("RESUME_FUZZ_KILLS", "2")))
ATTEMPT_TIMEOUT = 300  # seconds; one DDP start costs 10-30 s on a busy 2-core machine
HARNESS_ARGS = ("--devices", str(RANKS), "--num-workers", "2", "--epochs", str(EPOCHS), "--ckpt-every", str(CKPT_EVERY))

How = Literal["exit_after_checkpoint", "die_while_saving", "sigkill_mid_step"]
Record = dict[str, Any]  # one training batch: {"epoch", "step", "ids"}


@dataclass(frozen=True)
class Kill:
    """Where and how one attempt dies."""

    step: int
    how: How

    def harness_args(self) -> list[str]:
        option = {
            "exit_after_checkpoint": "--kill-at-step",
            "die_while_saving": "--die-while-saving-step",
            "sigkill_mid_step": "--pause-at-step",
        }[self.how]
        return [option, str(self.step)]

    def exit_code(self) -> int:
        return {
            "exit_after_checkpoint": KILLED_AFTER_CHECKPOINT,
            "die_while_saving": DIED_WHILE_SAVING,
            "sigkill_mid_step": -signal.SIGKILL,
        }[self.how]

    def newest_complete_checkpoint_step(self) -> int:
        """The step of the newest complete checkpoint once this kill has struck."""
        if self.how == "exit_after_checkpoint":
            return self.step
        if self.how == "die_while_saving":
            return self.step - CKPT_EVERY
        return (self.step - 1) // CKPT_EVERY * CKPT_EVERY  # the step-k checkpoint was never started


class InexactResume(AssertionError):
    """The stitched training history differs from the uninterrupted run's."""


def kill_schedule(rng: random.Random) -> list[Kill]:
    """`KILLS` kills, each after a complete checkpoint and past the step its run resumed from: one halfway through
    writing the checkpoint after an epoch's last one (so the next run resumes at that epoch's end), a SIGKILL in the
    first step of that resumed run, the rest of random kinds (an exit right after a checkpoint among them)."""
    epoch_ends = [STEPS_PER_EPOCH * epoch for epoch in range(1, EPOCHS)]
    boundary = rng.choice(epoch_ends)
    mid_save = Kill(boundary + CKPT_EVERY, "die_while_saving")
    after_boundary = Kill(boundary + 1, "sigkill_mid_step")
    taken = (mid_save.step, after_boundary.step)
    free = [s for s in range(CKPT_EVERY + 1, TOTAL_STEPS) if s not in taken]
    others = []
    for step in rng.sample(free, KILLS - 2):
        kinds: list[How] = ["sigkill_mid_step"]
        if step % CKPT_EVERY == 0:
            kinds += ["exit_after_checkpoint", "die_while_saving"]
        others.append(Kill(step, rng.choice(kinds)))
    # The half-written save strikes first: the run it leaves resumes at the epoch's end and is killed in its next step.
    early = sorted((kill for kill in others if kill.step < after_boundary.step), key=lambda kill: kill.step)
    late = sorted((kill for kill in others if kill.step > mid_save.step), key=lambda kill: kill.step)
    return [*early, mid_save, after_boundary, *late]


SCHEDULE = kill_schedule(random.Random(SEED))


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def newest_complete_checkpoint(directory: Path) -> tuple[Checkpoint, list[Path]]:
    """The newest checkpoint that loads, and the newer files skipped because they do not."""
    skipped = []
    for path in sorted(directory.glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns, reverse=True):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)  # our own test files
        except (RuntimeError, EOFError, pickle.UnpicklingError):
            skipped.append(path)
            continue
        return Checkpoint(path, int(state["global_step"])), skipped
    raise AssertionError(f"no loadable checkpoint in {directory} (unreadable: {[p.name for p in skipped]})")


def run_attempt(cache: Path, out: Path, kill: Kill | None, *args: str) -> None:
    """Run the harness until `kill` strikes (or to the end); leave none of its processes behind."""
    out.mkdir(parents=True)
    log = out / "log.txt"
    command = [sys.executable, str(HARNESS), str(cache), str(out), *HARNESS_ARGS, *args]
    if kill is not None:
        command += kill.harness_args()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with log.open("w") as sink:
        # A session of its own, so one killpg reaches rank 0, the rank Lightning spawns and all workers.
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        if kill is not None and kill.how == "sigkill_mid_step":
            wait_until_paused(proc, out, log)
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait(timeout=ATTEMPT_TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is already gone
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    expected = 0 if kill is None else kill.exit_code()
    assert code == expected, f"{out.name} ({kill}): exit code {code}, expected {expected}\n{log.read_text()[-3000:]}"


def wait_until_paused(proc: subprocess.Popen[bytes], out: Path, log: Path) -> None:
    deadline = time.monotonic() + ATTEMPT_TIMEOUT
    while not all((out / f"paused.rank{r}").exists() for r in range(RANKS)):
        assert proc.poll() is None, f"{out.name} ended ({proc.returncode}) before pausing\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{out.name} did not pause in {ATTEMPT_TIMEOUT} s"
        time.sleep(0.1)


def read_records(path: Path) -> list[Record]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@dataclass(frozen=True)
class Attempt:
    """One run: its records, the checkpoint step it resumed from and the one the next run resumed from."""

    out: Path
    start: int
    end: int | None  # None: it ran to the end of training

    def kept_records(self, rank: int) -> list[Record]:
        """This rank's batches that survive in the checkpoint the next attempt resumed from."""
        return [r for r in read_records(self.out / f"rank{rank}.jsonl") if self.end is None or r["step"] <= self.end]


def stitch(attempts: list[Attempt], rank: int) -> list[Record]:
    """One rank's training history across attempts (see the module docstring)."""
    history = []
    for attempt in attempts:
        history += attempt.kept_records(rank)
    return history


def uninterrupted(cache: Path, rank: int) -> list[Record]:
    """The records an uninterrupted fit writes on `rank`: the planned batches, one step each.

    The plan comes from the pure plan function (`support.fits.planned`), not from the sampler whose
    resume is under test, so a sampler that resumed into the wrong epoch or step cannot agree with it
    by sharing the mistake.
    """
    batches = [(epoch, ids) for epoch in range(EPOCHS) for ids in planned(cache, RANKS, epoch)[rank]]
    return [{"epoch": epoch, "step": step, "ids": ids} for step, (epoch, ids) in enumerate(batches, start=1)]


def by_epoch(records: list[Record]) -> list[list[list[int]]]:
    return [[r["ids"] for r in records if r["epoch"] == epoch] for epoch in range(EPOCHS)]


def describe_difference(want: list[list[int]], got: list[list[int]]) -> str:
    want_ids = Counter(i for batch in want for i in batch)
    got_ids = Counter(i for batch in got for i in batch)
    lost, repeated = want_ids - got_ids, got_ids - want_ids
    return f"lost {sorted(lost.elements())}, repeated {sorted(repeated.elements())}"


@pytest.mark.slow
def test_a_ddp_fit_killed_at_random_steps_trains_on_exactly_the_batches_of_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    """Real processes: two ranks with workers, killed for real (one DDP start each kill, and one to finish)."""
    cache = tiny_cache(tmp_path / "cache", counts=(13, 11, 9))
    # An uninterrupted fit trains on the epoch plan (test_datamodule_resume.py checks one against it and
    # uses it as its DDP baseline too), so the plan stands in for that run here: one DDP start less.
    baseline = [uninterrupted(cache, rank) for rank in range(RANKS)]
    for rank in range(RANKS):
        assert [len(epoch) for epoch in by_epoch(baseline[rank])] == [STEPS_PER_EPOCH] * EPOCHS

    schedule = SCHEDULE
    print(f"seed {SEED}: kills {[(kill.step, kill.how) for kill in schedule]}")
    ckpt_dir = tmp_path / "ckpt"
    attempts: list[Attempt] = []
    start: Checkpoint | None = None
    for number, kill in enumerate([*schedule, None]):
        out = tmp_path / f"attempt{number}"
        resume = ["--ckpt", str(start.path)] if start else []
        run_attempt(cache, out, kill, "--ckpt-dir", str(ckpt_dir), *resume)
        start_step = start.step if start else 0
        if kill is None:
            attempts.append(Attempt(out, start_step, None))
            break
        for rank in range(RANKS):
            steps = [r["step"] for r in read_records(out / f"rank{rank}.jsonl")]
            assert steps == list(range(start_step + 1, kill.step + 1)), f"{out.name} rank {rank} ran steps {steps}"
        start, skipped = newest_complete_checkpoint(ckpt_dir)
        assert start.step == kill.newest_complete_checkpoint_step(), f"resuming after {kill} from {start}"
        if kill.how == "die_while_saving":
            assert [p.name for p in skipped] == [f"step={kill.step}.ckpt"], "the half-written checkpoint is skipped"
        attempts.append(Attempt(out, start_step, start.step))

    dropped = sum(kill.step - attempt.end for kill, attempt in zip(schedule, attempts) if attempt.end is not None)
    assert dropped > 0, "some kill struck after the newest complete checkpoint, so the stitching drops batches"
    for rank in range(RANKS):
        history = stitch(attempts, rank)
        for epoch, (want, got) in enumerate(zip(by_epoch(baseline[rank]), by_epoch(history))):
            if got != want:
                raise InexactResume(f"seed {SEED}, rank {rank}, epoch {epoch}: {describe_difference(want, got)}")
        if history != baseline[rank]:
            raise InexactResume(f"seed {SEED}, rank {rank}: the same batches, but at other steps")
