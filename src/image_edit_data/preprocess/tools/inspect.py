"""`cache inspect`: the bucket table (signature, count, share, latent tokens, text tokens) and plots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jsonargparse import Namespace
from rich.console import Console
from rich.table import Table

from ...contract.signature import Signature
from ...index.index import UNKNOWN, CacheIndex
from ...index.packed import CHECKSUM
from ...storage.location import CacheLocation
from ..console import labelled
from ..run.writer import token_count


@dataclass(frozen=True)
class BucketRow:
    """One bucket of a cache."""

    signature: Signature
    count: int
    share: float  # of all samples, 0..1
    latent_tokens: int  # target + contexts, per sample
    text_tokens: tuple[int, float, int] | None  # min, mean, max; None when the index does not say


def latent_tokens(signature: Signature, patch_size: int) -> int:
    """Image tokens of one sample: target plus every context."""
    return sum(token_count(h, w, patch_size) for _, h, w in (signature.target, *signature.contexts))


def patch_size_of(index: CacheIndex) -> int:
    """The token patch size the cache was built with (2, the reference's, if not recorded)."""
    config = index.manifest.get("preprocessing_config")
    value = config.get("token_patch_size") if isinstance(config, dict) else None
    return value if isinstance(value, int) and value > 0 else 2


def bucket_rows(index: CacheIndex, patch_size: int) -> list[BucketRow]:
    """Buckets in the index's order (cheapest first)."""
    total = max(len(index), 1)
    rows = []
    for signature, members in zip(index.signatures, index.bucket_members()):
        text = index.text_tokens[members]
        text = text[text != UNKNOWN]
        stats = (int(text.min()), float(text.mean()), int(text.max())) if text.size else None
        rows.append(
            BucketRow(signature, len(members), len(members) / total, latent_tokens(signature, patch_size), stats)
        )
    return rows


def render_table(index: CacheIndex, rows: list[BucketRow], patch_size: int) -> Table:
    """The rich table of `rows`."""
    table = Table(
        title=f"{index.root}: {len(index)} samples in {len(rows)} buckets (tokens: {patch_size}x{patch_size} "
        "latent patches)"
    )
    table.add_column("signature", no_wrap=True)
    for name in ("count", "share %", "image tokens", "text min", "text mean", "text max"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in rows:
        text = ["n/a"] * 3
        if row.text_tokens is not None:
            text = [str(row.text_tokens[0]), f"{row.text_tokens[1]:.1f}", str(row.text_tokens[2])]
        table.add_row(row.signature.describe(), str(row.count), f"{100 * row.share:.1f}", str(row.latent_tokens), *text)
    return table


def kinds_note(index: CacheIndex) -> str | None:
    """How many samples are text-to-image rows (no context) and how many carry an edit mask; None for neither."""
    sizes = index.bucket_sizes()
    kinds = (
        ("text-to-image (no context)", "contexts=[]", [not s.contexts for s in index.signatures]),
        ("with an edit mask (conditioning_tensors.edit_mask)", "/mask", [s.mask for s in index.signatures]),
    )
    notes = []
    for what, marked, chosen in kinds:
        buckets = [int(n) for n, has in zip(sizes, chosen) if has]
        if buckets:
            notes.append(f"{sum(buckets)} samples {what} in {len(buckets)} bucket(s) marked {marked}")
    return "; ".join(notes) or None


def require_plots(path: str) -> None:
    """Refuse `--histogram` before any work when matplotlib, the `plots` extra, does not import."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"--histogram {path}: the plot needs matplotlib, which the package's `plots` extra installs: "
            f'pip install "image-edit-data[plots]" ({error})'
        ) from None


def write_histogram(index: CacheIndex, rows: list[BucketRow], path: Path) -> None:
    """A PNG with samples per bucket, latent tokens per sample and text tokens per sample."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(14, 4.5 + 0.2 * len(rows)), layout="constrained")
    shapes, latent, text = figure.subplots(1, 3, width_ratios=(2, 1, 1))
    labels = [row.signature.describe() for row in rows]
    shapes.barh(range(len(rows)), [row.count for row in rows], color="tab:blue")
    shapes.set_yticks(range(len(rows)), labels, fontsize=7)
    shapes.invert_yaxis()
    shapes.set_xlabel("samples")
    shapes.set_title("samples per shape bucket")
    per_sample = np.repeat([row.latent_tokens for row in rows], [row.count for row in rows])
    latent.hist(per_sample, bins=min(50, max(1, len(rows))), color="tab:green")
    latent.set_xlabel("image tokens per sample (target + contexts)")
    latent.set_title("latent tokens")
    known = index.text_tokens[index.text_tokens != UNKNOWN]
    if known.size:
        text.hist(known, bins=min(50, max(1, len(np.unique(known)))), color="tab:orange")
    else:
        text.text(0.5, 0.5, "not recorded in the index", ha="center", va="center")
    text.set_xlabel("text tokens per sample")
    text.set_title("prompt tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure).print_png(str(path))


def inspect_main(args: Namespace, console: Console) -> int:
    """Run `cache inspect`: print the table, optionally write the PNG."""
    if args.histogram:
        require_plots(args.histogram)
    try:
        index, _ = CacheLocation.of(args.cache_dir, storage_options=args.storage_options).open(use_store=False)
    except (ValueError, OSError) as error:
        console.print(labelled("index unreadable:", "red", error))
        return 2
    patch_size = args.patch_size or patch_size_of(index)
    rows = bucket_rows(index, patch_size)
    console.print(render_table(index, rows, patch_size))
    note = kinds_note(index)
    if note is not None:
        console.print(note)
    if index.packed:  # the packed layout (index/packed.py): how the samples are stored
        total = sum(s.nbytes for s in index.shards)
        checksums = CHECKSUM if index.member_checksum is not None else "none (packed before them)"
        console.print(f"packed: {len(index.shards)} tar shard(s), {total} bytes, member checksums: {checksums}")
    if args.histogram:
        write_histogram(index, rows, Path(args.histogram))
        console.print(f"histogram written to {args.histogram}")
    return 0
