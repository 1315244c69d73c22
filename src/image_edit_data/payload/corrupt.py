"""What happens when a payload turns out to be broken at train time: raise, or skip and keep count.

Skipping is deterministic (it depends only on the data), so a resumed run skips the same samples
and the data stream stays exact. A batch never comes out empty: when every sample of a batch is
bad, the bucket's next loadable sample takes its place, so every rank still gets its batch.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..contract.batch import SkippedSample
from ..errors import CacheFormatError

log = logging.getLogger(__name__)
CorruptPolicy = Literal["raise", "skip"]


class TooManyCorruptSamplesError(RuntimeError):
    """More samples were skipped than the configured fraction of the cache allows."""


@dataclass
class SkipLog:
    """Per-process record of skipped samples: warns once per sample and appends to a quarantine list."""

    policy: CorruptPolicy
    max_fraction: float
    dataset_size: int
    quarantine_file: Path | None
    skipped: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.policy not in ("raise", "skip"):
            raise ValueError(f"on_corrupt_sample must be 'raise' or 'skip', got {self.policy!r}")
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"max_corrupt_fraction must be in [0, 1], got {self.max_fraction!r}")

    def record(self, index: int, error: CacheFormatError) -> SkippedSample:
        """Note a skipped sample; raise once the skips pass the allowed share of the cache."""
        entry: SkippedSample = {"index": index, "file": error.file, "field": error.field, "reason": error.problem}
        if index not in self.skipped:
            self.skipped.add(index)
            log.warning("skipping corrupt sample %d: %s", index, error)
            self.quarantine(entry)
        allowed = self.max_fraction * self.dataset_size
        if len(self.skipped) > allowed:
            raise TooManyCorruptSamplesError(
                f"{len(self.skipped)} corrupt samples skipped, more than max_corrupt_fraction={self.max_fraction} "
                f"of {self.dataset_size} samples allows; last: {error}"
            ) from error
        return entry

    def quarantine(self, entry: SkippedSample) -> None:
        """Append one JSON line; small O_APPEND writes from several workers do not interleave."""
        if self.quarantine_file is None:
            return
        try:
            self.quarantine_file.parent.mkdir(parents=True, exist_ok=True)
            line = (json.dumps(entry) + "\n").encode()
            descriptor = os.open(self.quarantine_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(descriptor, line)
            finally:
                os.close(descriptor)
        except OSError as error:
            log.warning("could not write the quarantine list %s: %s", self.quarantine_file, error)
