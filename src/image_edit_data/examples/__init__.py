"""Example LightningModules that train on the package's batches (not part of the data path).

`diffusers_edit`: diffusers' Qwen-Image and FLUX.1 Kontext transformers (needs the `build` extra's `diffusers`).
"""
