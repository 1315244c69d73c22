"""Workers that receive the dataset pickled share the index's arrays instead of each holding a copy."""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import torch.multiprocessing  # noqa: F401  # registers torch's shared-memory pickling with ForkingPickler
from cachefactory import tiny_cache

from image_edit_data import ImageEditDataset


def test_the_index_pickles_for_workers_as_shared_memory_handles_and_reads_the_same(tmp_path: Path) -> None:
    dataset = ImageEditDataset(tiny_cache(tmp_path / "cache", counts=(400, 300)))
    arrays_bytes = dataset.index.nbytes
    before = [dataset.index.relative_path(i) for i in range(len(dataset))], dataset.index.bucket_ids.copy()
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(dataset)  # how a worker process receives it
    assert len(buffer.getvalue()) < arrays_bytes / 2  # handles to shared memory, not the arrays
    buffer.seek(0)
    copy = pickle.load(buffer)
    assert [copy.index.relative_path(i) for i in range(len(copy))] == before[0]
    assert np.array_equal(copy.index.bucket_ids, before[1]) and not copy.index.bucket_ids.flags.writeable
    assert copy[5]["metadata"] == dataset[5]["metadata"]
    again = pickle.loads(pickle.dumps(dataset))  # a plain pickle still carries the data itself
    assert [again.index.relative_path(i) for i in range(len(again))] == before[0]
