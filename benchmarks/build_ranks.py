"""Whether N ranks on N cores build N times as fast as one rank on one core, in the encoding phase.

Runs one rank pinned to core 0, then N ranks launched together (torch.distributed's environment, as torchrun
sets it), rank r pinned to core r, each with one torch thread and CPU-bound stand-in encoders (`busy`: they keep
their core working as a CPU encoder would). Every rank reads, resizes, encodes and writes on its own core.
Prints each rank's rate in its encoding phase, the N ranks' rate (all samples over the span from the first
rank's start to the last rank's end of that phase) and that rate over N times the one rank's: the target is
at least 0.85. Run it on a machine whose N cores are otherwise idle.

    python -m benchmarks.build_ranks --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import child_environment

HERE = Path(__file__).resolve().parent


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=os.cpu_count() or 1, help="Ranks, one core each.")
    parser.add_argument("--samples-per-rank", type=int, default=64)
    parser.add_argument("--size", default="1216x912", help="Raw image size (resized to 1 MP).")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--vae-image-ms", type=float, default=18.0, help="CPU time per image of the stand-in VAE.")
    parser.add_argument("--text-prompt-ms", type=float, default=13.0, help="CPU time per prompt of the text stand-in.")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "image-edit-data-bench-build")
    return parser.parse_args()


def worker(out: str, manifest: str, rank: int, world_size: int, core: int, options: dict[str, Any]) -> None:
    """One rank on one core: build its slice and print its report as JSON."""
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    from image_edit_data.preprocess.run.build_cache import BuildOptions, build_cache
    from image_edit_data.preprocess.run.resize import ResizePolicy
    from image_edit_data.preprocess.sources.manifest import JsonlManifestSource

    image = {
        "class_path": "benchmarks.build_standins.StandInImageEncoder",
        "init_args": {"image_ms": options["vae_image_ms"], "busy": True},
    }
    text = {
        "class_path": "benchmarks.build_standins.StandInPromptEncoder",
        "init_args": {"prompt_ms": options["text_prompt_ms"], "busy": True},
    }
    build = BuildOptions(
        resize=ResizePolicy("max_pixels_floor", max_pixels=1024 * 1024, spatial_alignment=32, upscale=True),
        store_dtype="bfloat16",
        batch_size=options["batch_size"],
        num_samples=options["samples"],
    )
    report = build_cache(out, JsonlManifestSource(manifest), image, text, build, rank=rank, world_size=world_size)
    print(json.dumps({k: getattr(report, k) for k in ("written", "encoding_started", "encoding_seconds")}))


def launch(out: Path, manifest: Path, world_size: int, options: dict[str, Any]) -> list[dict[str, float]]:
    """`world_size` ranks at once, rank r on core r; their reports."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**child_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.update(WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.build_ranks",
                "--worker",
                json.dumps([str(out), str(manifest), r, world_size, r, options]),
            ],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world_size)
    ]
    reports = [json.loads(process.communicate()[0].strip().splitlines()[-1]) for process in ranks]
    if any(process.returncode for process in ranks):
        raise SystemExit("a rank failed")
    return reports


def main() -> None:
    args = parse()
    from benchmarks.build_data import edit_manifest

    cores = sorted(os.sched_getaffinity(0))
    if args.ranks > len(cores):
        raise SystemExit(f"--ranks {args.ranks}: this process may use {len(cores)} cores")
    width, _, height = args.size.partition("x")
    args.data.mkdir(parents=True, exist_ok=True)
    manifest = edit_manifest(args.data, args.samples_per_rank * args.ranks, (int(width), int(height)))
    options = {k: getattr(args, k) for k in ("batch_size", "vae_image_ms", "text_prompt_ms")}
    root = Path(tempfile.mkdtemp(prefix="build-ranks-", dir=args.data))
    try:
        (one,) = launch(root / "one", manifest, 1, {**options, "samples": args.samples_per_rank})
        many = launch(root / "many", manifest, args.ranks, {**options, "samples": args.samples_per_rank * args.ranks})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    single = one["written"] / one["encoding_seconds"]
    span = max(r["encoding_started"] + r["encoding_seconds"] for r in many) - min(r["encoding_started"] for r in many)
    together = sum(r["written"] for r in many) / span
    print(f"1 rank on 1 core: {single:.2f} samples/s ({one['written']} samples, {one['encoding_seconds']:.1f} s)")
    for rank, report in enumerate(many):
        print(f"rank {rank}/{args.ranks}: {report['written'] / report['encoding_seconds']:.2f} samples/s")
    print(
        f"{args.ranks} ranks on {args.ranks} cores: {together:.2f} samples/s over {span:.1f} s = "
        f"{together / (args.ranks * single):.2f} x {args.ranks} x one rank's rate (target >= 0.85)"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(*json.loads(sys.argv[2]))
    else:
        main()
