"""Dotted paths that moved in 0.2, still importable for one release with a `FutureWarning`.

YAML configs (`class_path: image_edit_data.examples.diffusers_edit.QwenImageEditModule`) and
checkpoints name classes by module path. An old path imports the module at its new place, so the
class is the same object either way; the warning names the new path to write instead.
TODO(moved-paths): remove after 0.2.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

# Old module path -> new one; a submodule of an old path moves with it.
MOVED = {
    "image_edit_data.build.run.build": "image_edit_data.preprocess.run.build_cache",
    "image_edit_data.build": "image_edit_data.preprocess",
    "image_edit_data.examples.model_blocks": "image_edit_data.models.reference_blocks",
    "image_edit_data.examples.model": "image_edit_data.models.reference",
    "image_edit_data.examples": "image_edit_data.models",
    "image_edit_data.loader": "image_edit_data.dataloader_config",
    "image_edit_data.loading.resumable": "image_edit_data.workers.resumable_loader",
    "image_edit_data.loading": "image_edit_data.workers",
    "image_edit_data.lightning.loader": "image_edit_data.lightning.loader_wrapper",
    "image_edit_data.mixture": "image_edit_data.mixture_dataset",
    "image_edit_data.sampling.mixture": "image_edit_data.sampling.mixture_draw",
}


def new_path(old: str) -> str | None:
    """Where module `old` lives now, or None when it did not move."""
    for before, after in MOVED.items():  # longer paths first, so the most specific move wins
        if old == before or old.startswith(before + "."):
            return after + old[len(before) :]
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (one module object under both names)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} has moved to {self.target}; the old path stops working after 0.2",
            FutureWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was imported at its new path."""


class MovedPathFinder(importlib.abc.MetaPathFinder):
    """Finds moved modules by their old path.

    First in `sys.meta_path`: a submodule of an old package path would otherwise be found by the
    path finder in the new package's folder and loaded a second time, as a module of its own.
    """

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        target_name = new_path(fullname)
        if target_name is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(target_name))


def install() -> None:
    """Let old paths import (once per process)."""
    if not any(isinstance(finder, MovedPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedPathFinder())
