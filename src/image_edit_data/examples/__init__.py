"""Example LightningModules that train on the batch contract."""

from .model import ImageEditFlowModel

__all__ = ["ImageEditFlowModel"]
