"""Elastic resume through Lightning: a 2-rank DDP fit killed mid-epoch continues on 1 process."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from support.caches import tiny_cache
from support.fits import FitOptions, fit, planned, records, run

from image_edit_data import ResumeMismatchError

pytestmark = pytest.mark.slow
EPOCHS = 2


def test_a_fit_killed_on_two_ranks_finishes_its_epoch_on_one_without_loss_or_repeats(tmp_path: Path) -> None:
    cache = tiny_cache(tmp_path / "cache", counts=(13, 11, 9))
    out = tmp_path / "run"
    epochs = ["--epochs", str(EPOCHS), "--elastic"]
    killed = run(cache, out, "--devices", "2", "--num-workers", "2", "--kill-at-step", "3", *epochs)
    assert killed.returncode == 17, killed.stderr[-3000:]
    plain = FitOptions(str(cache), str(tmp_path / "plain"), in_process=True, ckpt=str(out / "ckpt/step=3.ckpt"))
    with pytest.raises(ResumeMismatchError, match="world_size: checkpoint 2, now 1"):
        fit(plain)  # without elastic=True, a run on another number of ranks is refused
    resumed = run(cache, out, "--devices", "1", "--ckpt", str(out / "ckpt/step=3.ckpt"), *epochs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    rank0, rank1 = records(out, 2)
    epoch0 = [ids for e, ids in rank0 + rank1 if e == 0]
    due = {i for rank in planned(cache, 2, 0) for batch in rank for i in batch}
    trained = Counter(i for ids in epoch0 for i in ids)
    assert set(trained) == due, "every sample due in the interrupted epoch is trained on"
    before = Counter(i for ids in [b for e, b in rank0[:3] + rank1[:3] if e == 0] for i in ids)
    after = Counter(i for ids in [b for e, b in rank0[3:] if e == 0] for i in ids)
    assert not set(before) & set(after), "nothing trained before the kill is trained again"
    assert all(len(ids) == 2 for ids in epoch0)
    assert [ids for e, ids in rank0 if e == 1] == planned(cache, 1, 1)[0], "the next epoch is planned normally"
