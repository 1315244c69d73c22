"""Mixtures through Lightning: the DataModule and LightningCLI with `sources`, kill and resume, the monitor's shares.

The three sources are an edit cache, a text-to-image cache (no context images) and a cache of masked
edits, weighted 3:1:1 (issue 25's "done when"). In-process runs use the recording fit harness
(`support/fits.py`); the LightningCLI run reads the edit and text-to-image caches locally and the masked
one packed on the test S3 endpoint, with 2 loader workers. The multi-process runs (a DDP fit
hard-killed and resumed, and one resumed on fewer ranks) are slow-tier.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.fits import FitOptions, SimulatedKill, cli_fit_config, fit, records, run
from support.manifests import build, masked_manifest, text_to_image_manifest
from support.trainers import RecordingLogger, TinyModel, quiet_trainer

import image_edit_data.lightning.monitor as monitor_module
from image_edit_data import ImageEditDataloaderConfig, ImageEditDataModule, ImageEditDataset, ResumeMismatchError
from image_edit_data.__main__ import main
from image_edit_data.contract import EDIT_MASK
from image_edit_data.lightning.monitor import ImageEditDataMonitor
from image_edit_data.preprocess.cli import cache_main

pytestmark = pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
WEIGHTS = (3.0, 1.0, 1.0)
EXACT_SHARES = {"samples_per_epoch": 100, "drop_last": False}  # 60, 20, 20 draws, all trained on one rank


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Edits (18), text-to-image rows (5, repeated to reach their share) and masked edits (11, subsampled),
    all built with the same encoders so that they can share a mixture."""
    root = tmp_path_factory.mktemp("mixture")
    build(masked_manifest(root / "raw_edits", masked=(), rows=18), root / "edits")
    build(text_to_image_manifest(root / "raw_t2i", rows=5), root / "t2i", allow_no_context=True)
    build(masked_manifest(root / "raw_masked", masked=tuple(range(11)), rows=11), root / "masked")
    return [root / "edits", root / "t2i", root / "masked"]


def test_the_mixture_holds_an_edit_a_text_to_image_and_a_masked_cache(caches: list[Path]) -> None:
    edits, t2i, masked = (ImageEditDataset(c) for c in caches)
    assert (len(edits), len(t2i), len(masked)) == (18, 5, 11)
    assert all(edits[i]["context_latents"] and not edits[i]["conditioning_tensors"] for i in range(18))
    assert all(t2i[i]["context_latents"] == [] for i in range(5))
    assert all(EDIT_MASK in masked[i]["conditioning_tensors"] for i in range(11))


def sources_json(caches: list[Path], weights: tuple[float, ...] = WEIGHTS) -> str:
    return json.dumps([{"cache_dir": str(c), "weight": w} for c, w in zip(caches, weights)])


def planned(caches: list[Path], world: int, epochs: int, **options: Any) -> list[list[tuple[int, list[int]]]]:
    """Per rank, (epoch, ids) of each batch an uninterrupted fit trains on (batch size 2)."""
    config = ImageEditDataloaderConfig(sources=json.loads(sources_json(caches)), num_workers=0, **options)
    result = []
    for rank in range(world):
        sampler = config.build(dp_rank=rank, dp_world_size=world, batch_size=2).sampler
        batches = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            batches += [(epoch, list(b)) for b in sampler]
        result.append(batches)
    return result


@pytest.mark.parametrize("kill_at", [9, 0], ids=["mid-epoch", "epoch-boundary"])  # 0: the last step of epoch 0
def test_a_mixture_fit_killed_after_a_checkpoint_resumes_to_the_same_stream(
    caches: list[Path], tmp_path: Path, kill_at: int
) -> None:
    """Workers and a remote source: the LightningCLI test below."""
    options = FitOptions("-", str(tmp_path), epochs=2, in_process=True, sources=sources_json(caches))
    per_epoch = len(planned(caches, 1, 1)[0])
    kill_at = per_epoch if kill_at == 0 else kill_at
    with pytest.raises(SimulatedKill):
        fit(options | {"kill_at_step": kill_at})
    fit(options | {"ckpt": str(tmp_path / "ckpt" / f"step={kill_at}.ckpt")})
    assert records(tmp_path, 1) == planned(caches, 1, 2)


