"""`python -m benchmarks.remote_layouts CACHE`: packed and remote layouts against the local one-file cache.

The cache is packed locally and into an S3 endpoint (a moto server on 127.0.0.1 unless
`--s3-url` and `--storage-options` name a real one), then each layout trains through the same
loader: local files, local packed shards, S3 with one ranged request per sample, and S3 through the
local shard cache (with a shard-local shuffle, `--shard-window`, since whole shards are fetched).
Per layout: steady samples/s and MB/s after the first batch of a cold and of a warm epoch;
first-batch latency cold (fresh local cache, index included), warm (cache kept) and right after a
mid-epoch resume; and, with `--num-workers 0` (counters live in the loading process), requests and
bytes fetched per epoch against bytes used, plus the shard cache's high-water mark against its
budget. `--inject-latency-ms` repeats the S3 layouts with that delay before every request. Every
read of a packed member is checked against its XXH3-64 checksum; the bench also times that hash
alone over every member of the local packed cache (GB/s and microseconds per member).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jsonargparse import ArgumentParser
from rich.console import Console
from rich.table import Table

from image_edit_data.dataloader_config import ImageEditDataloaderConfig
from image_edit_data.index.packed import member_checksum
from image_edit_data.index.store import open_index


@dataclass
class LayoutResult:
    """One layout's numbers."""

    layout: str
    latency_ms: float
    samples_per_s: float
    mb_per_s: float
    warm_samples_per_s: float
    first_batch_cold_s: float
    first_batch_warm_s: float
    first_batch_resume_s: float
    requests: int | None
    bytes_fetched: int | None
    bytes_used: int | None
    high_water: int | None
    budget: int | None


def workers(args: Any) -> int:
    """The loader worker count to measure with (the first `--num-workers`, default 0)."""
    return int((args.num_workers or [0])[0])


