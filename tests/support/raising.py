"""A dataset whose batch at one plan step raises a given error, for the error-type tests (importable by workers)."""

from __future__ import annotations

from image_edit_data import ImageEditDataset
from image_edit_data.batch.collate import AssembledBatch


class RaisesAtStep(ImageEditDataset):
    """Loading the batch at plan step `step` raises `error` (in a worker, when the loader has workers)."""

    def __init__(self, cache_dir: str, error: Exception, step: int = 1) -> None:
        super().__init__(cache_dir)
        self.error, self.failing_step = error, step

    def __getitems__(self, indices: list[int]) -> AssembledBatch:
        if getattr(indices, "step", None) == self.failing_step:
            raise self.error
        return super().__getitems__(indices)