def test_a_fit_resumed_with_other_weights_is_refused_naming_the_source_unless_asked_to_restart(
    caches: list[Path], tmp_path: Path
) -> None:
    options = FitOptions("-", str(tmp_path), epochs=1, in_process=True, sources=sources_json(caches))
    with pytest.raises(SimulatedKill):
        fit(options | {"kill_at_step": 4})
    changed = options | {"sources": sources_json(caches, (3.0, 2.0, 1.0)), "ckpt": str(tmp_path / "ckpt/step=4.ckpt")}
    message = r"sources\[1\].weight \('t2i'\): checkpoint 1.0, now 2.0.*on_resume_mismatch='restart_epoch'"
    with pytest.raises(ResumeMismatchError, match=message):
        fit(changed)
    fit(changed | {"on_resume_mismatch": "restart_epoch"})
    restarted = records(tmp_path, 1)[0][4:]
    config = ImageEditDataloaderConfig(sources=json.loads(changed.sources or ""), num_workers=0)
    fresh = [(0, list(b)) for b in config.build(dp_rank=0, dp_world_size=1, batch_size=2).sampler]
    assert restarted == fresh[: len(fresh) - 4], "epoch 0 restarts; Lightning still counts the 4 batches it trained"


def test_the_monitor_reports_each_sources_samples_and_share_beside_its_target(
    caches: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    printed: list[str] = []
    monkeypatch.setattr(monitor_module, "rank_zero_info", printed.append)
    sources = [{"cache_dir": str(c), "weight": w, "name": n} for c, w, n in zip(caches, WEIGHTS, "abc")]
    data = ImageEditDataModule(sources=sources, batch_size=2, num_workers=0, samples_per_epoch=100, drop_last=False)
    logger, monitor = RecordingLogger(), ImageEditDataMonitor()
    quiet_trainer(monitor, tmp_path, logger, epochs=2).fit(TinyModel(), datamodule=data)
    assert monitor.source_targets == {"a": 0.6, "b": 0.2, "c": 0.2}
    for summary in monitor.epoch_summaries:
        assert [(s["name"], s["samples"], s["target"]) for s in summary["sources"]] == [
            ("a", 60, 0.6),
            ("b", 20, 0.2),
            ("c", 20, 0.2),
        ]
    epochs = logger.data_records({"data/epoch_source_share/a"})
    assert len(epochs) == 2
    for metrics in epochs:
        for name in "abc":
            share, target = metrics[f"data/epoch_source_share/{name}"], metrics[f"data/source_target_share/{name}"]
            assert abs(share - target) <= 0.01
        assert metrics["data/epoch_source_samples/a"] == 60
    steps = logger.data_records({"data/source_share/a"})
    assert len(steps) == 2 * monitor.epoch_summaries[0]["batches"]
    assert all(abs(sum(m[f"data/source_share/{n}"] for n in "abc") - 1.0) < 1e-9 for m in steps)
    assert re.search(r"\n\s+60\s+60.0%\s+60.0%\s+a\n\s+20\s+20.0%\s+20.0%\s+b", printed[0]), printed[0]


def test_demo_samples_writes_one_demo_cache_per_local_source(tmp_path: Path) -> None:
    sources = [{"cache_dir": str(tmp_path / "one")}, {"cache_dir": str(tmp_path / "two"), "weight": 2}]
    data = ImageEditDataModule(sources=sources, demo_samples=4, num_workers=0)
    data.prepare_data()
    data.setup("fit")
    dataset: Any = data.train_dataset
    assert dataset.sizes == (4, 4) and dataset.names == ["one", "two"]
    assert dataset.sources[0].index.fingerprint != dataset.sources[1].index.fingerprint, "each from its own seed"
    assert data.hparams["sources"][1] == {
        "cache_dir": str(tmp_path / "two"),
        "weight": 2,
        "name": None,
        "storage_options": None,
        "remote_read": None,
        "local_cache_dir": None,
        "require_checksums": None,
        "remote_requests": None,
    }


def cli_config(path: Path, out: Path, sources: list[dict[str, Any]], kill_at_step: int | None) -> Path:
    """A LightningCLI fit config: the recording model and the data monitor over a mixture, 2 workers."""
    data = {**EXACT_SHARES, "sources": sources, "batch_size": 2, "num_workers": 2}
    return cli_fit_config(path, out, data, kill_at_step, monitor=True)


def test_a_lightning_cli_fit_over_two_local_caches_and_a_masked_one_on_s3_resumes_to_the_same_stream(
    caches: list[Path], s3: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    staging = tmp_path / "staging"
    argv = ["pack", str(caches[2]), "s3://bucket/masked", "--shard-bytes", "8192", "--staging-dir", str(staging)]
    assert cache_main([*argv, "--storage-options", json.dumps(s3)]) == 0
    sources = [
        {"cache_dir": str(caches[0]), "weight": 3},
        {"cache_dir": str(caches[1]), "weight": 1},
        {
            "cache_dir": "s3://bucket/masked",
            "weight": 1,
            "storage_options": s3,
            "remote_read": "shard_cache",
            "local_cache_dir": str(tmp_path / "local"),
        },
    ]
    whole, resumed = tmp_path / "whole", tmp_path / "run"
    with caplog.at_level(logging.INFO):
        main(["fit", "--config", str(cli_config(tmp_path / "whole.yaml", whole, sources, None))])
    assert records(whole, 1) == planned(caches, 1, 2, **EXACT_SHARES), "the S3 copy plans and reads like the local"
    tables = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data epoch")]
    assert len(tables) == 2
    for table in tables:  # the S3 source is named by its URL's last part
        assert re.search(
            r"60\s+60.0%\s+60.0%\s+edits\n\s+20\s+20.0%\s+20.0%\s+t2i\n\s+20\s+20.0%\s+20.0%\s+masked", table
        )
    with pytest.raises(SimulatedKill):
        main(["fit", "--config", str(cli_config(tmp_path / "killed.yaml", resumed, sources, 13))])
    resume = cli_config(tmp_path / "resumed.yaml", resumed, sources, None)
    main(["fit", "--config", str(resume), "--ckpt_path", str(resumed / "ckpt" / "step=13.ckpt")])
    assert records(resumed, 1) == records(whole, 1)


@pytest.mark.slow
def test_a_hard_killed_ddp_mixture_fit_resumes_to_the_same_stream_and_its_monitor_counts_all_ranks(
    caches: list[Path], tmp_path: Path
) -> None:
    """Real processes: two ranks (the monitor reduces its counts across them) and a real kill."""
    common = ["--devices", "2", "--epochs", "2", "--sources", sources_json(caches)]
    killed = run(caches[0], tmp_path, *common, "--kill-at-step", "5")
    assert killed.returncode == 17, killed.stderr[-3000:]
    resumed = run(caches[0], tmp_path, *common, "--monitor", "--ckpt", str(tmp_path / "ckpt" / "step=5.ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    plan = planned(caches, 2, 2)
    assert records(tmp_path, 2) == plan
    offsets = [0, 18, 23, 34]  # the sources' first mixture ids
    due = Counter(
        next(s for s in range(3) if i < offsets[s + 1]) for rank in plan for e, ids in rank if e == 1 for i in ids
    )
    for rank in range(2):  # the epoch after the resume, counted over both ranks on each
        summary = json.loads((tmp_path / f"monitor.rank{rank}.json").read_text())[-1]
        assert summary["epoch"] == 1
        assert [s["samples"] for s in summary["sources"]] == [due[0], due[1], due[2]]


@pytest.mark.slow
def test_a_mixture_fit_killed_on_two_ranks_finishes_its_epoch_on_one_without_losing_a_draw(
    caches: list[Path], tmp_path: Path
) -> None:
    """The killed run is a real 2-rank DDP fit; the resume on one device runs in this process (one Lightning start
    less). The mixture's sampler is the one elastic resume needs most: its draws, not the sources' samples, must
    each be trained on once."""
    sources = sources_json(caches)
    two_ranks = ["--devices", "2", "--kill-at-step", "4", "--epochs", "2", "--elastic", "--sources", sources]
    killed = run(caches[0], tmp_path, *two_ranks)
    assert killed.returncode == 17, killed.stderr[-3000:]
    checkpoint = str(tmp_path / "ckpt" / "step=4.ckpt")
    one_rank = FitOptions(str(caches[0]), str(tmp_path), epochs=2, sources=sources, ckpt=checkpoint, in_process=True)
    with pytest.raises(ResumeMismatchError, match="world_size: checkpoint 2, now 1"):
        fit(one_rank | {"out": str(tmp_path / "refused")})  # without elastic=True, another number of ranks is refused
    fit(one_rank | {"elastic": True})
    rank0, rank1 = records(tmp_path, 2)
    due = Counter(i for rank in planned(caches, 2, 1) for epoch, ids in rank if epoch == 0 for i in ids)
    trained = Counter(i for epoch, ids in rank0 + rank1 if epoch == 0 for i in ids)
    assert set(trained) == set(due), "every sample due in the interrupted epoch is trained on, and no other"
    assert sum((due - trained).values()) <= 4 and sum((trained - due).values()) <= 4
    assert [(e, ids) for e, ids in rank0 if e == 1] == [(e, ids) for e, ids in planned(caches, 1, 2)[0] if e == 1]
