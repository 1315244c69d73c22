"""ImageEditDataModule inside real (in-process, CPU) Lightning runs."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import typing
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from jsonargparse import ArgumentParser, set_parsing_settings
from support.fits import RecordingModel

from image_edit_data import ImageEditDataloaderConfig, ImageEditDataModule, ResumeMismatchError
from image_edit_data.lightning.loader_wrapper import LightningLoader
from image_edit_data.sampling.sampler import BucketBatchSampler


def trainer(out: Path, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": out,
    }
    return pl.Trainer(**{**options, **kwargs})


def trained(out: Path) -> list[tuple[int, list[int]]]:
    lines = (out / "rank0.jsonl").read_text().splitlines()
    return [(line["epoch"], line["ids"]) for line in map(json.loads, lines)]


def data(cache: Path, **kwargs: Any) -> ImageEditDataModule:
    return ImageEditDataModule(cache_dir=str(cache), batch_size=2, num_workers=0, **kwargs)


def test_init_does_no_work_and_setup_is_idempotent(tmp_path: Path, cache: Path) -> None:
    module = ImageEditDataModule(cache_dir=str(tmp_path / "missing"))  # nothing is opened yet
    assert module.train_dataset is None
    module = data(cache)
    module.setup("fit")
    dataset = module.train_dataset
    module.setup("fit")
    assert module.train_dataset is dataset
    assert module.hparams["batch_size"] == 2 and module.hparams["cache_dir"] == str(cache)


def test_the_trainer_keeps_our_loader_and_sampler_with_default_flags(tmp_path: Path, cache: Path) -> None:
    module = data(cache)
    fit = trainer(tmp_path, max_epochs=1)
    fit.fit(RecordingModel(str(tmp_path)), datamodule=module)
    assert isinstance(fit.train_dataloader, LightningLoader)
    assert isinstance(fit.train_dataloader.batch_sampler, BucketBatchSampler)
    assert len(trained(tmp_path)) == 15


def test_fit_called_twice_continues_like_one_longer_fit(tmp_path: Path, cache: Path) -> None:
    one = tmp_path / "one"
    one.mkdir()
    trainer(one, max_epochs=2).fit(RecordingModel(str(one)), datamodule=data(cache))
    two = tmp_path / "two"
    two.mkdir()
    model, module = RecordingModel(str(two)), data(cache)
    first = trainer(two, max_epochs=1)
    first.fit(model, datamodule=module)
    first.fit_loop.max_epochs = 2
    first.fit(model, datamodule=module)
    assert trained(two) == trained(one)
    assert [e for e, _ in trained(one)] == [0] * 15 + [1] * 15


def test_limit_train_batches_ends_the_sampler_where_lightning_stops(tmp_path: Path, cache: Path) -> None:
    trainer(tmp_path, max_epochs=2, limit_train_batches=4).fit(RecordingModel(str(tmp_path)), datamodule=data(cache))
    full = tmp_path / "full"
    full.mkdir()
    trainer(full, max_epochs=2).fit(RecordingModel(str(full)), datamodule=data(cache))
    limited, unlimited = trained(tmp_path), trained(full)
    assert limited == unlimited[:4] + unlimited[15:19], "each epoch starts its own order, not the last one's tail"


def test_max_steps_mid_epoch_then_resume_continues_exactly(tmp_path: Path, cache: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    trainer(full, max_epochs=2).fit(RecordingModel(str(full)), datamodule=data(cache))
    part = tmp_path / "part"
    part.mkdir()
    every_7 = pl.callbacks.ModelCheckpoint(dirpath=part, filename="mid", every_n_train_steps=7)
    first = trainer(part, max_epochs=2, max_steps=7, enable_checkpointing=True, callbacks=[every_7])
    first.fit(RecordingModel(str(part)), datamodule=data(cache))
    trainer(part, max_epochs=2).fit(RecordingModel(str(part)), datamodule=data(cache), ckpt_path=part / "mid.ckpt")
    assert trained(part) == trained(full)


def checkpoint_at_step_5(out: Path, cache: Path) -> Path:
    """Train until a step-5 checkpoint (saved mid-epoch, as ModelCheckpoint does) and return its path."""
    every_5 = pl.callbacks.ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=5)
    fit = trainer(out, max_epochs=1, max_steps=5, enable_checkpointing=True, callbacks=[every_5])
    fit.fit(RecordingModel(str(out)), datamodule=data(cache))
    return out / "mid.ckpt"


def test_checkpoint_state_carries_position_and_fingerprint(tmp_path: Path, cache: Path) -> None:
    state = torch.load(checkpoint_at_step_5(tmp_path, cache), weights_only=False)["ImageEditDataModule"]
    assert (state["version"], state["epoch"], state["consumed"]) == (1, 0, 5)
    assert state["fingerprint"]["seed"] == 42 and state["fingerprint"]["world_size"] == 1
    assert len(state["fingerprint"]["data"]) == 16


def test_changed_config_is_refused_unless_a_reshuffle_is_asked_for(tmp_path: Path, cache: Path) -> None:
    ckpt = checkpoint_at_step_5(tmp_path, cache)
    changed = ImageEditDataModule(cache_dir=str(cache), batch_size=3, num_workers=0)
    with pytest.raises(ResumeMismatchError, match=r"batch_sizes: checkpoint \[2, 2, 2\], now \[3, 3, 3\]"):
        trainer(tmp_path, max_epochs=1).fit(RecordingModel(str(tmp_path)), datamodule=changed, ckpt_path=ckpt)
    again = tmp_path / "again"
    again.mkdir()
    reshuffled = ImageEditDataModule(
        cache_dir=str(cache), batch_size=3, num_workers=0, on_resume_mismatch="restart_epoch"
    )
    trainer(again, max_epochs=1).fit(RecordingModel(str(again)), datamodule=reshuffled, ckpt_path=ckpt)
    batches = trained(again)
    assert {e for e, _ in batches} == {0}
    assert all(len(ids) == 3 for _, ids in batches)
    assert len(batches) == 10 - 5, "epoch 0 restarts; Lightning still counts the 5 batches it trained"


class Evaluating(RecordingModel):
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        with (self.out / f"val{self.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(batch["metadata"]["sample_indices"]) + "\n")


def test_validation_sees_every_sample_once_in_a_fixed_order(tmp_path: Path, cache: Path) -> None:
    module = data(cache, val_cache_dir=str(cache))
    trainer(tmp_path, max_epochs=2, limit_train_batches=2).fit(Evaluating(str(tmp_path)), datamodule=module)
    runs = (tmp_path / "val0.jsonl").read_text().splitlines()
    ids = [i for line in runs for i in json.loads(line)]
    assert len(ids) == 66 and sorted(ids) == sorted(list(range(33)) * 2)
    assert ids[:33] == ids[33:], "validation order is the same every time"


def test_test_loader_defaults_to_the_training_cache(tmp_path: Path, cache: Path) -> None:
    module = data(cache)
    module.setup("test")
    loader = module.test_dataloader()
    assert sum(len(b["metadata"]["sample_indices"]) for b in loader) == 33
    assert torch.is_tensor(next(iter(loader))["image_latents"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_end_checkpoint_resumes_with_the_next_epochs_order(
    tmp_path: Path, cache: Path, num_workers: int
) -> None:
    full = tmp_path / "full"
    full.mkdir()
    trainer(full, max_epochs=3).fit(RecordingModel(str(full)), datamodule=data(cache))
    part = tmp_path / "part"
    part.mkdir()
    at_epoch_end = pl.callbacks.ModelCheckpoint(
        dirpath=part,
        filename="end{epoch}",
        auto_insert_metric_name=False,
        every_n_epochs=1,
        save_on_train_epoch_end=True,
        save_top_k=-1,
    )
    module = ImageEditDataModule(cache_dir=str(cache), batch_size=2, num_workers=num_workers)
    first = trainer(part, max_epochs=1, enable_checkpointing=True, callbacks=[at_epoch_end])
    first.fit(RecordingModel(str(part)), datamodule=module)
    resumed = ImageEditDataModule(cache_dir=str(cache), batch_size=2, num_workers=num_workers)
    trainer(part, max_epochs=3).fit(RecordingModel(str(part)), datamodule=resumed, ckpt_path=part / "end0.ckpt")
    assert trained(part) == trained(full)


def test_the_datamodule_data_options_are_the_loader_config_fields_with_their_types_and_defaults() -> None:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # as `image-edit-data fit` does
    parser = ArgumentParser()
    parser.add_class_arguments(ImageEditDataModule, "data")  # what LightningCLI reads
    options = {action.dest.removeprefix("data."): action for action in parser._actions}
    types = typing.get_type_hints(ImageEditDataloaderConfig)
    for field in dataclasses.fields(ImageEditDataloaderConfig):
        assert field.name in options, f"{field.name} cannot be set on the DataModule"
        action = options[field.name]
        assert action.default == (None if field.default is dataclasses.MISSING else field.default), field.name
        assert action._typehint == types[field.name], field.name
        assert action.help, f"{field.name} has no one-line doc in --help"


def test_every_config_field_is_settable_on_the_datamodule(tmp_path: Path) -> None:
    quarantine = str(tmp_path / "skipped.jsonl")
    module = ImageEditDataModule(cache_dir=str(tmp_path), quarantine_file=quarantine, base_resolution=[512, 256])
    assert module.config.quarantine_file == quarantine
    assert module.config.base_resolution == (512, 256)
    assert module.config.num_workers == ImageEditDataloaderConfig(cache_dir="x").num_workers
    saved = dict(module.hparams)  # what each checkpoint records: every option, defaults included
    module_options = {"batch_size": 4, "val_cache_dir": None, "on_resume_mismatch": "raise", "demo_samples": 0}
    assert saved == {**dataclasses.asdict(module.config), **module_options}
    with pytest.raises(TypeError, match="unknown_option"):
        ImageEditDataModule(cache_dir=str(tmp_path), unknown_option=1)


@pytest.mark.parametrize(("start", "forks"), [("forkserver", 0), ("fork", 2)])
def test_one_worker_pool_serves_every_pass_and_a_fork_free_start_never_forks_the_trainer(
    cache: Path, start: str, forks: int
) -> None:
    """Lightning ends a sized epoch without exhausting its pass; the next pass reuses the pool, forking nothing.

    A fork of the training process while its threads start or exit (a pool's queue threads, say) can
    leave the child stuck in CPython's after-fork handler: a pool per epoch made that a matter of
    time under DDP. With "forkserver" (the default) workers are never forked from this process at all.
    """
    built = ImageEditDataloaderConfig(cache_dir=str(cache), num_workers=2, multiprocessing_context=start).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    loader = LightningLoader(built.dataloader, built.sampler)
    recording: list[bool] = []
    forked_here: list[int] = []  # one entry per fork of this process while the test records
    workers_of_pass: list[set[int]] = []

    def before_fork() -> None:
        if recording:
            forked_here.append(1)

    os.register_at_fork(before=before_fork)  # cannot be unregistered: inert once `recording` is empty
    try:
        recording.append(True)
        for epoch in range(3):
            built.sampler.set_epoch(epoch)
            for step, _ in enumerate(loader):
                if step == 0:
                    workers_of_pass.append({p.pid for p in multiprocessing.active_children()})
                if step == 2:
                    break  # mid-pass, as Lightning leaves a sized epoch
        recording.clear()
        assert len(workers_of_pass[0]) == 2 and workers_of_pass == [workers_of_pass[0]] * 3
        assert len(forked_here) == forks
    finally:
        recording.clear()
        loader.close()
    assert not workers_of_pass[0] & {p.pid for p in multiprocessing.active_children()}  # close() stopped them


def test_a_loader_that_fails_to_build_leaves_lightning_unpatched_and_a_later_fit_runs(
    tmp_path: Path, cache: Path
) -> None:
    """Lightning 2.6 restores `DataLoader.__setattr__` only when its loader request returns.

    Our hooks never raise inside that request: the error comes at Lightning's first use of the loader.
    """
    from torch.utils.data import DataLoader

    broken = data(cache)
    broken.batch_size = 0  # a bad value that only the loader's build checks
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        trainer(tmp_path / "broken", max_epochs=1).fit(RecordingModel(str(tmp_path)), datamodule=broken)
    assert "__old__setattr__" not in DataLoader.__dict__ and "__old__init__" not in DataLoader.__dict__
    good = tmp_path / "good"
    good.mkdir()
    trainer(good, max_epochs=1).fit(RecordingModel(str(good)), datamodule=data(cache))
    assert len(trained(good)) == 15
