"""The baselines `image-edit-data bench --compare-naive` times ours against.

A plain `torch.utils.data.DataLoader` over a list of paths with one `torch.load(weights_only=True)`
(or safetensors `load_file`) per sample and a stacking collate, and a bare load loop with no
DataLoader at all. Both read the batches our sampler planned, so every loader reads the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from safetensors.torch import load_file
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from .measure import Run, load_average, plan_totals


def _naive_load(path: str) -> dict[str, Any]:
    """One payload the plain way: `torch.load(weights_only=True)`, or safetensors' `load_file`."""
    if path.endswith(".safetensors"):
        return load_file(path)
    loaded: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return loaded


class _NaiveDataset(Dataset):
    """What one writes without this package: a list of paths and one load per sample."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return _naive_load(self.paths[index])


def _stack_or_pad(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack equal shapes; zero-pad the first dimension (prompt length) when it differs."""
    if all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(list(tensors))
    return pad_sequence(list(tensors), batch_first=True)


def _stack_collate(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack every tensor field (and each position of a list of tensors); collect the rest as lists."""
    batch: dict[str, Any] = {}
    for key, value in samples[0].items():
        values = [sample[key] for sample in samples]
        if isinstance(value, torch.Tensor):
            batch[key] = _stack_or_pad(values)
        elif isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
            batch[key] = [_stack_or_pad(group) for group in zip(*values)]
        else:
            batch[key] = values
    return batch


def naive_loader(paths: list[str], plan: Iterable[list[int]], num_workers: int, prefetch_factor: int) -> DataLoader:
    """A plain DataLoader over the same files and batches: one load per sample, stacking collate."""
    return DataLoader(
        _NaiveDataset(paths),
        batch_sampler=list(plan),
        collate_fn=_stack_collate,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),  # as our loader does
        prefetch_factor=prefetch_factor if num_workers else None,
    )


def bare_loop(paths: Sequence[str], plan: Sequence[Sequence[int]], warmup: int, sizes: Mapping[int, int]) -> Run:
    """`_naive_load` of each planned sample in a plain loop: no DataLoader, no collate."""
    for batch in plan[:warmup]:
        for i in batch:
            _naive_load(paths[i])
    measured = plan[warmup:]
    load = load_average()
    cpu, start = time.process_time(), time.perf_counter()
    for batch in measured:
        for i in batch:
            _naive_load(paths[i])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Run(
        "bare", None, len(measured), *plan_totals(measured, sizes), seconds, load_average_1m=load, main_cpu_seconds=cpu
    )
