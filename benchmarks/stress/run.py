"""`image-edit-data stress`: DDP fits with loader workers over many epoch changes; reports epochs done and time.

Each run is `benchmarks/stress/fit.py` in a process group of its own. A run whose ranks all stop making
progress for `--hang-after` seconds is counted as a hang: its stacks are left in its log, and the
group is killed. The result is a table (and `--json`): per run, the epochs each rank finished,
the wall time and the time per epoch change.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from jsonargparse import ActionYesNo, ArgumentParser
from rich.console import Console
from rich.table import Table

from benchmarks import child_environment
from image_edit_data.bench.paths import resolve_path_options


@dataclass
class StressRun:
    """What one stress fit did."""

    run: int
    epochs_per_rank: list[int]
    seconds: float
    hung: bool
    exit_code: int | None

    @property
    def seconds_per_epoch(self) -> float:
        """Wall time per epoch change (start-up included)."""
        return self.seconds / max(1, max(self.epochs_per_rank, default=0))


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m benchmarks.stress",
        description="Run DDP fits with loader workers over many epoch changes and report hangs, epochs and time.",
        exit_on_error=False,
    )
    parser.add_argument("--epochs", type=int, default=1000, help="Epochs per fit (each one an epoch change).")
    parser.add_argument("--runs", type=int, default=3, help="Fits to run, one after the other.")
    parser.add_argument("--devices", type=int, default=2, help="DDP ranks (CPU, gloo).")
    parser.add_argument("--num-workers", type=int, default=2, help="Loader workers per rank.")
    parser.add_argument("--samples", type=int, default=8, help="Samples in the tiny demo cache.")
    parser.add_argument("--batch-size", type=int, default=2, help="Samples per batch and rank.")
    parser.add_argument(
        "--multiprocessing-context", type=str, default="forkserver", help="How workers start (forkserver|spawn|fork)."
    )
    parser.add_argument(
        "--thread-churn",
        action=ActionYesNo,
        default=False,
        help="Keep threads starting and exiting in the training process (when a fork of it can hang).",
    )
    parser.add_argument("--hang-after", type=float, default=120.0, help="Seconds without progress that make a hang.")
    parser.add_argument("--out", type=str | None, default=None, help="Directory for cache and logs (default: temp).")
    parser.add_argument("--json", type=str | None, default=None, help="Also write the results to this JSON file.")
    return parser


def progress(directory: Path, devices: int) -> list[int]:
    """The last epoch each rank reported finished (-1: none yet)."""
    epochs = []
    for rank in range(devices):
        try:
            epochs.append(int((directory / f"progress-rank{rank}").read_text().split()[0]))
        except (FileNotFoundError, IndexError, ValueError):
            epochs.append(-1)
    return epochs


def run_once(number: int, cache: Path, directory: Path, options: dict, console: Console) -> StressRun:
    """One stress fit, watched for progress; killed (and counted as a hang) if it stops moving."""
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "benchmarks.stress.fit",
        "--cache", str(cache), "--out", str(directory), "--epochs", str(options["epochs"]),
        "--devices", str(options["devices"]), "--num-workers", str(options["num_workers"]),
        "--batch-size", str(options["batch_size"]), "--multiprocessing-context", options["multiprocessing_context"],
    ] + (["--thread-churn"] if options["thread_churn"] else [])  # fmt: skip
    started = last_move = time.monotonic()
    seen = progress(directory, options["devices"])
    with open(directory / "log.txt", "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=child_environment()
        )
        hung = False
        while process.poll() is None:
            time.sleep(1.0)
            now_seen = progress(directory, options["devices"])
            if now_seen != seen:
                seen, last_move = now_seen, time.monotonic()
            elif time.monotonic() - last_move > options["hang_after"]:
                hung = True
                console.print(f"run {number}: no progress for {options['hang_after']:g} s at epochs {seen}: a hang")
                os.killpg(process.pid, signal.SIGUSR1)  # the ranks print every thread's stack into the log
                time.sleep(2.0)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        seconds = time.monotonic() - started
    return StressRun(number, progress(directory, options["devices"]), seconds, hung, process.returncode)


def stress_main(argv: list[str]) -> int:
    """Run the stress fits; exit code 0 when every run finished all its epochs on every rank."""
    console = Console()
    try:
        args = _parser().parse_args(argv)
        resolve_path_options(args, ("out", "json"))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:
        console.print(f"[red]error:[/red] {error}", highlight=False)
        return 2
    from image_edit_data.preprocess.demo_cache import write_demo_cache

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="image-edit-data-stress-"))
    cache = root / "cache"
    if not cache.exists():
        write_demo_cache(str(cache), args.samples, 0)
    options = {key: getattr(args, key) for key in (
        "epochs", "devices", "num_workers", "batch_size", "multiprocessing_context", "thread_churn", "hang_after"
    )}  # fmt: skip
    results = [run_once(n, cache, root / f"run{n}", options, console) for n in range(1, args.runs + 1)]
    table = Table(title=f"stress: {args.devices} ranks x {args.num_workers} workers, {args.epochs} epochs per run")
    for column in ("run", "epochs finished per rank", "wall s", "s per epoch change", "hang", "exit"):
        table.add_column(column)
    for result in results:
        finished = [epoch + 1 for epoch in result.epochs_per_rank]
        table.add_row(
            str(result.run), str(finished), f"{result.seconds:.1f}", f"{result.seconds_per_epoch:.3f}",
            "yes" if result.hung else "no", str(result.exit_code),
        )  # fmt: skip
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) | {"options": options} for r in results], indent=1))
    complete = all(not r.hung and r.exit_code == 0 and min(r.epochs_per_rank) + 1 == args.epochs for r in results)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(stress_main(sys.argv[1:]))
