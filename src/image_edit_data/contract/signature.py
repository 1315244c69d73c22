"""Compound shape signatures (target + ordered contexts, and whether an edit mask comes along) and their order."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Shape3 = tuple[int, int, int]


@dataclass(frozen=True, order=True)
class Signature:
    """Latent shapes of a sample: the target and each context, in order (none for a text-to-image row), and
    whether it carries an `edit_mask`. Batches share one."""

    target: Shape3
    contexts: tuple[Shape3, ...]
    mask: bool = False  # the sample has conditioning_tensors["edit_mask"], so it never shares a batch with one without

    def describe(self) -> str:
        """Human and dictionary key form, e.g. `target=16x128x128/contexts=[16x128x128]`, `/mask` added if masked."""
        contexts = ",".join("x".join(map(str, c)) for c in self.contexts)
        described = f"target={'x'.join(map(str, self.target))}/contexts=[{contexts}]"
        return f"{described}/mask" if self.mask else described

    def to_json(self) -> dict[str, Any]:
        """The contract's JSON form; `"mask": true` only when masked, so unmasked caches keep their bytes."""
        data: dict[str, Any] = {"target": list(self.target), "contexts": [list(c) for c in self.contexts]}
        if self.mask:
            data["mask"] = True
        return data

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Signature:
        """The signature of a `to_json()` form already checked (the stored index's); `validate.signature` checks."""
        target = tuple(value["target"])
        contexts = tuple(tuple(c) for c in value["contexts"])
        return cls(target, contexts, bool(value.get("mask", False)))  # type: ignore[arg-type]

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


def sort_key(sig: Signature) -> tuple[int, Shape3, tuple[Shape3, ...], bool]:
    """Bucket order: cheapest first, then by shapes, unmasked before masked, so bucket ids are stable for a cache."""
    return (sig.latent_area, sig.target, sig.contexts, sig.mask)
