"""The public surface: root names, subpackage `__all__`s, Lightning loaded only on demand, config class paths."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from support import ROOT

import image_edit_data
from image_edit_data._moved import new_path

SUBPACKAGES = [
    "batch",
    "bench",
    "contract",
    "index",
    "lightning",
    "models",
    "payload",
    "preprocess",
    "sampling",
    "storage",
    "workers",
]
WITHOUT_LIGHTNING = [name for name in SUBPACKAGES if name not in ("models", "lightning")]


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


def test_configs_name_no_moved_path() -> None:
    for config in CONFIGS:
        for path in class_paths(yaml.safe_load(config.read_text())):
            assert new_path(path.rpartition(".")[0]) is None, f"{config.name}: {path} has moved"


@pytest.mark.slow  # a fresh interpreter imports every moved path
def test_every_moved_path_imports_the_module_at_its_new_place_with_a_future_warning() -> None:
    code = textwrap.dedent(
        """
        import importlib, sys, warnings
        import image_edit_data
        from image_edit_data._moved import MOVED, new_path
        for old, new in MOVED.items():
            for name in [name for name in sys.modules if new_path(name)]:
                del sys.modules[name]  # an old path warns at its first import in a process
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = importlib.import_module(old)
            assert module is importlib.import_module(new), old
            assert any(issubclass(w.category, FutureWarning) and new in str(w.message) for w in caught), old
        # a submodule of a moved package is the same module, not a second copy loaded from the new folder
        import image_edit_data.examples.diffusers_edit as old, image_edit_data.models.diffusers_edit as new
        assert old is new and old.QwenImageEditModule is new.QwenImageEditModule
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_no_room_of_the_package_is_named_like_build_output_throwaway_code_or_a_test_fixture() -> None:
    package = ROOT / "src" / "image_edit_data"
    names = {path.stem for path in package.rglob("*.py")} | {path.name for path in package.rglob("*") if path.is_dir()}
    assert not names & {"build", "dist", "examples", "s3_server", "fixtures", "conftest"}
    # pytest's default norecursedirs (which skips folders named build) holds: the project does not override it
    assert "norecursedirs" not in (ROOT / "pyproject.toml").read_text()
