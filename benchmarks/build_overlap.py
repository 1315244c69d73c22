"""How close a cache build runs to the speed of its encoders: wall time / encoder time.

Builds a manifest of photo-sized images with stand-in encoders of set latency (`build_standins.py`), once with
nothing overlapped (`read_ahead=0`: read, encode, write each window in turn) and once as shipped, at each batch
size, and prints the encoding phase's wall time over the encoders' time: the latencies the stand-ins were asked
for, which a GPU would take (1.00 = encoder-bound). "in calls" is the time the build measured inside encoder
calls, longer when a busy machine wakes the sleeping thread late. "after fill" leaves out the start, before the
first encoder call, when the first prompt batch's samples are read with nothing to overlap them: the rate a long
build settles at. Builds of one machine's run vary by a few hundredths: `--rounds 3` prints each row's median.

    python -m benchmarks.build_overlap                      # H100-class latencies, batch 1 and 8
    python -m benchmarks.build_overlap --vae-call-ms 50 --vae-image-ms 0 --text-call-ms 50 --text-prompt-ms 0
    python -m benchmarks.build_overlap readers              # threads against processes for reading and resizing
    python -m benchmarks.build_overlap wakes                # how late a sleeping thread wakes beside one build step
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks import build_standins
from benchmarks.build_data import edit_manifest
from image_edit_data.preprocess.run.build_cache import BuildOptions, build_cache
from image_edit_data.preprocess.run.encode import prepare
from image_edit_data.preprocess.run.resize import ResizePolicy
from image_edit_data.preprocess.sources.manifest import JsonlManifestSource

HERE = Path(__file__).resolve().parent
# The shipped Qwen-Image-Edit config's resize and storage (configs/cache/qwen_image_edit.yaml).
RESIZE = ResizePolicy("max_pixels_floor", max_pixels=1024 * 1024, spatial_alignment=32, upscale=True)


def size_arg(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    return int(width), int(height)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="build", choices=["build", "readers", "wakes"])
    parser.add_argument("--samples", type=int, default=192, help="Samples per build (a target and a context each).")
    parser.add_argument("--size", type=size_arg, default=(1216, 912), help="Raw image size, resized to 1 MP.")
    parser.add_argument("--image-format", default="jpeg", choices=["jpeg", "png", "webp"])
    parser.add_argument("--payload-format", default="pt", choices=["pt", "safetensors"], help="pt: the shipped one.")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="8 is the shipped config's.")
    parser.add_argument("--modes", nargs="+", default=["serial", "overlapped"], choices=["serial", "overlapped"])
    parser.add_argument("--rounds", type=int, default=1, help="Builds per row; the median is printed.")
    parser.add_argument("--vae-call-ms", type=float, default=2.0)
    parser.add_argument("--vae-image-ms", type=float, default=18.0, help="Per 1 MP image (see the docs' derivation).")
    parser.add_argument("--text-call-ms", type=float, default=8.0)
    parser.add_argument("--text-prompt-ms", type=float, default=13.0)
    parser.add_argument("--tokens", type=int, default=250, help="Prompt tokens the stand-in text encoder returns.")
    parser.add_argument("--num-workers", type=int, default=4, help="The build's read/write threads.")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "image-edit-data-bench-build")
    return parser.parse_args()


def specs(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    image = {
        "class_path": "benchmarks.build_standins.StandInImageEncoder",
        "init_args": {"call_ms": args.vae_call_ms, "image_ms": args.vae_image_ms},
    }
    text = {
        "class_path": "benchmarks.build_standins.StandInPromptEncoder",
        "init_args": {"call_ms": args.text_call_ms, "prompt_ms": args.text_prompt_ms, "tokens": args.tokens},
    }
    return image, text


def one_build(args: argparse.Namespace, manifest: Path, batch_size: int, read_ahead: int | None) -> dict[str, float]:
    """Build once into a fresh directory: the encoding phase's wall seconds, the encoders' (asked and measured in
    calls), the span from the first encoder call on over the encoders' time, CPU ms per sample."""
    options = BuildOptions(
        resize=RESIZE,
        store_dtype="bfloat16",
        payload_format=args.payload_format,
        batch_size=batch_size,
        num_workers=args.num_workers,
        **({} if read_ahead is None else {"read_ahead": read_ahead}),
    )
    out = Path(tempfile.mkdtemp(prefix="build-overlap-", dir=args.data))
    build_standins.CALLS.update(asked=0.0, first=None)
    try:
        cpu = time.process_time()
        report = build_cache(out, JsonlManifestSource(manifest), *specs(args), options)
        ended, cpu = time.perf_counter(), time.process_time() - cpu
    finally:
        shutil.rmtree(out, ignore_errors=True)
    asked, first = build_standins.CALLS["asked"] or 0.0, build_standins.CALLS["first"] or 0.0
    return {
        "phase": report.encoding_seconds,
        "encoder": report.encoder_seconds,
        "asked": asked,
        "steady": (ended - first) / asked,
        "cpu_ms": 1000 * cpu / report.written,
    }


