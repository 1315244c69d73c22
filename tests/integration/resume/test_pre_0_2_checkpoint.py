"""A checkpoint written before the 0.2 moves (old module paths in its config and hyper-parameters) resumes after them.

`tests/data/pre_0_2/step=4.ckpt` was written by commit ee4b5e5 (`make.py` there says how): a
LightningCLI fit of the reference model, named `image_edit_data.examples.model.ImageEditFlowModel`,
on `tiny_cache(counts=(6, 5, 4))`, checkpointed after 4 of its 7 steps per epoch.
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from support import ROOT
from support.caches import tiny_cache
from support.fits import planned

from image_edit_data.lightning.cli import lightning_main
from image_edit_data.models import ImageEditFlowModel

FIXTURE = ROOT / "tests" / "data" / "pre_0_2"
CHECKPOINT = FIXTURE / "step=4.ckpt"
OLD_MODEL_PATH = "image_edit_data.examples.model.ImageEditFlowModel"


class RecordBatches(pl.Callback):
    """Appends each training batch's sample ids to a JSON-lines file."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        with self.out.open("a") as f:
            f.write(json.dumps(batch["metadata"]["sample_indices"]) + "\n")


def resume(tmp_path: Path, model_path: str) -> list[list[int]]:
    """Resume the fixture's fit from `step=4.ckpt` with the model named by `model_path`; the batches trained."""
    config = yaml.safe_load((FIXTURE / "config.yaml").read_text())
    config["model"]["class_path"] = model_path
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    record = tmp_path / "batches.jsonl"
    config["trainer"]["callbacks"].append(
        {"class_path": f"{__name__}.RecordBatches", "init_args": {"out": str(record)}}
    )
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    cache = tiny_cache(tmp_path / "cache", counts=(6, 5, 4))
    args = ["fit", "--config", str(tmp_path / "config.yaml"), "--data.cache_dir", str(cache)]
    lightning_main([*args, "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(CHECKPOINT)])
    return [json.loads(line) for line in record.read_text().splitlines()]


def forget_old_paths() -> None:
    """Drop old module names this process imported, so their next import warns again (it warns once per name)."""
    for name in [name for name in sys.modules if name.startswith("image_edit_data.examples")]:
        del sys.modules[name]


def expected_after_step_4(tmp_path: Path) -> list[list[int]]:
    cache = tiny_cache(tmp_path / "plan", counts=(6, 5, 4))
    return planned(cache, 1, 0)[0][4:] + planned(cache, 1, 1)[0]


def test_a_pre_0_2_checkpoint_and_config_resume_the_exact_stream_with_a_warning_naming_the_new_path(
    tmp_path: Path,
) -> None:
    forget_old_paths()
    with pytest.warns(FutureWarning, match=r"image_edit_data\.examples\.model has moved to image_edit_data\.models"):
        trained = resume(tmp_path, OLD_MODEL_PATH)
    assert trained == expected_after_step_4(tmp_path)


def test_a_pre_0_2_checkpoint_resumes_under_the_new_model_path(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the checkpoint's hyper-parameters still name the old path
        trained = resume(tmp_path, "image_edit_data.models.reference.ImageEditFlowModel")
    assert trained == expected_after_step_4(tmp_path)


def test_a_pre_0_2_checkpoint_loads_into_the_model_by_its_new_and_its_recorded_path() -> None:
    saved = torch.load(CHECKPOINT, map_location="cpu", weights_only=False)  # our own fixture, not untrusted data
    assert saved["hyper_parameters"]["_class_path"] == OLD_MODEL_PATH
    model = ImageEditFlowModel.load_from_checkpoint(CHECKPOINT, map_location="cpu")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved["state_dict"].items())
    # By the recorded path: Lightning instantiates only classes already imported, so a user imports it first.
    forget_old_paths()
    with pytest.warns(FutureWarning, match="has moved to"):
        importlib.import_module("image_edit_data.examples.model")
    assert type(pl.LightningModule.load_from_checkpoint(CHECKPOINT, map_location="cpu")) is ImageEditFlowModel
