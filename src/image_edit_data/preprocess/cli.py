"""`image-edit-data cache SUBCOMMAND` (those of `CACHE_COMMANDS`) and `image-edit-data demo-cache`: parse, run, report.

Each entry point takes argv (without the program and command names) and returns an exit code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jsonargparse import ActionYesNo, ArgumentParser, Namespace
from rich.console import Console

from .console import labelled, make_console
from .demo_cache import write_demo_cache
from .run.command import build_parser, print_summary, progress_bar, run_build
from .sources.base import BadSampleError

USER_ERRORS = (ValueError, TypeError, FileNotFoundError, TimeoutError, RuntimeError, ImportError, OSError)
STORAGE_HELP = 'fsspec options for URLs, as JSON (e.g. {"endpoint_url": "http://127.0.0.1:9000"}).'


def validate_parser() -> ArgumentParser:
    """`cache validate DIR`."""
    validate = ArgumentParser(description="Load and check every payload.", exit_on_error=False)
    validate.add_argument("cache_dir", type=str)
    validate.add_argument("--check-finite", action=ActionYesNo, default=False, help="Also report NaN/Inf values.")
    validate.add_argument("--workers", type=int, default=8, help="Threads loading payloads.")
    validate.add_argument("--storage-options", type=dict[str, Any] | None, default=None, help=STORAGE_HELP)
    return validate


def inspect_parser() -> ArgumentParser:
    """`cache inspect DIR`."""
    inspect = ArgumentParser(description="Bucket table and token statistics.", exit_on_error=False)
    inspect.add_argument("cache_dir", type=str)
    inspect.add_argument("--histogram", type=str | None, default=None, help="Write shape/token plots to this PNG.")
    inspect.add_argument("--patch-size", type=int | None, default=None, help="Latent cells per token side.")
    inspect.add_argument("--storage-options", type=dict[str, Any] | None, default=None, help=STORAGE_HELP)
    return inspect


def convert_parser() -> ArgumentParser:
    """`cache convert DIR OUT_DIR`."""
    convert = ArgumentParser(description="Rewrite every payload in another format.", exit_on_error=False)
    convert.add_argument("cache_dir", type=str, help="The cache to read (left untouched).")
    convert.add_argument("out_dir", type=str, help="A new directory for the converted cache.")
    convert.add_argument("--format", type=Literal["pt", "safetensors"], default="safetensors", help="Payload format.")
    convert.add_argument("--workers", type=int, default=4, help="Threads converting payloads.")
    return convert


def pack_parser() -> ArgumentParser:
    """`cache pack SRC OUT`."""
    from .tools.pack import DEFAULT_SHARD_BYTES

    pack = ArgumentParser(description="Rewrite a cache into uncompressed tar shards, grouped by bucket.")
    pack.add_argument("cache_dir", type=str, help="The cache to read (a directory or URL; left untouched).")
    pack.add_argument("out_dir", type=str, help="A new directory or URL (s3://..., gs://...) for the packed cache.")
    pack.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="Target size of one shard.")
    pack.add_argument("--storage-options", type=dict[str, Any] | None, default=None, help=STORAGE_HELP)
    pack.add_argument("--staging-dir", type=str | None, default=None, help="Local work directory for a URL output.")
    return pack


def validate_main(args: Namespace, console: Console) -> int:
    """Run `cache validate`."""
    from .tools.validate import validate_main as run

    return run(args, console)


def inspect_main(args: Namespace, console: Console) -> int:
    """Run `cache inspect`."""
    from .tools.inspect import inspect_main as run

    return run(args, console)


@dataclass(frozen=True)
class Subcommand:
    """One `cache` subcommand: its one-line help, its parser and what runs it."""

    help: str
    parser: Callable[[], ArgumentParser]
    run: Callable[[Namespace, Console], int]


def cache_parser() -> ArgumentParser:
    """`cache SUBCOMMAND ...`, one subcommand per entry of `CACHE_COMMANDS`."""
    parser = ArgumentParser(
        prog="image-edit-data cache",
        description=f"Cache tools: {', '.join(CACHE_COMMANDS)}.",
        exit_on_error=False,
    )
    commands = parser.add_subcommands(dest="command")
    for name, subcommand in CACHE_COMMANDS.items():
        commands.add_subcommand(name, subcommand.parser(), help=subcommand.help)
    return parser


def cache_main(argv: list[str]) -> int:
    """`image-edit-data cache ...`; returns the exit code."""
    console = make_console()
    try:
        args = cache_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:  # jsonargparse reports bad options as ArgumentError/TypeError
        console.print(labelled("error:", "red", error))
        return 2
    command = args.command
    try:
        return CACHE_COMMANDS[command].run(args[command], console)
    except BadSampleError as error:
        console.print(labelled("bad sample:", "red", f"{error}\n(use --on-bad-sample skip to leave such samples out)"))
        return 1
    except USER_ERRORS as error:
        console.print(labelled("error:", "red", error))
        return 1


def convert_main(args: Namespace, console: Console) -> int:
    """Run `cache convert` and report what it wrote."""
    from .tools.convert import convert_cache

    report = convert_cache(args.cache_dir, args.out_dir, args.format, workers=args.workers)
    console.print(
        f"converted {report.converted} samples ({report.reused} already done) into {args.out_dir} "
        f"as {args.format}, {report.shards} index shard(s)",
        highlight=False,
    )
    return 0


def pack_main(args: Namespace, console: Console) -> int:
    """Run `cache pack` and report what it wrote."""
    from .tools.pack import pack_cache

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
        console.print(labelled("error:", "red", error))
        return 2
    try:
        with progress_bar(console, args.quiet, "encoding") as on_progress:
            report = write_demo_cache(
                args.out_dir,
                args.num_samples,
                args.seed,
                args.format,
                args.batch_size,
                on_progress=on_progress,
                log=lambda message: console.print(message, style="dim"),
            )
        print_summary(console, report)
    except USER_ERRORS as error:
        console.print(labelled("error:", "red", error))
        return 1
    console.print(f"train with cache_dir={Path(args.out_dir).resolve()}")
    return 0


# The one list of `cache` subcommands: the parser, the dispatch and `image-edit-data --help` all read it.
CACHE_COMMANDS: dict[str, Subcommand] = {
    "build": Subcommand("Encode raw examples into a cache (resumable, multi-rank).", build_parser, run_build),
    "validate": Subcommand(
        "Check every payload: exit 0 sound, 1 a bad sample, 2 an unreadable index.", validate_parser, validate_main
    ),
    "inspect": Subcommand("Print the bucket table and token statistics.", inspect_parser, inspect_main),
    "convert": Subcommand(
        "Rewrite the payloads in the other format (e.g. NeMo .pt -> safetensors); resumable.",
        convert_parser,
        convert_main,
    ),
    "pack": Subcommand("Pack the payloads into tar shards, locally or at a URL; resumable.", pack_parser, pack_main),
}
