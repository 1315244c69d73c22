"""Loading batches: the resumable loader with one persistent, watched worker pool."""

from .resumable import ResumableDataLoader
from .watch import LoaderWorkerTimeoutError, WorkerWatch

__all__ = ["LoaderWorkerTimeoutError", "ResumableDataLoader", "WorkerWatch"]
