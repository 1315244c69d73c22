"""Example LightningModules that train on the package's batches (not part of the data path).

`diffusers_edit`: diffusers' Qwen-Image and FLUX.1 Kontext transformers (needs the `build` extra's `diffusers`).
`model`: `ImageEditFlowModel`, the small reference edit model (the quickstart's `model:`).
"""

from .reference import ImageEditFlowModel

__all__ = ["ImageEditFlowModel"]
