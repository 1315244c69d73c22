"""`cache validate`: load every payload through the dataset's own checks and report every bad one.

Loading a member of a packed cache checks it against its recorded checksum, as training does; a
packed cache written before member checksums gets a line saying so (not a failure).
Exit codes: 0 sound, 1 at least one bad sample, 2 the index itself cannot be opened.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from jsonargparse import Namespace
from rich.console import Console
from rich.text import Text

from ...contract.validate import CacheFormatError
from ...dataset import ImageEditDataset
from ...index.index import CacheIndex
from ...index.packed import CHECKSUM
from ..console import labelled
from .inspect import kinds_note


@dataclass(frozen=True)
class Problem:
    """One reason one sample is bad."""

    index: int
    file: str
    field: str
    reason: str


def nonfinite(tensor: torch.Tensor) -> str | None:
    """`N NaN and M Inf values` if the tensor has any, else None."""
    if not tensor.is_floating_point():
        return None
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    return f"{nan} NaN and {inf} Inf values" if nan or inf else None


def check_sample(dataset: ImageEditDataset, index: int, check_finite: bool) -> list[Problem]:
    """Every problem of sample `index` (the contract's first violation, or each non-finite tensor)."""
    file = dataset.index.relative_path(index)
    try:
        sample = dataset[index]
    except CacheFormatError as error:
        return [Problem(index, error.file, error.field, error.problem)]
    except Exception as error:  # a validator must report, not stop at, whatever a broken file raises
        return [Problem(index, file, "payload", f"{type(error).__name__}: {error}")]
    if not check_finite:
        return []
    tensors: list[tuple[str, Any]] = [("target_latent", sample["target_latent"])]
    tensors += [(f"context_latents[{i}]", c) for i, c in enumerate(sample["context_latents"])]
    tensors += [("prompt_embeddings", sample["prompt_embeddings"])]
    tensors += [(f"conditioning_tensors.{k}", v) for k, v in sample["conditioning_tensors"].items()]
    return [Problem(index, file, name, f"contains {bad}") for name, t in tensors if (bad := nonfinite(t))]


def check_cache(
    dataset: ImageEditDataset,
    check_finite: bool = False,
    workers: int = 8,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[Problem]:
    """Problems of every sample, in index order."""
    problems: list[Problem] = []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for done, found in enumerate(pool.map(lambda i: check_sample(dataset, i, check_finite), range(len(dataset)))):
            problems.extend(found)
            if on_progress is not None:
                on_progress(done + 1, len(dataset))
    return problems


def checksum_note(index: CacheIndex) -> str | None:
    """What `validate` says about a packed cache's member checksums (None for a one-file-per-sample cache)."""
    if not index.packed:
        return None
    if index.member_checksum is None:
        return (
            "member checksums: none (packed before they existed): members are checked only by their shards' "
            "SHA-256, here, not when training reads them; pack the cache again to add them"
        )
    return f"member checksums: {CHECKSUM}, checked on every read"


def validate_main(args: Namespace, console: Console) -> int:
    """Run `cache validate` and print the bad samples."""
    try:
        dataset = ImageEditDataset(args.cache_dir, storage_options=args.storage_options)
    except (ValueError, OSError) as error:
        console.print(labelled("index unreadable:", "red", error))
        return 2
    problems = check_cache(dataset, args.check_finite, args.workers)
    if dataset.index.packed:  # packed layout: sizes, hashes and tar headers too
        from .verify_shards import check_shards

        problems += [Problem(-1, p.file, p.field, p.reason) for p in check_shards(dataset.reader)]
    note = checksum_note(dataset.index)
    if note is not None:
        console.print(note)
    if not problems:
        finite = ", all values finite" if args.check_finite else ""
        kinds = kinds_note(dataset.index)  # masks are checked whatever the options: the contract reads their values
        also = "" if kinds is None else f" ({kinds})"
        sound = f"{len(dataset)} samples in {dataset.index.root} load and validate{finite}{also}"
        console.print(labelled("ok:", "green", sound))
        return 0
    bad = len({p.index for p in problems if p.index >= 0})
    shards = sum(p.index < 0 for p in problems)
    also = f" and {shards} shard problem(s)" if shards else ""
    bad_samples = f"{bad} of {len(dataset)} samples are bad"
    console.print(Text.assemble((bad_samples, "red"), f"{also} in {dataset.index.root}:"))
    for problem in problems:
        console.print(f"{problem.file}: {problem.field}: {problem.reason}")
    return 1
