"""`image-edit-data cache build`: its options, the progress bar and the summary it prints."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser, Namespace
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from ..encoders.base import ImageEncoder, PipelineEncoder, PromptEncoder, TextEncoder
from ..sources.base import EditSource
from ..sources.paired import ConfigDataset
from .build_cache import BuildOptions, BuildReport, build_cache
from .mixture_config import BuiltDataset, write_mixture
from .ray_engine import RayOptions
from .resize import ResizePolicy
from .source_options import add_source_arguments, open_sources


class SpeedColumn(ProgressColumn):
    """Samples per second of this run."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("-- samples/s" if speed is None else f"{speed:.1f} samples/s", style="progress.data.speed")


@contextmanager
def progress_bar(console: Console, quiet: bool, label: str) -> Iterator[Callable[[int, int], None]]:
    """An `on_progress(done, total)` callback drawing a rich bar (off when quiet or not a terminal)."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        SpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, disable=quiet or not console.is_terminal) as progress:
        task = progress.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


def build_parser() -> ArgumentParser:
    """The `cache build` options."""
    parser = ArgumentParser(description="Encode raw edit examples into a cache.", exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of these options.")
    parser.add_argument("out_dir", type=str, help="Cache directory to create or resume.")
    add_source_arguments(parser)
    parser.add_argument(
        "--encoder", type=PipelineEncoder | None, default=None, help="One pipeline for images and prompts."
    )
    parser.add_argument("--image-encoder", type=ImageEncoder | None, default=None, help="Class path (+ init args).")
    parser.add_argument(
        "--text-encoder", type=TextEncoder | PromptEncoder | None, default=None, help="Class path (+ init args)."
    )
    parser.add_argument(
        "--resize",
        type=Literal["max_pixels", "max_pixels_floor", "presets", "none"],
        default="max_pixels",
        help="Keep aspect within --max-pixels (floor: sides rounded down, as NeMo), pick from --presets, or none.",
    )
    parser.add_argument("--max-pixels", type=int, default=1024 * 1024, help="Pixel budget per image.")
    parser.add_argument("--spatial-alignment", type=int, default=32, help="Image sides are multiples of this.")
    parser.add_argument("--presets", type=list[tuple[int, int]], default=[], help="(W, H) list, e.g. '[[1024,1024]]'.")
    parser.add_argument("--upscale", action=ActionYesNo, default=False, help="Enlarge small images to the budget.")
    parser.add_argument("--format", type=Literal["pt", "safetensors"], default="pt", help="Payload format.")
    parser.add_argument("--token-patch-size", type=int, default=2, help="Latent cells per token side.")
    parser.add_argument(
        "--store-dtype",
        type=Literal["float32", "bfloat16", "float16"],
        default="float32",
        help="Dtype of stored latents and embeddings (the reference stores bfloat16).",
    )
    parser.add_argument("--shard-size", type=int, default=10_000, help="Index records per shard.")
    parser.add_argument("--num-samples", type=int | None, default=None, help="Use only the first N source rows.")
    parser.add_argument(
        "--allow-no-context",
        action=ActionYesNo,
        default=False,
        help="Write rows without context images as text-to-image rows (else each is a bad sample).",
    )
    parser.add_argument(
        "--on-bad-sample",
        type=Literal["stop", "skip"],
        default="stop",
        help="Stop at the first bad raw example, or skip it and count it.",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="Images or prompts per encoder call.")
    parser.add_argument("--num-workers", type=int, default=4, help="Threads reading images and writing payloads.")
    parser.add_argument(
        "--read-ahead", type=int, default=16, help="Samples read ahead of the encoders (0: nothing overlaps)."
    )
    parser.add_argument("--rank", type=int | None, default=None, help="This process's rank (default: $RANK or 0).")
    parser.add_argument("--world-size", type=int | None, default=None, help="Ranks (default: $WORLD_SIZE or 1).")
    parser.add_argument("--merge-only", action=ActionYesNo, default=False, help="Only merge finished journals.")
    parser.add_argument("--merge-timeout", type=float, default=3600.0, help="Seconds rank 0 waits for others.")
    parser.add_argument(
        "--poll-interval", type=float, default=2.0, help="Longest wait between rank 0's looks (changes wake it)."
    )
    parser.add_argument("--quiet", action=ActionYesNo, default=False, help="No progress bar.")
    parser.add_argument(
        "--engine", type=Literal["local", "ray"], default="local", help="This process (and its ranks), or Ray Data."
    )
    parser.add_argument(
        "--ray-address", type=str | None, default=None, help="Ray cluster (default: RAY_ADDRESS or a new local one)."
    )
    parser.add_argument(
        "--ray-encoders", type=int | None, default=None, help="Encoder actors (default: one per GPU, or 1)."
    )
    parser.add_argument("--ray-gpus-per-encoder", type=float | None, default=None, help="Default: 1 with GPUs, else 0.")
    parser.add_argument("--ray-num-cpus", type=int | None, default=None, help="CPUs of a local cluster started here.")
    return parser


def runtime_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size from the options, else torchrun's environment, else a single process."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    return rank, world_size


def select_local_device() -> None:
    """Under torchrun, make `cuda` mean this process's GPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def spec(value: Any) -> dict[str, Any]:
    """A parsed class_path/init_args namespace as a plain dict."""
    data = value.as_dict() if isinstance(value, Namespace) else dict(value)
    return {"class_path": data["class_path"], "init_args": dict(data.get("init_args") or {})}


