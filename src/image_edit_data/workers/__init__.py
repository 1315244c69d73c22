"""The loader's worker pool: the resumable loader with one persistent pool, how workers start, and its watch."""

from .resumable_loader import ResumableDataLoader
from .watch import LoaderWorkerTimeoutError, WatchedDataset, WorkerWatch

__all__ = ["LoaderWorkerTimeoutError", "ResumableDataLoader", "WatchedDataset", "WorkerWatch"]
