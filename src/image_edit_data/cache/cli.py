"""`image-edit-data cache build|validate|inspect` and `image-edit-data demo-cache`: parse, run, report.

Each entry point takes argv (without the program and command names) and returns an exit code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from jsonargparse import ActionYesNo, ArgumentParser, Namespace
from rich.console import Console

from .build import BuildOptions
from .build_cli import build_parser, execute, run_build
from .resize import ResizePolicy
from .sources import BadSampleError, SequenceSource

DEMO_IMAGE_ENCODER = {"class_path": "image_edit_data.cache.demo_encoders.DemoImageEncoder", "init_args": {}}
DEMO_TEXT_ENCODER = {"class_path": "image_edit_data.cache.demo_encoders.DemoTextEncoder", "init_args": {}}
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, TimeoutError, RuntimeError, ImportError, OSError)
STORAGE_HELP = 'fsspec options for URLs, as JSON (e.g. {"endpoint_url": "http://127.0.0.1:9000"}).'


def cache_parser() -> ArgumentParser:
    """`cache build|validate|inspect|convert`."""
    parser = ArgumentParser(
        prog="image-edit-data cache", description="Build, validate or inspect a cache.", exit_on_error=False
    )
    commands = parser.add_subcommands(dest="command")
    commands.add_subcommand("build", build_parser(), help="Encode raw examples into a cache (resumable).")
    validate = ArgumentParser(description="Load and check every payload.", exit_on_error=False)
    validate.add_argument("cache_dir", type=str)
    validate.add_argument("--check-finite", action=ActionYesNo, default=False, help="Also report NaN/Inf values.")
    validate.add_argument("--workers", type=int, default=8, help="Threads loading payloads.")
    validate.add_argument("--storage-options", type=dict[str, Any] | None, default=None, help=STORAGE_HELP)
    commands.add_subcommand("validate", validate, help="Exit 0 if sound, 1 if a sample is bad, 2 if the index is.")
    inspect = ArgumentParser(description="Bucket table and token statistics.", exit_on_error=False)
    inspect.add_argument("cache_dir", type=str)
    inspect.add_argument("--histogram", type=str | None, default=None, help="Write shape/token plots to this PNG.")
    inspect.add_argument("--patch-size", type=int | None, default=None, help="Latent cells per token side.")
    inspect.add_argument("--storage-options", type=dict[str, Any] | None, default=None, help=STORAGE_HELP)
    commands.add_subcommand("inspect", inspect, help="Print the bucket table.")
    convert = ArgumentParser(description="Rewrite every payload in another format.", exit_on_error=False)
    convert.add_argument("cache_dir", type=str, help="The cache to read (left untouched).")
    convert.add_argument("out_dir", type=str, help="A new directory for the converted cache.")
    convert.add_argument("--format", type=Literal["pt", "safetensors"], default="safetensors", help="Payload format.")
    convert.add_argument("--workers", type=int, default=4, help="Threads converting payloads.")
    commands.add_subcommand("convert", convert, help="Convert payloads (e.g. NeMo .pt -> safetensors); resumable.")
    commands.add_subcommand("pack", pack_parser(), help="Pack payloads into tar shards (local or a URL); resumable.")
    return parser


def pack_parser() -> ArgumentParser:
    """`cache pack SRC OUT`."""
    from .pack import DEFAULT_SHARD_BYTES

    pack = ArgumentParser(description="Rewrite a cache into uncompressed tar shards, grouped by bucket.")
    pack.add_argument("cache_dir", type=str, help="The cache to read (a directory or URL; left untouched).")
    pack.add_argument("out_dir", type=str, help="A new directory or URL (s3://..., gs://...) for the packed cache.")
    pack.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="Target size of one shard.")
    pack.add_argument("--storage-options", type=dict[str, Any] | None, default=None, help=STORAGE_HELP)
    pack.add_argument("--staging-dir", type=str | None, default=None, help="Local work directory for a URL output.")
    return pack


def make_console() -> Console:
    """Console output; when piped, 160 columns wide so bucket signatures and paths stay on one line."""
    console = Console(soft_wrap=True)
    return console if console.is_terminal else Console(soft_wrap=True, width=160)


def cache_main(argv: list[str]) -> int:
    """`image-edit-data cache ...`; returns the exit code."""
    console = make_console()
    try:
        args = cache_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:  # jsonargparse reports bad options as ArgumentError/TypeError
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 2
    command = args.command
    try:
        if command == "build":
            return run_build(args.build, console)
        if command == "validate":
            from .check import validate_main

            return validate_main(args.validate, console)
        if command == "convert":
            return convert_main(args.convert, console)
        if command == "pack":
            return pack_main(args.pack, console)
        from .inspect import inspect_main

        return inspect_main(args.inspect, console)
    except BadSampleError as error:
        console.print(
            f"[red]bad sample:[/red] {error}\n(use --on-bad-sample skip to leave such samples out)", highlight=False
        )
        return 1
    except USER_ERRORS as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 1


def convert_main(args: Namespace, console: Console) -> int:
    """Run `cache convert` and report what it wrote."""
    from .convert import convert_cache

    report = convert_cache(args.cache_dir, args.out_dir, args.format, workers=args.workers)
    console.print(
        f"converted {report.converted} samples ({report.reused} already done) into {args.out_dir} "
        f"as {args.format}, {report.shards} index shard(s)",
        highlight=False,
    )
    return 0


def pack_main(args: Namespace, console: Console) -> int:
    """Run `cache pack` and report what it wrote."""
    from .pack import pack_cache

    options, staging = args.storage_options, args.staging_dir
    report = pack_cache(args.cache_dir, args.out_dir, args.shard_bytes, storage_options=options, staging_dir=staging)
    console.print(
        f"packed {report.samples} samples ({report.reused} already done) into {report.shards} shard(s) "
        f"of {report.bytes} bytes in all at {args.out_dir}",
        highlight=False,
    )
    return 0


def demo_cache_main(argv: list[str]) -> int:
    """`image-edit-data demo-cache OUT_DIR --num-samples N --seed S --format pt|safetensors`."""
    parser = ArgumentParser(
        prog="image-edit-data demo-cache",
        exit_on_error=False,
        description="Build a cache of procedural demo edits with the weight-free demo encoders.",
    )
    parser.add_argument("out_dir", type=str, help="Cache directory to create or resume.")
    parser.add_argument("--num-samples", type=int, default=2000, help="Examples to generate.")
    parser.add_argument("--seed", type=int, default=0, help="Picks a different, reproducible set of examples.")
    parser.add_argument("--format", type=Literal["pt", "safetensors"], default="pt", help="Payload format.")
    parser.add_argument("--batch-size", type=int, default=32, help="Images or prompts per encoder call.")
    parser.add_argument("--quiet", action=ActionYesNo, default=False, help="No progress bar.")
    console = make_console()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 2
    from .demo import DemoSource

    source = SequenceSource(DemoSource(args.num_samples, args.seed), {"kind": "demo", "seed": args.seed})
    # Demo images are generated at multiples of 16 px, so they need no resizing.
    options = BuildOptions(
        payload_format=args.format, resize=ResizePolicy("none", spatial_alignment=16), batch_size=args.batch_size
    )
    try:
        code = execute(
            args.out_dir,
            source,
            DEMO_IMAGE_ENCODER,
            DEMO_TEXT_ENCODER,
            options,
            console,
            rank=0,
            world_size=1,
            merge_only=False,
            quiet=args.quiet,
        )
    except USER_ERRORS as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 1
    console.print(f"train with cache_dir={Path(args.out_dir).resolve()}")
    return code
