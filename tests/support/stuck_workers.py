"""Datasets whose loader workers get stuck, for the worker-timeout tests (importable by worker processes)."""

from __future__ import annotations

import time
from typing import Any

from torch.utils.data import get_worker_info

from image_edit_data import ImageEditDataset
from image_edit_data.batch.collate import AssembledBatch

STUCK_SECONDS = 120.0  # longer than any test's timeout; the loader terminates the worker before that


class StuckInBatch(ImageEditDataset):
    """Worker `worker` hangs on the batch at plan step `step`, as a worker blocked on I/O or a lock would."""

    def __init__(self, cache_dir: str, worker: int, step: int) -> None:
        super().__init__(cache_dir)
        self.stuck_worker, self.stuck_step = worker, step

    def __getitems__(self, indices: list[int]) -> AssembledBatch:
        self.step_loading = getattr(indices, "step", None)
        return super().__getitems__(indices)

    def open_batch(self, indices: list[int]) -> Any:
        info = get_worker_info()
        if info is not None and info.id == self.stuck_worker and self.step_loading == self.stuck_step:
            time.sleep(STUCK_SECONDS)
        return super().open_batch(indices)


class StuckAtStartUp(ImageEditDataset):
    """Every worker hangs while it unpickles the dataset, before it can start, as one stuck after a fork would."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        time.sleep(STUCK_SECONDS)
        self.__dict__.update(state)


class ReadTimesOut(ImageEditDataset):
    """The batch at plan step `step` fails in its worker with an error of its own that mentions a timeout."""

    def __init__(self, cache_dir: str, step: int) -> None:
        super().__init__(cache_dir)
        self.failing_step = step

    def __getitems__(self, indices: list[int]) -> AssembledBatch:
        if get_worker_info() is not None and getattr(indices, "step", None) == self.failing_step:
            raise RuntimeError("s3://bucket/shard-0.tar: read timed out after 30 s")
        return super().__getitems__(indices)


class DiesAtStartUp(ImageEditDataset):
    """Every worker ends while it unpickles the dataset, as one that cannot import the main module would."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise AttributeError("Can't get attribute 'MyDataset' on <module '__mp_main__'>")
