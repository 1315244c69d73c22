"""The Lightning side: the DataModule, the loader Lightning leaves alone, the data monitor, LightningCLI.

The only subpackage that imports Lightning.
"""

from .cli import lightning_main
from .datamodule import ImageEditDataModule
from .loader_wrapper import LightningLoader
from .monitor import ImageEditDataMonitor

__all__ = ["ImageEditDataModule", "ImageEditDataMonitor", "LightningLoader", "lightning_main"]
