"""Print `image-edit-data bench` results: the machine and cache in a few lines, then two tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

LOADER_NAMES = {"ours": "ours (StatefulDataLoader)", "naive": "plain DataLoader", "bare": "bare load loop"}


def size(n: float | None) -> str:
    """Bytes in decimal units: `912.3 kB`, `3.3 MB`."""
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def seconds(s: float) -> str:
    """`12.3 ms` or `1.25 s`."""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def worker_memory(workers: list[dict[str, Any]]) -> str:
    """One line per worker: private memory at the start and end of the timed batches."""
    lines = []
    for w in workers:
        growth = w["uss_growth_bytes"]
        change = "n/a" if growth is None else ("+" if growth >= 0 else "-") + size(abs(growth))
        lines.append(f"{size(w['uss_start_bytes'])} -> {size(w['uss_end_bytes'])} ({change})")
    return "\n".join(lines) or "-"


def render(results: dict[str, Any], console: Console) -> None:
    """The whole report."""
    machine, cache, settings = results["machine"], results["cache"], results["settings"]
    console.print(
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs ({machine['cpus_usable']} usable), "
        f"{size(machine['memory_bytes'])} RAM, torch {machine['torch_version']} ({machine['torch_threads']} threads), "
        f"Python {machine['python_version']}, {machine['platform']}",
        highlight=False,
    )
    start, end = machine["load_average_1m"], machine["load_average_1m_end"]
    if start is not None and end is not None:
        console.print(f"load average (1 min): {start:.2f} at the start, {end:.2f} at the end", highlight=False)
    where = cache["path"] if cache.get("kept", True) else f"{cache['path']} (temporary, now removed)"
    synthetic = cache.get("synthetic")
    made = ""
    if synthetic:
        latent = "x".join(map(str, synthetic["latent"]))
        prompt = "x".join(map(str, synthetic["prompt"]))
        made = f"; synthetic: {1 + synthetic['contexts']} latents {latent}, prompt {prompt}, bf16"
    console.print(
        f"cache: {where}: {cache['samples']} samples, {cache['buckets']} bucket(s), "
        f"{'/'.join(cache['formats'])} payloads of {size(cache['mean_payload_bytes'])} on average{made}",
        highlight=False,
    )
    memcpy = results["memcpy"]
    copies = f"best of {memcpy['repeats']} copies of {size(memcpy['buffer_bytes'])}"
    console.print(
        f"memcpy limit: {memcpy['mb_s']:,.0f} MB/s ({copies}: numpy on 1 thread {memcpy['single_thread_mb_s']:,.0f} "
        f"MB/s, torch on {memcpy['torch_threads']} threads {memcpy['torch_mb_s']:,.0f} MB/s)",
        highlight=False,
    )
    console.print(index_table(results["index"]))
    console.print(loader_table(results["runs"], settings, cache))


def index_table(numbers: dict[str, Any]) -> Table:
    """Open times and memory of the index."""
    table = Table(title="Index", title_justify="left")
    for column in ("first open", "second open", "index arrays", "per sample", "RSS growth", "peak traced"):
        table.add_column(column, justify="right")
    table.add_row(
        seconds(numbers["open_first_s"]),
        seconds(numbers["open_second_s"]),
        size(numbers["nbytes"]),
        f"{numbers['bytes_per_sample']:.1f} B",
        size(numbers["rss_growth_bytes"]),
        size(numbers["peak_traced_bytes"]),
    )
    table.caption = "RSS growth: across the first open; peak traced: tracemalloc peak during a third open"
    table.caption_justify = "left"
    return table


def loader_table(runs: list[dict[str, Any]], settings: dict[str, Any], cache: dict[str, Any]) -> Table:
    """Throughput of every run, with ratios and worker memory."""
    batches = f"{settings['warmup']} warm-up + {settings['measured_batches']} timed batches"
    table = Table(
        title=f"Loaders: batch size {settings['batch_size']}, {batches} (of {cache['epoch_batches']} per epoch), "
        "the same batches for every loader",
        title_justify="left",
    )
    table.add_column("loader")
    for column in ("workers", "samples/s", "MB/s", "of memcpy", "ours/plain", "ours/bare"):
        table.add_column(column, justify="right")
    table.add_column("worker private memory (USS), start -> end of timed batches")
    for run in runs:
        workers = run["num_workers"]
        table.add_row(
            LOADER_NAMES[run["loader"]],
            "-" if workers is None else str(workers),
            f"{run['samples_s']:,.1f}",
            f"{run['mb_s']:,.1f}",
            f"{run['memcpy_fraction']:.1%}",
            ratio_text(run.get("ours_over_naive")),
            ratio_text(run.get("ours_over_bare")),
            worker_memory(run["workers"]),
        )
    table.caption = "MB/s: payload file bytes (10^6) per second; of memcpy: MB/s over the memcpy limit"
    table.caption_justify = "left"
    return table


def ratio_text(value: float | None) -> str:
    """`1.42x`, or `-` when not measured."""
    return "-" if value is None else f"{value:.2f}x"
