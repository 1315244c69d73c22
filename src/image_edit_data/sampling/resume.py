"""The one resume seam: what a loader's saved state holds, and how the consumed position reaches the sampler.

The sampler's position (`epoch`, `consumed`) is the whole resume state: our dataset and collate
keep none. The position moves when a batch reaches the consumer, never when a worker is handed
one, so the loader's state, the sampler's state and a Lightning checkpoint all say the same
thing at any moment. Loader states saved by torchdata (before the loader saved its own) still load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .sampler import BucketBatchSampler, ResumeMismatchError

LOADER_STATE_KEY = "image_edit_data_sampler"


def loader_state(sampler: BucketBatchSampler) -> dict[str, Any]:
    """What `ResumableDataLoader.state_dict()` returns: the sampler's consumed position, in a fresh dict."""
    return {LOADER_STATE_KEY: sampler.state_dict()}


def sampler_state_of(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The sampler's state inside a loader state: ours, or torchdata's (taken with or without workers)."""
    if not isinstance(state, Mapping):
        raise ResumeMismatchError(f"cannot resume: a loader state is a dict, got {type(state).__name__}")
    if LOADER_STATE_KEY in state:
        found = state[LOADER_STATE_KEY]
    elif "_snapshot" in state:  # torchdata, with workers: the snapshot taken as the last batch was handed out
        if state.get("_steps_since_snapshot", 0) != 0:
            raise ResumeMismatchError(
                "cannot resume: the loader state was saved between torchdata snapshots "
                f"({state['_steps_since_snapshot']} steps after one), so it does not say where the loader was; "
                "a loader built by ImageEditDataloaderConfig.build() saves its exact position at any time"
            )
        found = state["_snapshot"].get("_main_snapshot", {}).get("_index_sampler_state")
    else:  # torchdata, without workers
        found = state.get("_index_sampler_state")
    if found is None:
        raise ResumeMismatchError(
            "cannot resume: not the state_dict() of an image-edit-data loader (no sampler state in keys "
            f"{sorted(state)}); pass what built.dataloader.state_dict() returned"
        )
    return found  # type: ignore[no-any-return]


def note_consumed(sampler: BucketBatchSampler, batch: Mapping[str, Any]) -> None:
    """Move the sampler's position past `batch`, which its consumer now holds (position from its metadata)."""
    position = batch["metadata"].get("position")
    if position is not None:
        sampler.note_consumed(int(position[0]), int(position[1]))


def restore(sampler: BucketBatchSampler, state: Mapping[str, Any], restart_on_mismatch: bool) -> str | None:
    """Put `sampler` at a saved position; at an epoch's end, at the next epoch's start.

    A state that does not fit raises `ResumeMismatchError`, or with `restart_on_mismatch` starts the
    saved epoch afresh and returns why.
    """
    try:
        sampler.load_state_dict(state)
    except ResumeMismatchError as error:
        if not restart_on_mismatch:
            raise
        sampler.advance_epoch(int(state["epoch"]))
        return str(error)
    if sampler.epoch_finished:
        # Lightning moves on to the next epoch without a new iteration that would roll it over.
        sampler.advance_epoch(sampler.epoch + 1)
    return None
