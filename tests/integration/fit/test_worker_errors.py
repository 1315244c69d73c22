"""Claim: an error of the package raised while loading reaches the training loop as that type, with its fields.

Real loader workers (`num_workers=2`) send their error through torch, which rebuilds it from its
type and its message in the training process; with `num_workers=0` it is raised there directly.
Both, in a bare loader and in a Lightning fit, for every public error type of the package (each
made with its file and field, and raised by a worker's batch): `except CacheFormatError` (or its
built-in base, `ValueError`) must catch it either way.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from support.caches import tiny_cache
from support.error_types import PUBLIC, example, kept_fields
from support.raising import RaisesAtStep
from support.trainers import TinyModel

from image_edit_data import ImageEditDataloaderConfig, ImageEditDataModule

WORKERS = [0, pytest.param(2, marks=pytest.mark.slow)]  # with workers: a pool per loader (real processes)
ERROR_IDS = [cls.__name__ for cls in PUBLIC]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("cache"), counts=(4, 4))


def check_caught(caught: BaseException, error: BaseException, workers: int) -> None:
    assert type(caught) is type(error), f"{type(caught).__name__}: {caught}"
    assert isinstance(caught, type(error).__mro__[1])  # the built-in base
    assert str(error) in str(caught)  # names the file and the field
    assert kept_fields(caught) == kept_fields(error)
    if workers:
        assert str(caught).startswith(f"Caught {type(error).__name__} in DataLoader worker process")


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("cls", PUBLIC, ids=ERROR_IDS)
def test_an_error_raised_while_loading_reaches_a_bare_loop_as_its_type(
    cache_dir: Path, cls: type[Exception], workers: int
) -> None:
    error = example(cls)
    config = ImageEditDataloaderConfig(cache_dir=str(cache_dir), num_workers=workers, shuffle=False)
    dataset = RaisesAtStep(str(cache_dir), error)
    built = config.build_for(dataset=dataset, dp_rank=0, dp_world_size=1, batch_size=2)
    with pytest.raises(cls, match=re.escape(str(error))) as caught:
        for _ in built.dataloader:
            pass
    built.dataloader.close()
    check_caught(caught.value, error, workers)


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("cls", PUBLIC, ids=ERROR_IDS)
def test_an_error_raised_while_loading_ends_a_fit_as_its_type(
    cache_dir: Path, tmp_path: Path, cls: type[Exception], workers: int
) -> None:
    error = example(cls)
    data = ImageEditDataModule(cache_dir=str(cache_dir), batch_size=2, num_workers=workers)
    data.train_dataset = RaisesAtStep(str(cache_dir), error)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(cls, match=re.escape(str(error))) as caught:
        trainer.fit(TinyModel(), datamodule=data)
    check_caught(caught.value, error, workers)
