"""`image-edit-data bench`: index open, index memory, loader throughput and worker memory on one cache.

One run measures, on this machine: opening the index; the machine's memcpy bandwidth; our loader
at each `--num-workers` (a packed cache too; `--no-checksums` reads it unchecked, to measure the
check); with `--compare-naive` a plain DataLoader and a bare load loop over the
same planned batches; with `--rounds N` every loader N times, taking turns, each reported by its
fastest round. `--index-only` measures the index alone; `--worker-memory-index N` worker memory
over an epoch of N records. It prints numbers only (tables, and `--json PATH`). `--make-synthetic N`
first writes a cache of realistic sample size (`synthetic.py`). `bench_main(argv, other=...)` also
times another loader (`other.py`): the repository's benchmarks/ race NeMo Automodel's that way, and
litdata's on data of their own, beside stress runs and the remote-layout comparison.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse import ActionYesNo, ArgumentParser, Namespace
from rich.console import Console
from rich.progress import track

from ..preprocess.console import labelled
from .measure import LOADER_NOISE
from .other import OtherLoader
from .paths import resolve_path_options
from .report import render
from .run import BenchOptions, run_index_only, run_loaders, run_worker_memory
from .synthetic import (
    SyntheticSpec,
    synthetic_spec,
    write_hardlink_cache,
    write_index_only_cache,
    write_synthetic_cache,
)

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, RuntimeError)


def _bench_parser() -> ArgumentParser:
    """Options of `image-edit-data bench`."""
    parser = ArgumentParser(
        prog="image-edit-data bench",
        description="Measure index open time and memory, loader samples/s and MB/s, and worker memory on a cache.",
        exit_on_error=False,
    )
    parser.add_argument("cache_dir", type=str | None, nargs="?", default=None, help="Cache to measure.")
    parser.add_argument("--batch-size", type=int, default=4, help="Samples per batch.")
    parser.add_argument(
        "--num-workers",
        type=int,
        nargs="+",
        default=None,
        help="Worker counts to run, in turn (default 0; 2 with --worker-memory-index).",
    )
    parser.add_argument("--batches", type=int, default=200, help="Batches timed per run (at most one epoch).")
    parser.add_argument("--warmup", type=int, default=10, help="Batches drawn before the timing starts.")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Time every loader this many times, taking turns, and report each one's fastest round "
        "(a noisy machine slows some rounds, never speeds one up).",
    )
    parser.add_argument("--prefetch-factor", type=int, default=2, help="Batches each worker loads ahead.")
    parser.add_argument(
        "--compare-naive",
        action=ActionYesNo,
        default=False,
        help="Also time a plain DataLoader (one torch.load per sample, stacking collate) and a bare load loop.",
    )
    parser.add_argument(
        "--no-checksums",
        action=ActionYesNo,
        default=False,
        help="Read a packed cache's members without checking their checksums (to measure what the check costs; "
        "training always checks).",
    )
    parser.add_argument(
        "--index-only",
        action=ActionYesNo,
        default=False,
        help="Measure only opening the index; with --make-synthetic N, write metadata.json and shards only.",
    )
    parser.add_argument(
        "--worker-memory-index",
        type=int | None,
        default=None,
        help="Write a cache of N records (hard links to one tiny payload) and measure worker memory over one epoch.",
    )
    parser.add_argument("--memcpy-mib", type=int, default=256, help="Buffer copied to measure memcpy bandwidth.")
    parser.add_argument(
        "--wait-load",
        type=float | None,
        default=None,
        help="Before each measurement, wait (up to 15 min) for the 1-minute load average to fall below this.",
    )
    parser.add_argument(
        "--torch-threads", type=int | None, default=None, help="torch.set_num_threads for this process."
    )
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
    """Console output, markup off (paths print as they are); when piped, 160 columns wide so the tables keep one
    line per row."""
    console = Console(soft_wrap=True, markup=False, highlight=False)
    return console if console.is_terminal else Console(soft_wrap=True, width=160, markup=False, highlight=False)


def bench_main(argv: list[str], other: OtherLoader | None = None) -> int:
    """`image-edit-data bench ...`, timing `other` too when given; the exit code (2 bad options, 1 a bad cache)."""
    console = make_console()
    try:
        args = _bench_parser().parse_args(argv)
        resolve_path_options(args, ("cache_dir", "out", "json"))
        options = _options_from(args)
        spec = _spec_from(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:  # jsonargparse reports bad options as ArgumentError/TypeError
        console.print(labelled("error:", "red", error))
        return 2
    if options.torch_threads is not None:
        torch.set_num_threads(options.torch_threads)
    writes = spec is not None or args.worker_memory_index is not None
    temporary = Path(tempfile.mkdtemp(prefix="image-edit-bench-")) if writes and not args.out else None
    try:
        cache_dir = write_cache(args, spec, temporary, console) if writes else Path(args.cache_dir)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LOADER_NOISE)
            results = run(cache_dir, options, args, console, other)
    except USER_ERRORS as error:
        console.print(labelled("error:", "red", error))
        return 1
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    synthetic = None if spec is None else {**asdict(spec), "preset": args.preset}
    results["cache"].update(synthetic=synthetic, kept=temporary is None)
    render(results, console)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"numbers written to {args.json}", highlight=False)
    return 0


def run(
    cache_dir: Path, options: BenchOptions, args: Namespace, console: Console, other: OtherLoader | None
) -> dict[str, Any]:
    """The measurements the options ask for."""
    if not cache_dir.is_dir():
        raise FileNotFoundError(f"{cache_dir}: cache directory does not exist")
    if args.worker_memory_index is not None:
        return run_worker_memory(cache_dir, options, console, other)
    if args.index_only:
        return run_index_only(cache_dir, options, console, other)
    return run_loaders(cache_dir, options, console, other)


def write_cache(args: Namespace, spec: SyntheticSpec | None, temporary: Path | None, console: Console) -> Path:
    """Write the synthetic cache the options ask for and return its directory."""
    root = temporary or Path(args.out)
    bar = partial(track, description="writing the synthetic cache", console=console, transient=True)
    if args.worker_memory_index is not None:
        return write_hardlink_cache(root, args.worker_memory_index, progress=bar)
    assert spec is not None  # `writes` in bench_main: one of the two is set
    if args.index_only:
        return write_index_only_cache(root, args.make_synthetic, spec.payload_format, progress=bar)
    return write_synthetic_cache(root, args.make_synthetic, spec, progress=bar)


def _spec_from(args: Namespace) -> SyntheticSpec | None:
    """The synthetic cache to write, or None to bench CACHE_DIR; refuses contradictory options."""
    if args.json and not Path(args.json).parent.is_dir():
        raise ValueError(f"--json: the directory of {args.json} does not exist")
    if args.worker_memory_index is not None:
        if args.cache_dir is not None or args.make_synthetic is not None or args.index_only:
            raise ValueError(
                "--worker-memory-index N writes its own cache; drop CACHE_DIR, --make-synthetic, --index-only"
            )
        return None
    if args.make_synthetic is None:
        if args.cache_dir is None:
            raise ValueError("expected CACHE_DIR, or --make-synthetic N to bench a synthetic cache")
        return None
    if args.cache_dir is not None:
        raise ValueError("pass either CACHE_DIR or --make-synthetic N (with --out DIR to keep it), not both")
    return synthetic_spec(args.preset, args.latent, args.prompt, args.contexts, args.format)


def _options_from(args: Namespace) -> BenchOptions:
    """Checked options from parsed arguments."""
    workers = args.num_workers or ([2] if args.worker_memory_index is not None else [0])
    if args.worker_memory_index is not None and 0 in workers:
        raise ValueError("--worker-memory-index measures worker processes: expected --num-workers >= 1, got 0")
    options = BenchOptions(
        batch_size=args.batch_size,
        num_workers=tuple(workers),
        batches=args.batches,
        warmup=args.warmup,
        rounds=args.rounds,
        prefetch_factor=args.prefetch_factor,
        compare_naive=args.compare_naive,
        no_checksums=args.no_checksums,
        memcpy_mib=args.memcpy_mib,
        wait_load=args.wait_load,
        torch_threads=args.torch_threads,
    )
    options.check()
    return options
