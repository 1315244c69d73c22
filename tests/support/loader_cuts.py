"""Run the standalone loader to a cut point, save its state one way, resume it, and compare the streams."""

from __future__ import annotations

import io
from typing import Any

import torch

from image_edit_data import ImageEditDataloaderConfig

BATCH = 2


PREFETCH = 2


def ids(batch: dict[str, Any]) -> list[int]:
    return list(batch["metadata"]["sample_indices"])


def batches_before(cut: str, per_epoch: int) -> int:
    return {
        "after_1": 1,
        "inside_prefetch": 3,
        "past_prefetch": 5,
        "mid": per_epoch * 2 // 3,
        "one_before_end": per_epoch - 1,
    }.get(cut, per_epoch)


def as_checkpointed(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a checkpoint gives it back: saved with torch.save, read with weights_only."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


PATTERNS = ("loader", "sampler", "loader_then_sampler")


def run_until_cut(
    cfg: ImageEditDataloaderConfig,
    rank: int,
    world: int,
    epoch: int,
    cut: str,
    then_next_epoch: bool = False,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Train `epoch` up to `cut`, save the loader's and the sampler's state; returns (batches trained, states)."""
    built = cfg.build(dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    built.sampler.set_epoch(epoch)
    iterator = iter(built.dataloader)
    seen = [ids(next(iterator)) for _ in range(batches_before(cut, len(built.sampler)))]
    if cut == "loop_ended":
        seen.extend(ids(b) for b in iterator)  # the loop runs into StopIteration
        if then_next_epoch:
            built.sampler.set_epoch(epoch + 1)
    state = as_checkpointed({"loader": built.dataloader.state_dict(), "sampler": built.sampler.state_dict()})
    del iterator
    return seen, state


def restored_as(state: dict[str, Any], pattern: str) -> dict[str, Any]:
    """The saved objects `pattern` restores, in its order."""
    return {key: state[key] for key in pattern.split("_then_")}


def resume(
    cfg: ImageEditDataloaderConfig, rank: int, world: int, state: dict[str, Any], epochs: range, set_first: bool = False
) -> list[list[int]]:
    """A fresh loader restored from `state` (each saved object in the order saved), run through `epochs`."""
    built = cfg.build(dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    if set_first:
        built.sampler.set_epoch(epochs[0])
    for key, saved in state.items():
        (built.dataloader if key == "loader" else built.sampler).load_state_dict(saved)
    out = []
    for epoch in epochs:
        built.sampler.set_epoch(epoch)
        out.extend(ids(b) for b in built.dataloader)
    return out


def flat(epochs: tuple[list[list[int]], ...], first: int, last: int) -> list[list[int]]:
    return [batch for epoch in epochs[first : last + 1] for batch in epoch]
