"""Time loader worker start-up per start method, as a training script sees it.

For each `multiprocessing_context`, a fresh process that has imported Lightning (as a training
script has) builds our loader with `--num-workers` workers and times:
- the first pool's start (up to the first batch; for "forkserver" this includes starting the server),
- a second pool's start in the same process (a validation loader, a resume),
- an epoch change on a running pool (the next pass's first batch),
each the median of `--rounds` fresh processes. Prints a table; `--json` keeps the numbers.

    python -m benchmarks.worker_start [--rounds 5] [--num-workers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import sys, time, json
import lightning.pytorch  # what a training script has loaded when its loaders start
from image_edit_data import ImageEditDataloaderConfig

def first_batch_seconds(loader):
    started = time.perf_counter()
    next(iter(loader))
    return time.perf_counter() - started

def main():
    cache, start, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = ImageEditDataloaderConfig(cache_dir=cache, num_workers=workers, multiprocessing_context=start)
    build = dict(dp_rank=0, dp_world_size=1, batch_size=2)
    first = config.build(**build)
    first_pool = first_batch_seconds(first.dataloader)
    epoch_change = first_batch_seconds(first.dataloader)  # the next pass on the same pool
    second = config.build(**build)
    second_pool = first_batch_seconds(second.dataloader)
    print(json.dumps({"first_pool": first_pool, "second_pool": second_pool, "epoch_change": epoch_change}))

if __name__ == "__main__":
    main()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--starts", nargs="+", default=["fork", "forkserver", "spawn"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from image_edit_data.preprocess.demo_cache import write_demo_cache

    root = Path(tempfile.mkdtemp(prefix="worker-start-"))
    write_demo_cache(str(root / "cache"), 16, 0)
    script = root / "child.py"
    script.write_text(CHILD)
    results: dict[str, dict[str, float]] = {}
    for start in args.starts:
        rounds = []
        for _ in range(args.rounds):
            command = [sys.executable, str(script), str(root / "cache"), start, str(args.num_workers)]
            began = time.perf_counter()
            out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
            rounds.append(json.loads(out.stdout.strip().splitlines()[-1]) | {"process": time.perf_counter() - began})
        results[start] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"worker start-up, {args.num_workers} workers, median of {args.rounds} fresh processes (seconds)")
    print(f"{'start':<12}{'first pool':>12}{'second pool':>13}{'epoch change':>14}{'whole process':>15}")
    for start, numbers in results.items():
        print(
            f"{start:<12}{numbers['first_pool']:>12.3f}{numbers['second_pool']:>13.3f}"
            f"{numbers['epoch_change']:>14.3f}{numbers['process']:>15.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
