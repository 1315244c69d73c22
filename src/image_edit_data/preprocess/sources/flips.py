"""Mirrored copies of a data set's examples, as ai-toolkit's `flip_x` / `flip_y` add them (`toolkit/data_loader.py`).

ai-toolkit does not flip at random: after listing a data set's items it appends a horizontally mirrored
copy of each (`flip_x`), then a vertically mirrored copy of every item so far (`flip_y`), so both make four
items of one: the original, `flip_x`, `flip_y`, and `flip_x` + `flip_y`, in that order of blocks. A copy mirrors
its target and, unless the model takes its control images unresized, its controls too. Here each copy is a
sample of its own: id `<id>#flip_x` (`#flip_y`, `#flip_x#flip_y`), its flips in `manifest_metadata`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .base import BadSampleError
from .paired import Pairing


@dataclass(frozen=True)
class Flips:
    """Which mirrored copies a data set adds, and whether they mirror the controls."""

    flip_x: bool = False
    flip_y: bool = False
    flip_controls: bool = True

    def copies(self, pairings: Sequence[Pairing]) -> list[Pairing]:
        """The pairings, then their `flip_x` copies, then the `flip_y` copies of all of those."""
        items = list(pairings)
        for axis, wanted in (("x", self.flip_x), ("y", self.flip_y)):
            if wanted:
                items += [self._mirrored(p, axis) for p in items]
        return items

    def _mirrored(self, pairing: Pairing, axis: str) -> Pairing:
        where = f"{pairing.location} (flip_{axis} copy)"
        error = pairing.error
        if error is not None:
            error = BadSampleError(where, error.kind, error.problem)
        return dataclasses.replace(
            pairing,
            location=where,
            sample_id=f"{pairing.sample_id}#flip_{axis}",
            metadata={**pairing.metadata, f"flip_{axis}": True},
            error=error,
            flips=(*pairing.flips, axis),
            flip_contexts=self.flip_controls,
        )

    def to_json(self) -> dict[str, Any]:
        """Provenance: the flips asked for (nothing when none, as written before flips were read)."""
        if not (self.flip_x or self.flip_y):
            return {}
        return {
            "flips": [a for a, on in (("x", self.flip_x), ("y", self.flip_y)) if on],
            "flip_controls": self.flip_controls,
        }
