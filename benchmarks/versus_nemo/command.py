"""The command line: `image-edit-data bench`'s options, plus `--reference-path DIR` to import NeMo Automodel from."""

from __future__ import annotations

import argparse
from pathlib import Path

from image_edit_data.bench.command import bench_main, make_console

from .nemo import NemoLoader

USAGE = (
    "usage: python -m benchmarks.versus_nemo [CACHE_DIR] [--reference-path DIR] [options of image-edit-data bench]\n"
    "NeMo Automodel's loader measured beside ours: index open and memory, samples/s, worker memory. "
    "--reference-path DIR imports it from an unpacked wheel (default: the environment's)."
)


def versus_nemo_main(argv: list[str]) -> int:
    """Find NeMo Automodel's loader, then run the bench with it; the exit code (2 when it cannot be imported)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--reference-path", default=None)
    known, rest = parser.parse_known_args(argv)
    console = make_console()
    if "-h" in rest or "--help" in rest:
        console.print(USAGE + "\n", markup=False, highlight=False)
        return bench_main(["--help"])
    path = None if known.reference_path is None else str(Path(known.reference_path).expanduser().resolve())
    try:
        nemo = NemoLoader.find(path)
    except ValueError as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 2
    return bench_main(rest, other=nemo)
