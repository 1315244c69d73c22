"""The public surface: root names, subpackage `__all__`s, Lightning loaded only on demand, deprecated paths."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import image_edit_data

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = [
    "batch",
    "bench",
    "cache",
    "contract",
    "examples",
    "index",
    "lightning",
    "payload",
    "sampling",
    "storage",
]
WITHOUT_LIGHTNING = [name for name in SUBPACKAGES if name not in ("examples", "lightning")]
MOVED = [
    ("image_edit_data.model", "image_edit_data.examples.model", "ImageEditFlowModel"),
    ("image_edit_data.monitor", "image_edit_data.lightning.monitor", "ImageEditDataMonitor"),
    ("image_edit_data.datamodule", "image_edit_data.lightning.datamodule", "ImageEditDataModule"),
    ("image_edit_data.lightning_loader", "image_edit_data.lightning.loader", "LightningLoader"),
]


def test_every_public_name_imports_from_the_package_root() -> None:
    for name in image_edit_data.__all__:
        assert getattr(image_edit_data, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from image_edit_data import *", namespace)
    assert set(image_edit_data.__all__) <= set(namespace)


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_every_name_a_subpackage_exports_exists(subpackage: str) -> None:
    module = importlib.import_module(f"image_edit_data.{subpackage}")
    assert module.__all__, subpackage
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{subpackage}.{name}"


def test_the_data_path_and_the_help_text_load_without_lightning() -> None:
    code = textwrap.dedent(
        f"""
        import contextlib, importlib, io, sys
        from image_edit_data import ImageEditDataloaderConfig, ImageEditDataset, collate_image_edit
        for name in {WITHOUT_LIGHTNING!r}:
            importlib.import_module("image_edit_data." + name)
        import image_edit_data.bench.command
        from image_edit_data.__main__ import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["--help"]) == 0
        loaded = sorted(m for m in sys.modules if m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")))
        assert not loaded, loaded
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("old", "new", "name"), MOVED, ids=[old for old, _, _ in MOVED])
def test_a_moved_module_still_imports_from_its_old_path_with_a_deprecation_warning(
    monkeypatch: pytest.MonkeyPatch, old: str, new: str, name: str
) -> None:
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(FutureWarning, match=f"{old} is deprecated .* use {new}"):
        shim = importlib.import_module(old)
    assert getattr(shim, name) is getattr(importlib.import_module(new), name)


def class_paths(value: object) -> list[str]:
    """Every `class_path` in a parsed YAML document."""
    if isinstance(value, dict):
        found = [value["class_path"]] if isinstance(value.get("class_path"), str) else []
        return found + [path for v in value.values() for path in class_paths(v)]
    if isinstance(value, list):
        return [path for v in value for path in class_paths(v)]
    return []


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda path: path.name)
def test_configs_name_classes_by_their_current_paths(config: Path) -> None:
    paths = [path for path in class_paths(yaml.safe_load(config.read_text())) if path.startswith("image_edit_data.")]
    assert paths
    for path in paths:
        module, _, name = path.rpartition(".")
        assert module not in {old for old, _, _ in MOVED}, f"{config.name}: {path} is a deprecated path"
        assert getattr(importlib.import_module(module), name) is not None
