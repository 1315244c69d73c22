"""`image-edit-data bench`: index open, index memory, loader throughput and worker memory on one cache.

One run measures, on this machine: opening the index; the machine's memcpy bandwidth; our
loader at each `--num-workers`; and with `--compare-naive` a plain DataLoader and a bare load
loop over the same planned batches. It prints numbers only (a table, and `--json PATH`).
`--make-synthetic N` first writes a cache of realistic sample size (`bench_synthetic`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from jsonargparse import ActionYesNo, ArgumentParser, Namespace
from rich.console import Console
from rich.progress import track

from .bench_measure import Run, load_average, machine_info, measure_index_open, memcpy_bandwidth, timed_batches
from .bench_naive import bare_loop, naive_loader
from .bench_report import render
from .bench_synthetic import SyntheticSpec, synthetic_spec, write_synthetic_cache
from .loader import ImageEditDataloaderConfig
from .payload import format_of

RESULTS_VERSION = 1
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, RuntimeError)


@dataclass(frozen=True)
class BenchOptions:
    """How each loader run is driven."""

    batch_size: int = 4
    num_workers: tuple[int, ...] = (0,)
    batches: int = 200
    warmup: int = 10
    prefetch_factor: int = 2
    compare_naive: bool = False
    memcpy_mib: int = 256

    def check(self) -> None:
        """Refuse values no run could use."""
        for name, value, lowest in (
            ("--batch-size", self.batch_size, 1),
            ("--batches", self.batches, 1),
            ("--warmup", self.warmup, 0),
            ("--prefetch-factor", self.prefetch_factor, 1),
            ("--memcpy-mib", self.memcpy_mib, 1),
            *(("--num-workers", w, 0) for w in self.num_workers),
        ):
            if value < lowest:
                raise ValueError(f"{name}: expected an integer >= {lowest}, got {value}")


def bench_parser() -> ArgumentParser:
    """Options of `image-edit-data bench`."""
    parser = ArgumentParser(
        prog="image-edit-data bench",
        description="Measure index open time and memory, loader samples/s and MB/s, and worker memory on a cache.",
        exit_on_error=False,
    )
    parser.add_argument("cache_dir", type=str | None, nargs="?", default=None, help="Cache to measure.")
    parser.add_argument("--batch-size", type=int, default=4, help="Samples per batch.")
    parser.add_argument("--num-workers", type=int, nargs="+", default=[0], help="Worker counts to run, in turn.")
    parser.add_argument("--batches", type=int, default=200, help="Batches timed per run (at most one epoch).")
    parser.add_argument("--warmup", type=int, default=10, help="Batches drawn before the timing starts.")
    parser.add_argument("--prefetch-factor", type=int, default=2, help="Batches each worker loads ahead.")
    parser.add_argument(
        "--compare-naive",
        action=ActionYesNo,
        default=False,
        help="Also time a plain DataLoader (one torch.load per sample, stacking collate) and a bare load loop.",
    )
    parser.add_argument("--memcpy-mib", type=int, default=256, help="Buffer copied to measure memcpy bandwidth.")
    parser.add_argument("--json", type=str | None, default=None, help="Also write every number to this JSON file.")
    parser.add_argument(
        "--make-synthetic", type=int | None, default=None, help="Write a synthetic cache of N samples and bench it."
    )
    parser.add_argument(
        "--preset",
        type=Literal["small", "large"],
        default="small",
        help="Synthetic sample size: small ~0.9 MB (16x64x64 latents), large ~3.3 MB (16x128x128).",
    )
    parser.add_argument("--format", type=Literal["pt", "safetensors"], default="pt", help="Synthetic payload format.")
    parser.add_argument("--latent", type=str | None, default=None, help="Synthetic latent shape CxHxW, each image.")
    parser.add_argument("--prompt", type=str | None, default=None, help="Synthetic prompt embedding shape SxD.")
    parser.add_argument("--contexts", type=int, default=1, help="Synthetic context images per sample.")
    parser.add_argument("--out", type=str | None, default=None, help="Keep the synthetic cache in this new directory.")
    return parser


def make_console() -> Console:
    """Console output; when piped, 160 columns wide so the tables keep one line per row."""
    console = Console(soft_wrap=True)
    return console if console.is_terminal else Console(soft_wrap=True, width=160)


def bench_main(argv: list[str]) -> int:
    """`image-edit-data bench ...`; returns the exit code (2 for bad options, 1 for a bad cache)."""
    console = make_console()
    try:
        args = bench_parser().parse_args(argv)
        options = options_from(args)
        spec = spec_from(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:  # jsonargparse reports bad options as ArgumentError/TypeError
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 2
    temporary = Path(tempfile.mkdtemp(prefix="image-edit-bench-")) if spec and not args.out else None
    try:
        if spec is None:
            cache_dir = Path(args.cache_dir)
        else:
            cache_dir = temporary or Path(args.out)
            bar = partial(track, description="writing synthetic samples", console=console, transient=True)
            write_synthetic_cache(cache_dir, args.make_synthetic, spec, progress=bar)
        results = run_bench(cache_dir, options, console)
    except USER_ERRORS as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 1
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    results["cache"]["synthetic"] = None if spec is None else {**asdict(spec), "preset": args.preset}
    results["cache"]["kept"] = temporary is None
    render(results, console)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"numbers written to {args.json}", highlight=False)
    return 0


def spec_from(args: Namespace) -> SyntheticSpec | None:
    """The synthetic cache to write, or None to bench CACHE_DIR; refuses contradictory options."""
    if args.json and not Path(args.json).parent.is_dir():
        raise ValueError(f"--json: the directory of {args.json} does not exist")
    if args.make_synthetic is None:
        if args.cache_dir is None:
            raise ValueError("expected CACHE_DIR, or --make-synthetic N to bench a synthetic cache")
        return None
    if args.cache_dir is not None:
        raise ValueError("pass either CACHE_DIR or --make-synthetic N (with --out DIR to keep it), not both")
    return synthetic_spec(args.preset, args.latent, args.prompt, args.contexts, args.format)


def options_from(args: Namespace) -> BenchOptions:
    """Checked options from parsed arguments."""
    options = BenchOptions(
        batch_size=args.batch_size,
        num_workers=tuple(args.num_workers),
        batches=args.batches,
        warmup=args.warmup,
        prefetch_factor=args.prefetch_factor,
        compare_naive=args.compare_naive,
        memcpy_mib=args.memcpy_mib,
    )
    options.check()
    return options


def run_bench(cache_dir: Path, options: BenchOptions, console: Console) -> dict[str, Any]:
    """Every measurement on `cache_dir`, as the JSON-ready results dict."""
    machine = machine_info()
    with console.status("opening the index"):
        index, index_numbers = measure_index_open(cache_dir)
    with console.status("measuring memcpy bandwidth"):
        memcpy = memcpy_bandwidth(options.memcpy_mib << 20)
    config = loader_config(cache_dir, options, num_workers=0)
    sampler = config.build(dp_rank=0, dp_world_size=1, batch_size=options.batch_size).sampler
    if len(sampler) <= options.warmup:
        raise ValueError(
            f"{cache_dir}: one epoch has {len(sampler)} batches of {options.batch_size}, "
            f"not more than --warmup {options.warmup}; lower --warmup or --batch-size"
        )
    # Every run reads these batches: the first epoch of our sampler, cut to warmup + batches.
    plan = [sampler.batch_for(s).tolist() for s in range(min(len(sampler), options.warmup + options.batches))]
    paths = [str(index.root / index.relative_path(i)) for i in range(len(index))]
    sizes = {i: Path(paths[i]).stat().st_size for batch in plan for i in batch}
    ours: list[Run] = []
    for workers in options.num_workers:
        with console.status(f"timing our loader with {workers} workers"):
            build = loader_config(cache_dir, options, workers).build(
                dp_rank=0, dp_world_size=1, batch_size=options.batch_size
            )
            ours.append(
                timed_batches(
                    "ours",
                    workers,
                    build.dataloader,
                    plan,
                    options.warmup,
                    sizes,
                    indices_of=lambda batch: batch["metadata"]["sample_indices"],
                )
            )
    naive: list[Run] = []
    bare = None
    if options.compare_naive:
        for workers in options.num_workers:
            with console.status(f"timing a plain DataLoader with {workers} workers"):
                loader = naive_loader(paths, plan, workers, options.prefetch_factor)
                naive.append(timed_batches("naive", workers, loader, plan, options.warmup, sizes))
        with console.status("timing a bare load loop"):
            bare = bare_loop(paths, plan, options.warmup, sizes)
    limit = memcpy["mb_s"]
    runs = []
    for i, run in enumerate(ours):
        numbers = run.to_json(limit)
        numbers["ours_over_naive"] = ratio(numbers, naive[i].to_json(limit)) if naive else None
        numbers["ours_over_bare"] = ratio(numbers, bare.to_json(limit)) if bare else None
        runs.append(numbers)
    runs += [run.to_json(limit) for run in [*naive, *([bare] if bare else [])]]
    formats = sorted({format_of(paths[i]) for i in sizes})
    return {
        "version": RESULTS_VERSION,
        "machine": {**machine, "load_average_1m_end": load_average()},
        "cache": {
            "path": str(index.root),
            "samples": len(index),
            "buckets": len(index.signatures),
            "epoch_batches": len(sampler),
            "formats": formats,
            "mean_payload_bytes": sum(sizes.values()) / len(sizes),
        },
        "settings": {
            **asdict(options),
            "num_workers": list(options.num_workers),
            "measured_batches": len(plan) - options.warmup,
        },
        "index": index_numbers,
        "memcpy": memcpy,
        "runs": runs,
    }


def loader_config(cache_dir: Path, options: BenchOptions, num_workers: int) -> ImageEditDataloaderConfig:
    """Our loader as a training run would configure it, at `num_workers`."""
    return ImageEditDataloaderConfig(
        cache_dir=str(cache_dir), num_workers=num_workers, prefetch_factor=options.prefetch_factor
    )


def ratio(ours: dict[str, Any], other: dict[str, Any]) -> float:
    """Our samples/s over another loader's."""
    return float(ours["samples_s"] / other["samples_s"])
