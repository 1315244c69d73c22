"""The fixed draws of the validation flow loss: a grid of noise levels and one noise tensor per sample.

Random noise levels per validation batch make `val/loss` jump with the draw; here every validation run measures
the same noise levels with the same noise for each sample (contexts are given to the model as in training), so
two points of a curve, two runs or a run and its resume differ only by the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Evenly spread over (0, 1): the loss of flow models varies strongly with the noise level, so one mean over a
# fixed spread compares runs whatever timestep distribution or shift they train with.
DEFAULT_VAL_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)


def check_val_sigmas(sigmas: Sequence[float]) -> tuple[float, ...]:
    """The grid as a tuple; empty grids and levels outside (0, 1] are refused."""
    grid = tuple(float(s) for s in sigmas)
    if not grid or not all(0.0 < s <= 1.0 for s in grid):
        raise ValueError(f"val_sigmas: expected one or more noise levels in (0, 1], got {list(grid)}")
    return grid


def fixed_noise(shape: Sequence[int], sample_indices: Sequence[int], seed: int) -> torch.Tensor:
    """Noise `[B, *shape]` (float32, CPU): sample i's is drawn from a generator seeded by (`seed`, its cache index)."""
    rows = []
    for index in sample_indices:
        generator = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(index)) % (2**63 - 1))
        rows.append(torch.randn(tuple(shape), generator=generator, dtype=torch.float32))
    return torch.stack(rows)