def encoder_specs(args: Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The image and text encoder specs: `--encoder` for both, or `--image-encoder` and `--text-encoder`."""
    if args.encoder is not None:
        if args.image_encoder is not None or args.text_encoder is not None:
            raise ValueError("encoder: give either --encoder or --image-encoder with --text-encoder, not both")
        return spec(args.encoder), spec(args.encoder)
    if args.image_encoder is None or args.text_encoder is None:
        raise ValueError("encoder: give --encoder (a pipeline encoder), or both --image-encoder and --text-encoder")
    return spec(args.image_encoder), spec(args.text_encoder)


def ray_options(args: Namespace) -> RayOptions:
    """The `--ray-*` options (read only with `--engine ray`)."""
    return RayOptions(
        address=args.ray_address,
        encoders=args.ray_encoders,
        gpus_per_encoder=args.ray_gpus_per_encoder,
        num_cpus=args.ray_num_cpus,
    )


def run_build(args: Namespace, console: Console) -> int:
    """`cache build`."""
    rank, world_size = runtime_rank(args.rank, args.world_size)
    image_spec, text_spec = encoder_specs(args)
    options = BuildOptions(
        payload_format=args.format,
        resize=ResizePolicy(
            args.resize, args.max_pixels, args.spatial_alignment, tuple(map(tuple, args.presets)), args.upscale
        ),
        token_patch_size=args.token_patch_size,
        store_dtype=args.store_dtype,
        shard_size=args.shard_size,
        num_samples=args.num_samples,
        allow_no_context=args.allow_no_context,
        on_bad_sample=args.on_bad_sample,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        read_ahead=args.read_ahead,
        merge_timeout=args.merge_timeout,
        poll_interval=args.poll_interval,
    )
    select_local_device()
    opened = open_sources(args)
    run = {"rank": rank, "world_size": world_size, "merge_only": args.merge_only, "quiet": args.quiet}
    run["engine"] = {"engine": args.engine, "ray": ray_options(args)}
    if not isinstance(opened, list):
        execute(args.out_dir, opened, image_spec, text_spec, options, console, **run)
        return 0
    return build_datasets(args, opened, (image_spec, text_spec), options, console, run)


def build_datasets(
    args: Namespace,
    datasets: list[ConfigDataset],
    specs: tuple[dict[str, Any], dict[str, Any]],
    options: BuildOptions,
    console: Console,
    run: dict[str, Any],
) -> int:
    """A trainer's whole config: one cache per data set under `out_dir`, then (rank 0) `out_dir/mixture.yaml`."""
    root = Path(args.out_dir).expanduser().resolve()
    origin = args.musubi_config or args.ai_toolkit_config or args.simpletuner_config
    built = []
    for number, dataset in enumerate(datasets, start=1):
        console.print(f"data set {number}/{len(datasets)}: {dataset.name} ({dataset.why})", highlight=False)
        report = execute(str(root / dataset.name), dataset.source, *specs, options, console, **run)
        samples = report.merged.samples if report.merged is not None else 0
        built.append(BuiltDataset(dataset.name, report.root, samples, dataset.repeats, dataset.why))
    if run["rank"] == 0:
        path = write_mixture(root / "mixture.yaml", built, str(Path(origin).resolve()))
        console.print(f"mixture: {path} - train with --config {path} (its data: section)", highlight=False)
    return 0


def execute(
    out_dir: str,
    source: EditSource,
    image_encoder: dict[str, Any],
    text_encoder: dict[str, Any],
    options: BuildOptions,
    console: Console,
    *,
    rank: int,
    world_size: int,
    merge_only: bool,
    quiet: bool,
    engine: dict[str, Any],
) -> BuildReport:
    """Run a build with a progress bar, print its summary and return its report."""
    label = "encoding" if world_size == 1 else f"rank {rank}/{world_size}"
    with progress_bar(console, quiet, label) as on_progress:
        report = build_cache(
            out_dir,
            source,
            image_encoder,
            text_encoder,
            options,
            rank=rank,
            world_size=world_size,
            merge_only=merge_only,
            on_progress=on_progress,
            log=lambda message: console.print(message, style="dim"),
            **engine,
        )
    print_summary(console, report)
    return report


def print_summary(console: Console, report: BuildReport) -> None:
    """Where things went, counts and time."""
    who = "" if report.world_size == 1 else f"rank {report.rank}/{report.world_size}: "
    skipped = sum(report.skipped.values())
    reasons = ", ".join(f"{kind} x{n}" for kind, n in sorted(report.skipped.items()))
    if not report.merge_only:
        console.print(
            f"{who}wrote {report.written} payloads ({report.already_done} of {report.assigned} already done"
            f"{f', {skipped} skipped: {reasons}' if skipped else ''}) in {report.seconds:.1f} s"
        )
    if report.encoding_seconds > 0:
        share = report.encoder_seconds / report.encoding_seconds
        console.print(
            f"{who}encoders busy {share:.0%} of the {report.encoding_seconds:.1f} s of encoding "
            f"({(report.written + sum(report.skipped.values())) / report.encoding_seconds:.2f} samples/s)"
        )
    if report.truncated:
        console.print(
            f"{who}{report.truncated} of the {report.written} prompts were cut by a length limit "
            f"(warned above; recorded in each payload's metadata.prompt_truncation)",
            style="yellow",
        )
    merged = report.merged
    if merged is None:
        if report.rank != 0:
            console.print(f"{who}done; rank 0 merges the index into {report.root / 'metadata.json'}")
        return
    console.print(
        f"cache: {report.root} - {merged.samples} samples in {len(merged.shards)} index shard(s), "
        f"index {report.root / 'metadata.json'}"
    )
    if merged.skipped:
        reasons = ", ".join(f"{kind} x{n}" for kind, n in sorted(merged.skipped_by_reason.items()))
        console.print(
            f"{merged.skipped} bad samples skipped ({reasons}); listed under skipped_samples in metadata.json",
            style="yellow",
        )
