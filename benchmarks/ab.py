"""Interleaved A/B of read-path variants: `image-edit-data bench` in a fresh process per variant and round.

Usage: python -m benchmarks.ab ROUNDS CACHE... [-- BENCH OPTIONS]

Each variant is a set of environment variables read once per process. Every round runs every
variant once, in an order rotated round by round, so a slow spell of the shared machine hits them
alike. Prints, per cache and worker count, each variant's median samples/s, its median CPU ms per
sample (the training process and its workers), and how many rounds each variant won against the
first one. Variants are given as NAME=VAR=VALUE,VAR=VALUE in AB_VARIANTS (space separated); the
default compares the private `.pt` path with the public one. Two versions of the code compare as
`old=PYTHONPATH=<checkout>/src new=PYTHONPATH=src`; the setting AB_ARGS adds bench options to one
variant (`unchecked=AB_ARGS=--no-checksums`, several joined by `+`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

# The A/B recorded in docs/performance.md also had IMAGE_EDIT_DATA_PUBLIC_MEMORY, removed with the private calls.
DEFAULT_VARIANTS = "private=IMAGE_EDIT_DATA_PUBLIC_PT=0 public=IMAGE_EDIT_DATA_PUBLIC_PT=1"


def variants() -> list[tuple[str, dict[str, str]]]:
    """The variants: (name, environment overrides)."""
    found = []
    for spec in os.environ.get("AB_VARIANTS", DEFAULT_VARIANTS).split():
        name, _, settings = spec.partition("=")
        found.append((name, dict(setting.split("=", 1) for setting in settings.split(",") if setting)))
    return found


def main(argv: list[str]) -> None:
    rounds = int(argv[0])
    split = argv.index("--") if "--" in argv else len(argv)
    caches, options = argv[1:split], argv[split + 1 :]
    named = variants()
    rates: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    cpu: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "run.json")
        for round_number in range(rounds):
            for cache in caches:
                shift = round_number % len(named)
                for name, overrides in named[shift:] + named[:shift]:
                    settings = dict(overrides)
                    extra = [arg for arg in settings.pop("AB_ARGS", "").split("+") if arg]
                    command = [sys.executable, "-m", "image_edit_data", "bench", cache, "--json", out, *options, *extra]
                    subprocess.run(command, env={**os.environ, **settings}, check=True, capture_output=True)
                    with open(out) as handle:
                        for run in json.load(handle)["runs"]:
                            if run["loader"] == "ours":
                                rates[(cache, run["num_workers"], name)].append(run["samples_s"])
                                if run.get("cpu_ms_per_sample") is not None:
                                    cpu[(cache, run["num_workers"], name)].append(run["cpu_ms_per_sample"])
            print(f"round {round_number + 1}/{rounds} done", file=sys.stderr, flush=True)
    print(json.dumps({f"{c}|{w}|{n}": r for (c, w, n), r in rates.items()}), file=sys.stderr)
    first = named[0][0]
    print(f"| cache | workers | {' | '.join(n for n, _ in named)} | CPU ms/sample | wins vs {first} |")
    print("| --- | ---: |" + " ---: |" * len(named) + " ---: | --- |")
    for cache in caches:
        workers = sorted({w for (c, w, _) in rates if c == cache})
        for count in workers:
            medians = [statistics.median(rates[(cache, count, n)]) for n, _ in named]
            base = rates[(cache, count, first)]
            wins = [
                f"{n} {sum(x > y for x, y in zip(rates[(cache, count, n)], base))}/{len(base)}" for n, _ in named[1:]
            ]
            cells = " | ".join(f"{m:,.0f} ({m / medians[0]:.2f})" for m in medians)
            spent = " / ".join(
                f"{statistics.median(cpu[(cache, count, n)]):.2f}" if cpu[(cache, count, n)] else "-" for n, _ in named
            )
            print(f"| {os.path.basename(cache)} | {count} | {cells} | {spent} | {', '.join(wins)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
