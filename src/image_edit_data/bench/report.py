"""Print `image-edit-data bench` results: the machine and cache in a few lines, then a table per measurement."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

LOADER_NAMES = {"ours": "ours (StatefulDataLoader)", "naive": "plain DataLoader", "bare": "bare load loop"}
OPEN_NAMES = {"parse": "first open (parse)", "stored": "re-open (stored index)"}


def size(n: float | None) -> str:
    """Bytes in decimal units: `912.3 kB`, `3.3 MB`."""
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _signed_size(n: float | None) -> str:
    """`+1.2 MB`, `-300 kB`."""
    return "n/a" if n is None else ("+" if n >= 0 else "-") + size(abs(n))


def seconds(s: float) -> str:
    """`12.3 ms` or `1.25 s`."""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _ratio_text(value: float | None, digits: int = 2) -> str:
    """`1.42x`, or `-` when not measured."""
    return "-" if value is None else f"{value:.{digits}f}x"


def _cpu_text(total: float | None, main: float | None, workers: int | None) -> str:
    """`1.23`, or with workers `2.40 (0.31)`: CPU ms per sample in all, and the training process's share."""
    if total is None:
        return "-" if main is None else f"{main:.2f} + ?"
    return f"{total:.2f}" if not workers else f"{total:.2f} ({main:.2f})"


def _load_text(value: float | None) -> str:
    """A load average, or `-`."""
    return "-" if value is None else f"{value:.2f}"


def worker_memory(workers: list[dict[str, Any]], highest: bool = False) -> str:
    """One line per worker: private memory at the start and end (and the highest seen), and the growth."""
    lines = []
    for w in workers:
        peak = f", max {size(w.get('uss_max_bytes'))}" if highest else ""
        change = _signed_size(w["uss_growth_bytes"])
        lines.append(f"{size(w['uss_start_bytes'])} -> {size(w['uss_end_bytes'])} ({change}{peak})")
    return "\n".join(lines) or "-"


def render(results: dict[str, Any], console: Console) -> None:
    """The whole report."""
    machine, cache = results["machine"], results["cache"]
    console.print(
        f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs ({machine['cpus_usable']} usable), "
        f"{size(machine['memory_bytes'])} RAM, torch {machine['torch_version']} "
        f"(torch.get_num_threads() = {machine['torch_threads']}), "
        f"Python {machine['python_version']}, {machine['platform']}",
        highlight=False,
    )
    start, end = machine["load_average_1m"], machine.get("load_average_1m_end")
    if start is not None and end is not None:
        console.print(f"load average (1 min): {start:.2f} at the start, {end:.2f} at the end", highlight=False)
    if results["other"]:
        about = ", ".join(f"{key} {value}" for key, value in results["other"].items() if key != "name")
        console.print(f"other loader: {results['other']['name']}" + (f" ({about})" if about else ""), highlight=False)
    console.print(_cache_line(cache), highlight=False)
    memcpy = results["memcpy"]
    if memcpy:
        copies = f"best of {memcpy['repeats']} copies of {size(memcpy['buffer_bytes'])}"
        console.print(
            f"memcpy limit: {memcpy['mb_s']:,.0f} MB/s ({copies}: numpy on 1 thread "
            f"{memcpy['single_thread_mb_s']:,.0f} MB/s, torch on {memcpy['torch_threads']} threads "
            f"{memcpy['torch_mb_s']:,.0f} MB/s)",
            highlight=False,
        )
    if results.get("page_cache"):
        reads = results["page_cache"]
        console.print(
            f"page-cache read rate: {reads['mb_s']:,.0f} MB/s (one preadv per payload of the {reads['files']:,} "
            f"planned, into one reused buffer, one thread; best of {reads['repeats']} passes)",
            highlight=False,
        )
    if results["index"]:
        console.print(_index_table(results["index"]))
    if results["runs"]:
        console.print(_loader_table(results["runs"], results["settings"], cache))
    if results["epochs"]:
        console.print(_epoch_table(results["epochs"], results["settings"], cache))


def _cache_line(cache: dict[str, Any]) -> str:
    """Where the cache is and what it holds."""
    where = cache["path"] if cache.get("kept", True) else f"{cache['path']} (temporary, now removed)"
    line = f"cache: {where}: {cache['samples']:,} samples, {cache['buckets']} bucket(s)"
    if "formats" in cache:
        line += f", {'/'.join(cache['formats'])} payloads of {size(cache['mean_payload_bytes'])} on average"
    synthetic = cache.get("synthetic")
    if synthetic and "formats" in cache:
        latent = "x".join(map(str, synthetic["latent"]))
        prompt = "x".join(map(str, synthetic["prompt"]))
        line += f"; synthetic: {1 + synthetic['contexts']} latents {latent}, prompt {prompt}, bf16"
    return line


