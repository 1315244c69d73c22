"""`cache build --engine ray`: the same build on a Ray cluster, through Ray Data.

The positions are cut into the windows a single-process build forms (rank 0 of 1), and each window flows
through three stages: read and resize in CPU tasks, encode in a pool of actors that load the encoders
once (a GPU each when the cluster has GPUs), write the payloads in CPU tasks. The driver journals each
window as its records stream back, then merges the index as any build does. So the batches, and with
them the cache, are the single-process build's, and a build started on one engine finishes on the other.

Ray retries a task whose worker died and restarts a dead actor, redoing its window: the window's payloads
land under the same names (each write is atomic), and the driver journals a position only once, so
nothing is duplicated or lost. A rerun after a stopped job reads the journal and skips what it holds.
The cache directory must be one file system for the driver and every worker (a shared mount on a cluster).
Ray is imported here only, when this engine runs (the `ray` extra).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...payload.payload import save_payload
from ..sources.base import BadSampleError, EditSource, row_index_of
from .build_cache import (
    WINDOW_BATCHES,
    BuildOptions,
    EncoderSpec,
    SliceProgress,
    load_encoders,
    pending_windows,
    unfinished,
    warn_cut,
)
from .encode import Prepared, encode_window, prepare
from .journal import Journal
from .overlap import Stopwatch
from .writer import assemble

RAY_EXTRA = "pip install 'image-edit-data[ray]'"


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide a Ray build runs."""

    address: str | None = None
    """The cluster (`ray.init`'s address): None joins the one RAY_ADDRESS names, else starts one on this machine;
    `auto` joins the one running on this machine."""
    encoders: int | None = None
    """Encoder actors; default one per GPU of the cluster, or one without GPUs."""
    gpus_per_encoder: float | None = None
    """GPUs each encoder actor holds; default 1 when the cluster has GPUs, else 0."""
    cpus_per_encoder: float = 1.0
    """CPUs each encoder actor holds (its torch threads)."""
    num_cpus: int | None = None
    """CPUs of a cluster started here (default: all of this machine's)."""


def import_ray() -> Any:
    """The `ray` module with Ray Data, or an error naming the extra that brings it."""
    try:
        import ray
        import ray.data
    except ImportError as error:
        raise ImportError(f"--engine ray needs Ray Data, which cannot be imported ({error}); {RAY_EXTRA}") from None
    return ray


@dataclass(frozen=True)
class Reading:
    """A read task: prepare each position of a window (read, resize), or say why it is bad."""

    source: EditSource
    options: BuildOptions
    factor: int

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        resize, allow = self.options.resize, self.options.allow_no_context
        items = [(p, prepare(self.source, p, resize, self.factor, allow)) for p in row["positions"]]
        return {"window": row["window"], "items": items}


class Encoding:
    """An encoder actor: loads the encoders once, then encodes windows and assembles their payloads."""

    def __init__(self, specs: tuple[EncoderSpec, EncoderSpec], options: BuildOptions) -> None:
        self.image_encoder, self.text_encoder = load_encoders(specs)
        self.factor = int(self.image_encoder.spatial_factor)
        self.options = options

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        good = [item for _, item in row["items"] if isinstance(item, Prepared)]
        stopwatch = Stopwatch()
        encoded = encode_window(
            good, self.image_encoder, self.text_encoder, self.options.batch_size, self.factor, stopwatch=stopwatch
        )
        written = []
        for sample in encoded:
            payload, record = assemble(
                sample, self.options.payload_format, self.options.token_patch_size, self.options.store_dtype
            )
            written.append(
                {
                    "position": sample.source.position,
                    "payload": payload,
                    "record": record,
                    "cuts": "; ".join(t.describe() for t in sample.prompt_truncations),
                    "where": (sample.source.location, sample.source.sample.sample_id),
                }
            )
        bad = [(p, item) for p, item in row["items"] if isinstance(item, BadSampleError)]
        return {"written": written, "bad": bad, "encoder_seconds": stopwatch.seconds}


@dataclass(frozen=True)
class Writing:
    """A write task: each payload of a window, atomically, under the cache directory."""

    root: str

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        for item in row["written"]:
            save_payload(Path(self.root) / item["record"]["cache_file"], item["payload"])
            del item["payload"]  # on disk now: the driver needs the record only
        return row


