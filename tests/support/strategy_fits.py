"""The strategy tests' recording model: per rank, the samples of each step and how the loader's workers started."""

from __future__ import annotations

import json
from pathlib import Path

from support.fits import RecordingModel


class WorkerRecordingModel(RecordingModel):
    """`RecordingModel` (sample ids per step, in OUT/rank{r}.jsonl) that also writes OUT/workers.rank{r}.json."""

    def on_train_epoch_end(self) -> None:
        loader = self.trainer.train_dataloader.loader  # type: ignore[union-attr]
        found = {"start": loader.worker_start, "num_workers": loader.num_workers}
        (Path(self.out) / f"workers.rank{self.global_rank}.json").write_text(json.dumps(found))
