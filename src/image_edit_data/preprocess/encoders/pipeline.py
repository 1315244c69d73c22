"""Encoders that open a diffusers pipeline from a local directory and encode the way that pipeline does.

A pipeline family is one small subclass of `DiffusersPipelineEncoder` (see `preprocess/encoders/pipelines/`): the
pipeline class names it accepts, the components it needs, how its VAE latents are normalised
(`normalise`), and how a batch of prompts with their condition images is encoded (`encode_batch`),
normally through the pipeline's own `encode_prompt`. The transformer is never loaded; neither is
any component the family does not list. diffusers is imported inside the constructor, so the base
package works without the `build` extra, and nothing is downloaded (`local_files_only=True`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image

from .base import PromptEncoding
from .hf import DTYPES, TorchDtype

# Pipeline class name -> encoder class path, filled as family classes are defined.
PIPELINE_ENCODERS: dict[str, str] = {}
FAMILIES_MODULE = "image_edit_data.preprocess.encoders.pipelines"


def read_model_index(path: Path) -> dict[str, Any]:
    """The pipeline directory's model_index.json as a dict; errors name the file."""
    index_file = path / "model_index.json"
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: pipeline directory does not exist (give the local model directory as path)")
    if not index_file.is_file():
        raise FileNotFoundError(f"{index_file}: not found; path must be a diffusers pipeline directory")
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{index_file}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise ValueError(f"{index_file}: _class_name: expected the pipeline's class name, got none")
    return index


class DiffusersPipelineEncoder:
    """Base of the pipeline encoders: an image encoder and a prompt encoder backed by one pipeline."""

    pipeline_classes: ClassVar[tuple[str, ...]] = ()
    """Pipeline class names (model_index.json `_class_name`) this family encodes."""
    components: ClassVar[tuple[str, ...]] = ()
    """Components loaded from the directory; every other one (the transformer first) is passed as None."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.pipeline_classes:
            PIPELINE_ENCODERS.setdefault(name, f"{cls.__module__}.{cls.__qualname__}")

    def __init__(
        self,
        path: str,
        torch_dtype: TorchDtype = "bfloat16",
        device: str = "cpu",
        max_sequence_length: int | None = None,
    ) -> None:
        """
        Args:
            path: Local diffusers pipeline directory (model_index.json and one folder per component).
            torch_dtype: Dtype the VAE and text encoders run in; results are returned in float32.
            device: Where the models run, e.g. `cuda` (under torchrun the build selects the local GPU).
            max_sequence_length: The family's prompt length setting (see the subclass); None where it has no limit.
        """
        import diffusers
        from packaging.version import Version

        if max_sequence_length is not None and max_sequence_length < 1:
            raise ValueError(f"max_sequence_length: expected at least 1, got {max_sequence_length}")
        self.path = Path(path).expanduser()
        self.device = torch.device(device)
        self.dtype = DTYPES[torch_dtype]
        self.max_sequence_length = max_sequence_length
        index = read_model_index(self.path)
        class_name = index["_class_name"]
        if class_name not in self.pipeline_classes:
            raise ValueError(self._unsupported(class_name))
        self._check_components(index)
        self.check_environment(index)
        skipped = {name: None for name in index if not name.startswith("_") and name not in self.components}
        pipeline_class = getattr(diffusers, class_name, None)
        if pipeline_class is None:
            raise ValueError(
                f"{self.path / 'model_index.json'}: _class_name: diffusers {diffusers.__version__} has no "
                f"{class_name}; upgrade it (pip install -U diffusers)"
            )
        dtype_key = "dtype" if Version(diffusers.__version__) >= Version("0.40") else "torch_dtype"
        kwargs = {dtype_key: self.dtype, "local_files_only": True, **skipped}
        self.pipeline = pipeline_class.from_pretrained(self.path, **kwargs)
        for name in self.components:
            module = getattr(self.pipeline, name)
            if isinstance(module, torch.nn.Module):
                module.to(self.device).eval().requires_grad_(False)
        self.spatial_factor = int(self.pipeline.vae_scale_factor)

    def _unsupported(self, class_name: str) -> str:
        """Why this directory's pipeline class cannot be encoded by this class, and what can encode it."""
        importlib.import_module(FAMILIES_MODULE)  # defines every family, so the hint lists them all
        where = f"{self.path / 'model_index.json'}: _class_name"
        accepted = ", ".join(self.pipeline_classes)
        if class_name in PIPELINE_ENCODERS:
            hint = PIPELINE_ENCODERS[class_name]
            return f"{where}: {type(self).__name__} encodes {accepted}, got {class_name}; use {hint}"
        known = ", ".join(sorted(PIPELINE_ENCODERS))
        return (
            f"{where}: {class_name} is not supported; pipeline encoders exist for {known} "
            f"(add a family as a subclass of DiffusersPipelineEncoder, see preprocess/encoders/pipelines/)"
        )

    def _check_components(self, index: dict[str, Any]) -> None:
        """Refuse a directory that lacks a component this family needs, naming it."""
        needs = ", ".join(self.components)
        for name in self.components:
            entry = index.get(name)
            if not isinstance(entry, list) or len(entry) != 2 or entry[0] is None:
                raise ValueError(
                    f"{self.path / 'model_index.json'}: {name}: {type(self).__name__} needs the pipeline's {name} "
                    f"(it uses {needs}), but model_index.json lists {entry!r}"
                )
            if not (self.path / name).is_dir():
                raise FileNotFoundError(
                    f"{self.path / name}: the pipeline's {name} folder is missing ({type(self).__name__} uses {needs})"
                )

    def check_environment(self, index: dict[str, Any]) -> None:
        """Refuse early, with the fix, when a package the family's components need is missing."""

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images `[B, 3, H, W]` in `[-1, 1]` -> float32 latents `[B, C, H / f, W / f]` normalised like the pipeline."""
        vae = self.pipeline.vae
        return self.normalise(images.to(self.device, vae.dtype)).float().cpu()

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """Latent mode of `pixels` `[B, 3, H, W]` (VAE dtype), normalised by the family's rule: `[B, C, h, w]`."""
        raise NotImplementedError(f"{type(self).__name__}.normalise")

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]:
        """One `PromptEncoding` per prompt (float32 embeddings, int64 mask), on the CPU."""
        results = self.encode_batch(prompts, conditions)
        return [
            PromptEncoding(
                r.embeddings.float().cpu(),
                r.mask.to(torch.int64).cpu(),
                {name: t.float().cpu() if t.is_floating_point() else t.cpu() for name, t in r.conditioning.items()},
                r.truncations,
            )
            for r in results
        ]

    def encode_batch(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]:
        """The family's prompt encoding (any device and dtype)."""
        raise NotImplementedError(f"{type(self).__name__}.encode_batch")