def run_builds(args: argparse.Namespace) -> None:
    manifest = edit_manifest(args.data, args.samples, args.size, args.image_format)
    sys.stdout.write(
        f"{args.samples} samples of 2 images {args.size[0]}x{args.size[1]} {args.image_format} -> 1 MP, "
        f"bf16 {args.payload_format} payloads; "
        f"VAE {args.vae_call_ms:g} + {args.vae_image_ms:g}/image ms, text {args.text_call_ms:g} + "
        f"{args.text_prompt_ms:g}/prompt ms; {args.num_workers} I/O threads, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}\n\n"
    )
    columns = ("batch", 5), ("mode", 10), ("phase s", 8), ("encoder s", 9), ("in calls s", 10), ("wall/enc", 8)
    columns += (("after fill", 10),)
    sys.stdout.write(" ".join(f"{name:>{width}}" for name, width in columns) + " CPU ms/sample\n")
    for batch_size in args.batch_sizes:
        for mode in args.modes:
            runs = [one_build(args, manifest, batch_size, 0 if mode == "serial" else None) for _ in range(args.rounds)]
            phase = statistics.median(r["phase"] for r in runs)
            encoder = statistics.median(r["encoder"] for r in runs)
            asked = statistics.median(r["asked"] for r in runs)
            ratio = statistics.median(r["phase"] / r["asked"] for r in runs)
            steady = statistics.median(r["steady"] for r in runs)
            cpu = statistics.median(r["cpu_ms"] for r in runs)
            sys.stdout.write(
                f"{batch_size:>5} {mode:>10} {phase:>8.2f} {asked:>9.2f} {encoder:>10.2f} {ratio:>8.3f} "
                f"{steady:>10.3f} {cpu:>13.1f}\n"
            )
            sys.stdout.flush()


_SOURCE: JsonlManifestSource | None = None


def _open(manifest: str) -> None:
    global _SOURCE
    _SOURCE = JsonlManifestSource(manifest)


def _prepare(position: int) -> Any:
    assert _SOURCE is not None
    return prepare(_SOURCE, position, RESIZE, 8)


def time_readers(pool: Executor, samples: int) -> float:
    list(pool.map(_prepare, range(min(4, samples))))  # start the workers first
    started = time.perf_counter()
    list(pool.map(_prepare, range(samples)))
    return samples / (time.perf_counter() - started)


def run_readers(args: argparse.Namespace) -> None:
    """Samples/s of reading and resizing in threads and in processes (results sent back, as a reader must)."""
    manifest = edit_manifest(args.data, args.samples, args.size, args.image_format)
    _open(str(manifest))
    sys.stdout.write(f"{args.samples} samples of 2 images {args.size[0]}x{args.size[1]} {args.image_format}\n")
    for workers in sorted({1, 2, args.num_workers}):
        with ThreadPoolExecutor(workers) as threads:
            in_threads = time_readers(threads, args.samples)
        context = multiprocessing.get_context("forkserver")
        with ProcessPoolExecutor(workers, context, initializer=_open, initargs=(str(manifest),)) as processes:
            in_processes = time_readers(processes, args.samples)
        sys.stdout.write(
            f"{workers} workers: threads {in_threads:.1f} samples/s, processes {in_processes:.1f} samples/s\n"
        )


def late_wakes(step: Callable[[], object] | None, sleeps: int = 400, seconds: float = 0.01) -> list[float]:
    """Milliseconds past each of `sleeps` sleeps of `seconds` that this thread resumed, with another thread doing
    `step` over and over (1 ms apart) meanwhile: the wait for the GIL that the step holds, and for a core."""
    stop = threading.Event()

    def repeat() -> None:
        while step is not None and not stop.is_set():
            step()
            time.sleep(0.001)

    helper = threading.Thread(target=repeat)
    helper.start()
    time.sleep(0.2)
    late = []
    for _ in range(sleeps):
        started = time.perf_counter()
        time.sleep(seconds)
        late.append(1000 * (time.perf_counter() - started - seconds))
    stop.set()
    helper.join()
    return sorted(late)


def run_wakes(args: argparse.Namespace) -> None:
    """How late the encoders' thread resumes from a wait while another thread does one of the build's steps."""
    from image_edit_data.payload.payload import save_payload

    width, height = RESIZE.output_size(args.size, 8)
    image = Image.new("RGB", (width, height))
    embeddings = torch.zeros(250, 3584, dtype=torch.bfloat16)
    folder = Path(tempfile.mkdtemp(prefix="wakes-", dir=args.data))
    steps: dict[str, Callable[[], object] | None] = {
        "nothing": None,
        "save a payload (torch.save)": lambda: save_payload(folder / "p.pt", {"prompt_embeds": embeddings}),
        "an image to an array": lambda: np.asarray(image),
        "resize an image": lambda: image.resize((width - 32, height - 32), Image.Resampling.LANCZOS),
    }
    sys.stdout.write(f"10 ms sleeps, 400 each; image {width}x{height}; {os.cpu_count()} CPUs\n")
    sys.stdout.write(f"{'beside':>28} {'mean ms':>8} {'median':>7} {'p90':>6} {'p99':>6}\n")
    for name, step in steps.items():
        late = late_wakes(step)
        mean, median, p90, p99 = statistics.mean(late), late[len(late) // 2], late[360], late[396]
        sys.stdout.write(f"{name:>28} {mean:>8.3f} {median:>7.3f} {p90:>6.3f} {p99:>6.3f}\n")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    arguments = parse()
    arguments.data.mkdir(parents=True, exist_ok=True)
    {"readers": run_readers, "wakes": run_wakes, "build": run_builds}[arguments.what](arguments)
