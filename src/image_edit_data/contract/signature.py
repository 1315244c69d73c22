"""Compound shape signatures (target + ordered contexts) and the bucket table built from them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

Shape3 = tuple[int, int, int]


@dataclass(frozen=True, order=True)
class Signature:
    """Latent shapes of a sample: the target and each context, in order. Batches share one."""

    target: Shape3
    contexts: tuple[Shape3, ...]

    def describe(self) -> str:
        """Human and dictionary key form, e.g. `target=16x128x128/contexts=[16x128x128]`."""
        contexts = ",".join("x".join(map(str, c)) for c in self.contexts)
        return f"target={'x'.join(map(str, self.target))}/contexts=[{contexts}]"

    def to_json(self) -> dict[str, Any]:
        """The contract's JSON form."""
        return {"target": list(self.target), "contexts": [list(c) for c in self.contexts]}

    @property
    def latent_area(self) -> int:
        """Latent positions over the target and all contexts (the cost of attention over images)."""
        return self.target[1] * self.target[2] + sum(c[1] * c[2] for c in self.contexts)

    def quantized_cells(self, quantization: int, latent_scale: int) -> int:
        """Pixel area of target + contexts in `quantization`-sized cells, each dimension rounded up."""
        return sum(
            math.ceil(h * latent_scale / quantization) * math.ceil(w * latent_scale / quantization)
            for _, h, w in (self.target, *self.contexts)
        )


def sort_key(sig: Signature) -> tuple[int, Shape3, tuple[Shape3, ...]]:
    """Bucket order: cheapest first, then by shapes, so bucket ids are stable for a given cache."""
    return (sig.latent_area, sig.target, sig.contexts)
