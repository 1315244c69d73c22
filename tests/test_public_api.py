"""The public surface: root names, subpackage `__all__`s, Lightning loaded only on demand, config class paths."""

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
    "build",
    "contract",
    "examples",
    "index",
    "lightning",
    "loading",
    "payload",
    "sampling",
    "storage",
]
WITHOUT_LIGHTNING = [name for name in SUBPACKAGES if name not in ("examples", "lightning")]


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


def class_paths(value: object) -> list[str]:
    """Every `class_path` in a parsed YAML document."""
    if isinstance(value, dict):
        found = [value["class_path"]] if isinstance(value.get("class_path"), str) else []
        return found + [path for v in value.values() for path in class_paths(v)]
    if isinstance(value, list):
        return [path for v in value for path in class_paths(v)]
    return []


CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: str(path.relative_to(ROOT / "configs")))
def test_configs_name_classes_by_their_current_paths(config: Path) -> None:
    paths = [path for path in class_paths(yaml.safe_load(config.read_text())) if path.startswith("image_edit_data.")]
    assert paths
    for path in paths:
        module, _, name = path.rpartition(".")
        assert getattr(importlib.import_module(module), name) is not None, f"{config.name}: {path}"