def spatial_factor(ray: Any, spec: EncoderSpec, resources: dict[str, Any]) -> int:
    """The image encoder's spatial factor: its class attribute if it has one, else asked of one built on the cluster."""
    module, _, name = str(spec.get("class_path")).rpartition(".")
    declared = getattr(getattr(importlib.import_module(module), name, None), "spatial_factor", None)
    if isinstance(declared, int):
        return declared
    probe = ray.remote(lambda: int(load_encoders((spec, spec))[0].spatial_factor))
    return int(ray.get(probe.options(**resources).remote()))


def start_ray(ray_options: RayOptions) -> Any:
    """The `ray` module, joined to the cluster (or a new one on this machine, which ends with this process) unless
    this process already is."""
    ray = import_ray()
    if not ray.is_initialized():
        local = {"num_cpus": ray_options.num_cpus} if ray_options.num_cpus is not None else {}
        ray.init(address=ray_options.address, include_dashboard=False, **local)
    return ray


def encode_on_ray(
    root: Path,
    source: EditSource,
    mine: list[int],
    specs: tuple[EncoderSpec, EncoderSpec],
    options: BuildOptions,
    ray_options: RayOptions,
    on_progress: Callable[[int, int], None] | None,
    say: Callable[[str], None],
) -> SliceProgress:
    """Encode the positions of `mine` no journal has yet on a Ray cluster; journal each window as it returns."""
    todo = unfinished(root, mine, say)
    done = SliceProgress(already=len(mine) - len(todo))
    progress = on_progress or (lambda done, total: None)
    progress(done.already, len(mine))
    if not todo:
        return done
    windows = pending_windows(mine, todo, options.batch_size * WINDOW_BATCHES)
    ray = start_ray(ray_options)
    gpus = float(ray.cluster_resources().get("GPU", 0))
    per_encoder = ray_options.gpus_per_encoder if ray_options.gpus_per_encoder is not None else float(gpus > 0)
    encoders = ray_options.encoders or (max(1, int(gpus // per_encoder)) if per_encoder else 1)
    resources = {"num_cpus": ray_options.cpus_per_encoder, "num_gpus": per_encoder}
    factor = spatial_factor(ray, specs[0], resources)
    options.resize.check(factor)
    say(f"encoding {len(todo)} samples on Ray: {encoders} encoder actor(s), {per_encoder:g} GPU each")
    ray.data.DataContext.get_current().enable_progress_bars = False
    started, done.encoding_started = time.monotonic(), time.time()
    rows = [{"window": k, "positions": window} for k, window in enumerate(windows)]
    dataset = (
        ray.data.from_items(rows, override_num_blocks=len(rows))
        .map(Reading(source, options, factor), num_cpus=1)
        .map(
            Encoding,
            fn_constructor_args=(specs, options),
            compute=ray.data.ActorPoolStrategy(size=encoders),
            # A killed encoder comes back and redoes its window. Said here, not left to Ray Data's defaults, these
            # arguments also keep the reads in CPU tasks of their own: Ray Data runs a task stage inside the
            # actors after it when the two stages' remote arguments match.
            max_restarts=-1,
            max_task_retries=-1,
            **resources,
        )
        .map(Writing(str(root)), num_cpus=1)
    )
    journal = Journal(root, 0)
    journaled: set[int] = set()
    try:
        for row in dataset.iter_rows():
            journal.append(window_lines(source, row, options, journaled, done))
            done.encoder_seconds += float(row["encoder_seconds"])
            progress(done.already + len(journaled), len(mine))
    finally:
        journal.close()
    done.encoding_seconds = time.monotonic() - started
    return done


def window_lines(
    source: EditSource, row: dict[str, Any], options: BuildOptions, journaled: set[int], done: SliceProgress
) -> list[dict[str, Any]]:
    """A finished window's journal lines, leaving out positions already journaled (a window Ray redid); counts
    what it holds into `done` and warns of each cut prompt. Raises the first bad sample when asked to stop."""
    bad = [(p, error) for p, error in row["bad"] if p not in journaled]
    if bad and options.on_bad_sample == "stop":
        raise min(bad, key=lambda item: item[0])[1]
    lines = []
    for item in row["written"]:
        if item["position"] in journaled:
            continue
        lines.append({"position": item["position"], "record": item["record"]})
        done.written += 1
        if item["cuts"]:
            done.truncated += 1
            location, sample_id = item["where"]
            warn_cut(location, sample_id, item["cuts"], done.truncated)
    for position, error in bad:
        done.skipped[error.kind] += 1
        problem = {"location": error.location, "kind": error.kind, "problem": error.problem}
        lines.append({"position": position, "skipped": {"row_index": row_index_of(source, position), **problem}})
    journaled.update(line["position"] for line in lines)
    return sorted(lines, key=lambda line: line["position"])
