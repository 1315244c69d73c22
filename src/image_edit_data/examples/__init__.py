"""Example LightningModules that train on the package's batches (not part of the data path).

`model`: `ImageEditFlowModel`, the small reference edit model (the quickstart's `model:`).
"""

from .model import ImageEditFlowModel

__all__ = ["ImageEditFlowModel"]