def _index_table(rows: list[dict[str, Any]]) -> Table:
    """Open times and memory of the index, ours and the other loader's."""
    other = any(row["seconds_over_other"] is not None for row in rows)
    table = Table(title="Index open (each in a fresh child process)", title_justify="left")
    table.add_column("loader")
    table.add_column("open")
    for column in ("time", *(["ours/other"] if other else []), "RSS growth", "traced held", "held/sample"):
        table.add_column(column, justify="right")
    for column in ("traced peak", "index arrays"):
        table.add_column(column, justify="right")
    table.add_column("load")
    for row in rows:
        ours = row["loader"] == "ours"
        how = OPEN_NAMES[row["open"]] if ours else "open (parse)"
        if row["open"] == "stored" and not row["from_store"]:
            how += " [no stored index found: parsed]"
        ratio = [_ratio_text(row["seconds_over_other"], 3) if ours else "-"] if other else []
        table.add_row(
            LOADER_NAMES.get(row["loader"], row["loader"]),
            how,
            seconds(row["seconds"]),
            *ratio,
            _signed_size(row["rss_growth_bytes"]),
            size(row["traced_retained_bytes"]),
            f"{row['retained_bytes_per_sample']:,.1f} B",
            size(row["traced_peak_bytes"]),
            size(row["index_array_bytes"]) if row["index_array_bytes"] is not None else "-",
            _load_text(row["load_average_1m"]),
        )
    table.caption = (
        "time and RSS growth: one open, the opened dataset kept; traced held/peak: tracemalloc over a second open, "
        "bytes still held by the opened dataset and the peak while opening"
        + ("; ours/other: time over the other loader's time" if other else "")
    )
    table.caption_justify = "left"
    return table


def _loader_table(runs: list[dict[str, Any]], settings: dict[str, Any], cache: dict[str, Any]) -> Table:
    """Throughput of every run, with ratios and worker memory."""
    batches = f"{settings['warmup']} warm-up + {settings['measured_batches']} timed batches"
    rounds = settings.get("rounds", 1)
    best = f"; the fastest of {rounds} rounds, loaders taking turns" if rounds > 1 else ""
    other = any(run.get("ours_over_other") is not None for run in runs)
    table = Table(
        title=f"Loaders: batch size {settings['batch_size']}, {batches} (of {cache['epoch_batches']} per epoch){best}",
        title_justify="left",
    )
    table.add_column("loader")
    ratios = ["ours/other"] if other else []
    for column in ("workers", "samples/s", "MB/s", "of memcpy", "CPU ms/sample", *ratios, "ours/plain", "ours/bare"):
        table.add_column(column, justify="right")
    table.add_column("load", justify="right")
    if rounds > 1:
        table.add_column("slowest round", justify="right")
    table.add_column("worker private memory (USS), start -> end of timed batches")
    for run in runs:
        workers = run["num_workers"]
        table.add_row(
            LOADER_NAMES.get(run["loader"], run["loader"]),
            "-" if workers is None else str(workers),
            f"{run['samples_s']:,.1f}",
            f"{run['mb_s']:,.1f}",
            f"{run['memcpy_fraction']:.1%}",
            _cpu_text(run.get("cpu_ms_per_sample"), run.get("main_cpu_ms_per_sample"), workers),
            *([_ratio_text(run.get("ours_over_other"))] if other else []),
            _ratio_text(run.get("ours_over_naive")),
            _ratio_text(run.get("ours_over_bare")),
            _load_text(run.get("load_average_1m")),
            *([f"{min(run['rounds_samples_s']):,.1f}"] if rounds > 1 else []),
            worker_memory(run["workers"]),
        )
    table.caption = (
        "MB/s: payload file bytes (10^6) per second; of memcpy: MB/s over the memcpy limit; CPU ms/sample: "
        "this process and the live workers together (this process's share in brackets); ours/x: our samples/s "
        "over x's at the same worker count; ours, plain and bare read the same batches"
        + (", the other loader its own sampler's" if other else "")
        + "; load: 1-minute load average when the timing started"
        + ("; slowest round: samples/s of the slowest round" if rounds > 1 else "")
    )
    table.caption_justify = "left"
    return table


def _epoch_table(epochs: list[dict[str, Any]], settings: dict[str, Any], cache: dict[str, Any]) -> Table:
    """Worker memory over whole epochs."""
    table = Table(
        title=f"Worker memory over one epoch of {cache['samples']:,} records, batch size {settings['batch_size']}",
        title_justify="left",
    )
    table.add_column("loader")
    for column in ("workers", "batches", "seconds", "samples/s", "load"):
        table.add_column(column, justify="right")
    table.add_column(f"worker private memory (USS), after {settings['warmup']} batches -> end of the epoch")
    for epoch in epochs:
        table.add_row(
            LOADER_NAMES.get(epoch["loader"], epoch["loader"]),
            str(epoch["num_workers"]),
            f"{epoch['batches']:,}",
            f"{epoch['seconds']:.1f}",
            f"{epoch['samples_s']:,.0f}",
            _load_text(epoch["load_average_1m"]),
            worker_memory(epoch["workers"], highest=True),
        )
    table.caption = "every record's payload is a hard link to one tiny .pt file: the index is what grows"
    table.caption_justify = "left"
    return table
