"""Where the ranks of a torchrun build meet once each is done with its slice, so rank 0 merges as the last one ends.

Under a launcher that sets torch.distributed's environment (torchrun, or MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE set by hand) for the build's own rank and world size, every rank joins one gloo all-gather when
its slice is finished, or has failed, carrying its failure message if any. Rank 0 learns of the last rank's
end, or of any failure, when the gather completes: no file system look is needed, which matters when ranks
on other machines share the cache over a network file system that signals no change. Ranks started
without that environment meet through the journals instead (`merge.py`).
"""

from __future__ import annotations

import os
from datetime import timedelta


def launched_together(rank: int, world_size: int) -> bool:
    """Whether the environment is a launcher's for this very rank and world size (and more than one rank)."""
    env = os.environ
    return (
        world_size > 1
        and "MASTER_ADDR" in env
        and "MASTER_PORT" in env
        and env.get("RANK") == str(rank)
        and env.get("WORLD_SIZE") == str(world_size)
    )


def meet(rank: int, world_size: int, failure: str | None, timeout: float) -> dict[int, str] | None:
    """Every rank's failure message by rank, once all ranks have called this; None when not launched together.

    Uses the default process group when the caller made one (through a gloo group of its own, so an NCCL group
    needs no device here), else makes a gloo group for the meeting and ends it after.
    """
    if not launched_together(rank, world_size):
        return None
    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", timeout=wait)
    group = None if made else dist.new_group(backend="gloo", timeout=wait)
    try:
        messages: list[str | None] = [None] * world_size
        dist.all_gather_object(messages, failure, group=group)
    finally:
        if made:
            dist.destroy_process_group()
        elif group is not None:
            dist.destroy_process_group(group)
    return {r: message for r, message in enumerate(messages) if message is not None}
