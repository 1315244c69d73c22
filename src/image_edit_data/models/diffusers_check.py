"""A transformer's config, read without loading weights, and the cache checked against it before training."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from image_edit_data import ImageEditDataset


@dataclass(frozen=True)
class ExpectedInputs:
    """What a transformer needs of every sample, with where each number comes from in its config."""

    model: str  # the transformer class, for messages
    latent_channels: int
    latent_channels_source: str  # e.g. "in_channels 64 / 4 (2x2 packing)"
    text_width: int  # joint_attention_dim
    conditioning: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # name -> per-sample shape
    conditioning_source: Mapping[str, str] = field(default_factory=dict)  # name -> config field


def check_cache(dataset: ImageEditDataset, expected: ExpectedInputs) -> None:
    """Raise a ValueError naming the cache field and the model's value at the first mismatch.

    Latent shapes come from the index (every bucket); prompt width and conditioning tensors from the header of
    the first sample of each bucket, whose tensors are not read.
    """
    index = dataset.index
    members = index.bucket_members()
    for bucket, signature in enumerate(index.signatures):
        where = f"{index.root}: bucket {signature.describe()}"
        latents = [("compound_bucket_signature.target", signature.target)]
        latents += [(f"compound_bucket_signature.contexts[{k}]", c) for k, c in enumerate(signature.contexts)]
        for name, (channels, height, width) in latents:
            if channels != expected.latent_channels:
                raise ValueError(
                    f"{where}: {name} has {channels} latent channels, but {expected.model} expects "
                    f"{expected.latent_channels} ({expected.latent_channels_source})"
                )
            if height % 2 or width % 2:
                raise ValueError(
                    f"{where}: {name} is {height}x{width}, but {expected.model} packs 2x2 latent patches: "
                    "height and width must be even"
                )
        first = int(members[bucket][0])
        sample, payload = dataset.open_sample(first)
        try:
            check_sample(f"{index.root}/{index.relative_path(first)}", sample, expected)
        finally:
            payload.close()


def check_sample(where: str, sample: Mapping[str, object], expected: ExpectedInputs) -> None:
    """Check one opened sample's prompt width and conditioning tensors against the model."""
    width = int(sample["prompt_embeddings"].shape[-1])  # type: ignore[attr-defined]
    if width != expected.text_width:
        raise ValueError(
            f"{where}: prompt_embeddings width is {width}, but {expected.model} expects "
            f"{expected.text_width} (joint_attention_dim)"
        )
    conditioning: Mapping[str, object] = sample["conditioning_tensors"]  # type: ignore[assignment]
    for name, shape in expected.conditioning.items():
        source = expected.conditioning_source.get(name, "")
        if name not in conditioning:
            raise ValueError(
                f"{where}: conditioning_tensors has no {name!r} (it has {sorted(conditioning)}), but {expected.model} "
                f"needs it with shape {list(shape)} ({source})"
            )
        found = tuple(int(n) for n in conditioning[name].shape)  # type: ignore[attr-defined]
        if found != shape:
            raise ValueError(
                f"{where}: conditioning_tensors.{name} has shape {list(found)}, but {expected.model} expects "
                f"{list(shape)} ({source})"
            )


def model_directory(model_path: str) -> tuple[str, str | None]:
    """`(directory, subfolder)` for `from_pretrained`: a pipeline root's `transformer/` or the directory itself."""
    root = Path(model_path).expanduser()
    if not (root / "config.json").is_file() and (root / "transformer" / "config.json").is_file():
        return str(root), "transformer"
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"model_path {root}: no config.json here or in {root / 'transformer'}")
    return str(root), None


def resolve_config(cls: Any, model_path: str | None, model_config: dict[str, Any] | None) -> dict[str, Any]:
    """The transformer's full config: its constructor's defaults overlaid with the stored or given values."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    if model_path is not None:
        path, subfolder = model_directory(model_path)
        raw = cls.load_config(path, subfolder=subfolder, local_files_only=True)
    else:
        raw = dict(model_config or {})
    return defaults | {key: value for key, value in raw.items() if not key.startswith("_")}


def check_packing(model: str, config: dict[str, Any]) -> None:
    """Refuse a config whose tokens are not 2x2-packed latents (output width must equal input width)."""
    in_channels = config["in_channels"]
    out = config["patch_size"] ** 2 * (config.get("out_channels") or in_channels)
    if in_channels % 4 or out != in_channels:
        raise ValueError(
            f"{model}: expected 2x2-packed latent tokens (in_channels a multiple of 4, equal to "
            f"patch_size**2 * out_channels), got in_channels={in_channels}, output width {out}"
        )