def batch_bytes(batch: dict[str, Any]) -> int:
    """Bytes of the tensors a batch carries."""
    tensors = [batch["image_latents"], batch["text_embeddings"], batch["text_attention_mask"]]
    tensors += [*batch["context_latents"], *batch["conditioning_tensors"].values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Layout:
    """How to build a loader over one layout (fresh local state per cold start)."""

    def __init__(self, name: str, cache: str, options: dict[str, Any], latency: float, scratch: Path) -> None:
        self.name, self.cache, self.options, self.latency, self.scratch = name, cache, options, latency, scratch

    def config(self, workers: int, prefetch: int) -> ImageEditDataloaderConfig:
        return ImageEditDataloaderConfig(self.cache, num_workers=workers, prefetch_factor=prefetch, **self.options)

    def build(self, workers: int, prefetch: int, batch_size: int) -> Any:
        built = self.config(workers, prefetch).build(dp_rank=0, dp_world_size=1, batch_size=batch_size)
        store = built.dataloader.dataset.reader.store
        if store is not None:
            store.latency = self.latency
        return built


def first_batch(layout: Layout, args: Any, resume_at: int | None = None) -> tuple[float, Any, Iterator[Any]]:
    """Seconds from building the loader to its first batch; the build and the running iterator."""
    start = time.perf_counter()
    built = layout.build(workers(args), args.prefetch_factor, args.batch_size)
    if resume_at is not None:
        state = built.sampler.state_dict()
        state["consumed"] = resume_at
        built.sampler.load_state_dict(state)
    iterator = iter(built.dataloader)
    next(iterator)
    return time.perf_counter() - start, built, iterator


def close(built: Any) -> None:
    built.dataloader.close()


def drain(iterator: Iterator[Any], steps: int) -> tuple[int, int, float]:
    """Samples and tensor bytes of the next `steps` batches, and the seconds they took."""
    samples = nbytes = 0
    start = time.perf_counter()
    for _, batch in zip(range(steps), iterator):
        samples += int(batch["metadata"]["batch_size"])
        nbytes += batch_bytes(batch)
    return samples, nbytes, time.perf_counter() - start


def measure(layout: Layout, args: Any) -> LayoutResult:
    """A cold epoch (timed after its first batch), a warm one, then a warm start and a mid-epoch resume."""
    cold, built, iterator = first_batch(layout, args)
    steps = min(len(built.sampler) - 1, args.batches)
    samples, nbytes, elapsed = drain(iterator, steps)
    reader = built.dataloader.dataset.reader
    store, cache = reader.store, reader.shard_cache
    counted = workers(args) == 0 and store is not None
    index = built.dataloader.dataset.index
    used = None
    if counted and index.packed:
        plan = built.sampler.plan()
        used = int(index.member_length[plan.step_samples(slice(0, steps + 1))].sum())
    close(built)
    warm, built, iterator = first_batch(layout, args)
    warm_samples, _, warm_elapsed = drain(iterator, steps)
    close(built)
    resume, built, _ = first_batch(layout, args, resume_at=len(built.sampler) // 2)
    close(built)
    return LayoutResult(
        layout=layout.name,
        latency_ms=layout.latency * 1000,
        samples_per_s=samples / elapsed,
        mb_per_s=nbytes / elapsed / 1e6,
        warm_samples_per_s=warm_samples / warm_elapsed,
        first_batch_cold_s=cold,
        first_batch_warm_s=warm,
        first_batch_resume_s=resume,
        requests=store.stats.requests if counted and store is not None else None,
        bytes_fetched=store.stats.bytes_fetched if counted and store is not None else None,
        bytes_used=used,
        high_water=cache.high_water if cache is not None else None,
        budget=cache.budget if cache is not None else None,
    )


def checksum_cost(packed: Path) -> dict[str, float]:
    """Hash every member of a local packed cache, timing the hash alone: XXH3-64 (what reads check) and SHA-256."""
    index = open_index(packed)
    assert index.member_shard is not None
    timings = {"xxh3_64": 0.0, "sha256": 0.0}
    loaded, data, nbytes = -1, b"", 0
    for i in np.argsort(index.member_shard, kind="stable"):  # shard by shard, one in memory at a time
        number, offset, length = index.member(int(i))
        if number != loaded:
            loaded, data = number, (packed / index.shards[number].path).read_bytes()
        view = memoryview(data)[offset : offset + length]
        start = time.perf_counter()
        member_checksum(view)
        middle = time.perf_counter()
        hashlib.sha256(view).digest()
        timings["xxh3_64"] += middle - start
        timings["sha256"] += time.perf_counter() - middle
        nbytes += length
    members = max(len(index), 1)
    return {
        "gb_per_s": nbytes / max(timings["xxh3_64"], 1e-9) / 1e9,
        "us_per_member": timings["xxh3_64"] / members * 1e6,
        "sha256_gb_per_s": nbytes / max(timings["sha256"], 1e-9) / 1e9,
    }


@contextlib.contextmanager
def endpoint(args: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """The S3 prefix to pack into and its storage options (a local moto server unless one is given)."""
    if args.s3_url:
        yield args.s3_url.rstrip("/"), dict(args.storage_options or {})
        return
    from support.local_s3 import make_bucket, moto_server

    with moto_server() as options:
        make_bucket(options, "bench")
        yield "s3://bench/packed", options


def remote_bench(cache_dir: Path, args: Any, console: Console) -> dict[str, Any]:
    """Pack `cache_dir` locally and into S3, measure every layout, print the table; the numbers as a dict."""
    from image_edit_data.preprocess.tools.pack import pack_cache

    scratch = Path(tempfile.mkdtemp(prefix="image-edit-remote-bench-"))
    try:
        with endpoint(args) as (url, options):
            packed = scratch / "packed"
            pack_cache(cache_dir, str(packed), args.shard_bytes)
            pack_cache(cache_dir, url, args.shard_bytes, storage_options=options, staging_dir=str(scratch / "staging"))
            budget = args.shard_cache_bytes or 4 * args.shard_bytes
            cost = checksum_cost(packed)
            results = [
                measure(Layout("local files", str(cache_dir), {}, 0.0, scratch), args),
                measure(Layout("local packed", str(packed), {}, 0.0, scratch), args),
            ]
            for latency in args.inject_latency_ms:
                for mode in ("range", "shard_cache"):
                    local = scratch / f"local-{mode}-{latency}"
                    common = {"storage_options": options, "remote_read": mode, "local_cache_dir": str(local)}
                    common["shard_cache_bytes"] = budget
                    common["shard_window"] = args.shard_window
                    results.append(measure(Layout(f"s3 {mode}", url, common, latency / 1000, scratch), args))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    console.print(render(results))
    console.print(
        f"member checksums (xxh3_64, checked on every packed read): {cost['gb_per_s']:.1f} GB/s, "
        f"{cost['us_per_member']:.1f} us per member (hashing alone; sha256: {cost['sha256_gb_per_s']:.2f} GB/s)",
        highlight=False,
    )
    return {
        "remote": [asdict(r) for r in results],
        "shard_bytes": args.shard_bytes,
        "workers": workers(args),
        "checksum": cost,
    }


def render(results: list[LayoutResult]) -> Table:
    """The results as a table."""
    table = Table(title="layouts (first batch: seconds from building the loader)")
    columns: tuple[str, ...] = ("layout", "latency ms", "samples/s", "MB/s", "warm samples/s", "cold s", "warm s")
    columns += ("resume s", "requests")
    for name in (*columns, "fetched / used", "high water / budget"):
        table.add_column(name, justify="right" if name != "layout" else "left")
    for r in results:
        ratio = f"{r.bytes_fetched / r.bytes_used:.2f}" if r.bytes_fetched is not None and r.bytes_used else "n/a"
        water = f"{(r.high_water or 0) / 2**20:.0f} / {r.budget / 2**20:.0f} MiB" if r.budget else "n/a"
        table.add_row(
            r.layout,
            f"{r.latency_ms:.0f}",
            f"{r.samples_per_s:.1f}",
            f"{r.mb_per_s:.0f}",
            f"{r.warm_samples_per_s:.1f}",
            f"{r.first_batch_cold_s:.3f}",
            f"{r.first_batch_warm_s:.3f}",
            f"{r.first_batch_resume_s:.3f}",
            str(r.requests) if r.requests is not None else "n/a",
            ratio,
            water,
        )
    return table


def dumps(results: dict[str, Any]) -> str:
    """The numbers as JSON."""
    return json.dumps(results, indent=2) + "\n"


def _parser() -> ArgumentParser:
    """Options of `python -m benchmarks.remote_layouts`."""
    parser = ArgumentParser(
        prog="python -m benchmarks.remote_layouts",
        description="Compare local packed shards, S3 ranged reads and S3 shard caching with a one-file cache.",
    )
    parser.add_argument("cache_dir", type=str, help="A one-file-per-sample cache to pack and measure.")
    parser.add_argument("--batch-size", type=int, default=4, help="Samples per batch.")
    parser.add_argument("--num-workers", type=int, nargs="+", default=[0], help="Loader workers (the first is used).")
    parser.add_argument("--batches", type=int, default=200, help="Batches timed per layout (at most one epoch).")
    parser.add_argument("--prefetch-factor", type=int, default=2, help="Batches each worker loads ahead.")
    parser.add_argument("--shard-bytes", type=int, default=64 << 20, help="Shard size to pack.")
    parser.add_argument("--shard-cache-bytes", type=int | None, default=None, help="Shard cache budget (4 shards).")
    parser.add_argument("--inject-latency-ms", type=float, nargs="+", default=[0.0], help="Delay per S3 request.")
    parser.add_argument("--shard-window", type=int, default=2, help="Shuffle window of the shard cache.")
    parser.add_argument("--s3-url", type=str | None, default=None, help="An S3 prefix to pack into (default: moto).")
    parser.add_argument("--storage-options", type=dict[str, Any] | None, default=None, help="fsspec options as JSON.")
    parser.add_argument("--json", type=str | None, default=None, help="Also write every number to this file.")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the comparison, print the table (and write `--json`)."""
    args = _parser().parse_args(argv)
    numbers = remote_bench(Path(args.cache_dir), args, Console(soft_wrap=True, width=160))
    if args.json:
        Path(args.json).write_text(dumps(numbers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
