"""Build a cache: read a source by position, resize, encode in same-size batches, write payloads, merge.

Rank `r` of `w` owns source positions `r, r + w, r + 2w, ...` below the row limit. It walks its slice
in fixed windows of `batch_size * WINDOW_BATCHES` positions, so a rerun forms the same batches as an
uninterrupted run. The next windows are read while one encodes, and the last ones written meanwhile
(`overlap.py`); the encoders see the same batches either way. A window's payloads are written first,
then its journal lines (see `journal.py`); positions already journaled are not encoded again. Rank 0
then waits until all positions are journaled (woken by the others' journal lines, or under torchrun by the
last rank's end: `rank_meeting.py`) and merges the index (`merge.py`); `merge_only` does only that.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ...payload.payload import PayloadFormat
from ..encoders.base import ImageEncoder, PromptEncoder, PromptEncoding, PromptTruncationWarning, TextEncoder
from ..sources.base import BadSampleError, EditSource, row_index_of
from .encode import PixelFeed, Prepared, encode_window, prepare, read_encoding_prompts, window_images
from .gil_gate import GilGate
from .journal import Journal, JournalReader, claim, clear_failure, write_failure
from .merge import MergeReport, merge_index, wait_for_journals
from .overlap import PIXEL_NICENESS, ReadAhead, Stopwatch, WriteBehind, lower_priority
from .rank_meeting import meet
from .resize import ResizePolicy
from .writer import EncodedSample, StoreDtype, remove_stale_temporaries, write_sample

if TYPE_CHECKING:
    from .ray_engine import RayOptions

WINDOW_BATCHES = 4
# Threads that resize the next batches' images and make their pixels while the encoder works (`PixelFeed`): with
# two, the encoder waited for them at batch size 8 on two cores.
PIXEL_THREADS = 3
# Encoded samples that may wait for the disk behind the encoder (about 4 MB each with Qwen-Image's prompt embeddings).
WRITE_BEHIND = 64
# Rank 0 acts on failure markers written up to this long before it started. Older ones are taken
# as left over from an earlier launch (each rank also deletes its own marker when it starts).
FAILURE_GRACE = 60.0
EncoderSpec = Mapping[str, Any]  # {"class_path": "package.module.Class", "init_args": {...}}


@dataclass(frozen=True)
class BuildOptions:
    """Settings of a build. Those above `on_bad_sample` fix the cache contents, so a resumed build must
    repeat them; the rest may change between runs."""

    payload_format: PayloadFormat = "pt"
    """`pt` (NeMo's torch.save layout) or `safetensors` (ours)."""
    resize: ResizePolicy = field(default_factory=ResizePolicy)
    """How images get their encoder-ready size."""
    token_patch_size: int = 2
    """Latent cells per side of one transformer token, for the stored token counts."""
    store_dtype: StoreDtype = "float32"
    """Dtype of stored latents and embeddings (the reference stores bfloat16)."""
    shard_size: int = 10_000
    """Index records per shard file."""
    num_samples: int | None = None
    """Encode only the first this many source positions."""
    allow_no_context: bool = False
    """Write examples without context images as text-to-image rows (otherwise each is a bad sample)."""
    on_bad_sample: Literal["stop", "skip"] = "stop"
    """Stop at the first bad raw example, or skip it and count it."""
    batch_size: int = 8
    """Images (of one size) or prompts per encoder call."""
    num_workers: int = 4
    """Threads that read and resize images and write payloads."""
    read_ahead: int = 16
    """Samples read and resized ahead of the encoders, in whole windows; 0 reads, encodes and writes each window
    in turn (same cache, slower)."""
    merge_timeout: float = 3600.0
    """Seconds rank 0 waits for the other ranks before giving up on merging."""
    poll_interval: float = 2.0
    """Longest wait between rank 0's looks at the other ranks' journals; a change on a local disk, or the end of
    every rank under torchrun, wakes it at once."""

    def check(self) -> None:
        """Refuse impossible values, naming the option."""
        for name in ("token_patch_size", "shard_size", "batch_size", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.read_ahead < 0:
            raise ValueError(f"read_ahead: expected a count >= 0, got {self.read_ahead}")
        if self.num_samples is not None and self.num_samples < 0:
            raise ValueError(f"num_samples: expected a count >= 0, got {self.num_samples}")


@dataclass(frozen=True)
class BuildReport:
    """What one rank did."""

    root: Path
    rank: int
    world_size: int
    assigned: int  # positions in this rank's slice
    already_done: int  # of those, journaled by an earlier run
    written: int  # payloads written by this run
    skipped: Mapping[str, int]  # bad samples skipped by this run, by reason
    seconds: float
    merged: MergeReport | None  # set on the rank that merged
    merge_only: bool = False  # nothing was encoded by request
    truncated: int = 0  # payloads written by this run whose prompt a length limit cut (each warned)
    encoder_seconds: float = 0.0  # inside encoder calls
    encoding_seconds: float = 0.0  # the encoding phase: encoders loaded, from the first read to the last journal line
    encoding_started: float = 0.0  # when it began, as time.time() (to line up ranks' phases)


def instantiate(spec: EncoderSpec, protocol: type | tuple[type, ...], name: str) -> Any:
    """Build an encoder from `{"class_path", "init_args"}` and check it has the methods of (one of) the protocols."""
    class_path = spec.get("class_path")
    if not isinstance(class_path, str) or "." not in class_path:
        raise ValueError(
            f"{name}.class_path: expected a dotted import path like package.module.Class, got {class_path!r}"
        )
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{name}.class_path: cannot import {class_path!r} ({error})") from None
    encoder = cls(**dict(spec.get("init_args") or {}))
    if not isinstance(encoder, protocol):
        names = " or ".join(p.__name__ for p in (protocol if isinstance(protocol, tuple) else (protocol,)))
        raise TypeError(f"{name}: {class_path} does not implement {names} (see preprocess/encoders/base.py)")
    return encoder


def settings_of(source: EditSource, image: EncoderSpec, text: EncoderSpec, options: BuildOptions) -> dict[str, Any]:
    """Everything that fixes the cache contents; a resumed build must match it exactly."""
    # Only when set, so builds started before the option existed resume, and their metadata.json stays as it was.
    rows = {"allow_no_context": True} if options.allow_no_context else {}
    return {
        **rows,
        "source": source.describe(),
        "row_limit": options.num_samples,
        "format": options.payload_format,
        "preprocessing_config": {
            "image_encoder": {"class_path": image["class_path"], "init_args": dict(image.get("init_args") or {})},
            "text_encoder": {"class_path": text["class_path"], "init_args": dict(text.get("init_args") or {})},
            "resize": options.resize.to_json(),
            "token_patch_size": options.token_patch_size,
            "store_dtype": options.store_dtype,
            "shard_size": options.shard_size,
        },
    }


def build_cache(
    out_dir: str | Path,
    source: EditSource,
    image_encoder: EncoderSpec,
    text_encoder: EncoderSpec,
    options: BuildOptions | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    merge_only: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] | None = None,
    engine: Literal["local", "ray"] = "local",
    ray: RayOptions | None = None,
) -> BuildReport:
    """Encode this rank's slice of `source` into `out_dir`, then (rank 0) merge the index.

    `on_progress(done, total)` follows this rank's slice; `log` receives short notes (resume, waiting).
    `engine="ray"` encodes on a Ray cluster (`ray_engine.py`, the `ray` extra) from this one process.
    Raises `BadSampleError` at the first bad example when `on_bad_sample` is `stop`.
    """
    options = options or BuildOptions()
    options.check()
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size ({world_size}), got {rank}")
    if engine == "ray" and world_size != 1:
        raise ValueError(
            f"engine: the ray engine spreads the work over its cluster from one process; got world_size {world_size} "
            f"(run it without torchrun and --world-size)"
        )
    say = log or (lambda message: None)
    started, wall_start = time.monotonic(), time.time()
    root = Path(out_dir).expanduser().resolve()
    settings = settings_of(source, image_encoder, text_encoder, options)
    if claim(root, settings):
        say(f"resuming the build in {root}")
    rows = len(source) if options.num_samples is None else min(options.num_samples, len(source))
    mine = list(range(rank, rows, world_size))
    done = SliceProgress()
    met = None
    if not merge_only:
        clear_failure(root, rank)
        if remove_stale_temporaries(root, {row_index_of(source, p) for p in mine}):
            say("removed temporary files left by an interrupted run")
        try:
            specs = (image_encoder, text_encoder)
            if engine == "ray":
                from .ray_engine import RayOptions, encode_on_ray

                done = encode_on_ray(root, source, mine, specs, options, ray or RayOptions(), on_progress, say)
            else:
                done = _encode_slice(root, rank, source, mine, specs, options, on_progress, say)
        except BaseException as error:
            message = f"{type(error).__name__}: {error}"
            write_failure(root, rank, message)
            if isinstance(error, Exception):  # the others wait for this rank's word; an interrupt ends them all
                with contextlib.suppress(Exception):
                    meet(rank, world_size, message, options.merge_timeout)
            raise
        met = meet(rank, world_size, None, options.merge_timeout)
    merged = None
    if rank == 0:
        if met:
            other, message = min(met.items())
            raise RuntimeError(f"{root}: rank {other} stopped, so the index was not merged: {message}")
        entries = wait_for_journals(
            root,
            rows,
            since=wall_start - FAILURE_GRACE,
            timeout=options.merge_timeout,
            poll_interval=options.poll_interval,
            log=say,
        )
        provenance = {
            "dataset_name": settings["source"].get("path"),
            "split": settings["source"].get("split"),
            **settings,
        }
        merged = merge_index(root, entries, rows, options.shard_size, provenance)
    seconds = time.monotonic() - started
    return BuildReport(
        root,
        rank,
        world_size,
        len(mine),
        done.already,
        done.written,
        dict(done.skipped),
        seconds,
        merged,
        merge_only,
        done.truncated,
        done.encoder_seconds,
        done.encoding_seconds,
        done.encoding_started,
    )


@dataclass
class SliceProgress:
    """What `_encode_slice` did on this rank."""

    already: int = 0  # positions an earlier run journaled
    written: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # by reason
    truncated: int = 0  # written payloads whose prompt a length limit cut
    encoder_seconds: float = 0.0  # inside encoder calls
    encoding_seconds: float = 0.0  # from the first window read to the last journal line, encoders loaded
    encoding_started: float = 0.0  # time.time() at its start


def pending_windows(mine: list[int], todo: set[int], window_size: int) -> list[list[int]]:
    """The positions of `todo`, window by window of `mine` (empty windows dropped), so a rerun batches as before."""
    windows = (
        [p for p in mine[start : start + window_size] if p in todo] for start in range(0, len(mine), window_size)
    )
    return [window for window in windows if window]


def unfinished(root: Path, mine: list[int], say: Callable[[str], None]) -> set[int]:
    """The positions of `mine` no journal holds, and those whose journaled payload has gone from the disk."""
    entries = JournalReader(root).refresh()
    redo = {
        p for p in mine if "record" in entries.get(p, {}) and not (root / entries[p]["record"]["cache_file"]).is_file()
    }
    if redo:
        say(f"{len(redo)} journaled payloads are missing on disk and will be encoded again")
    return {p for p in mine if p not in entries or p in redo}


def load_encoders(specs: tuple[EncoderSpec, EncoderSpec]) -> tuple[ImageEncoder, TextEncoder | PromptEncoder]:
    """The image and text encoders of `specs`; one pipeline encoder serves both when both specs name it."""
    image_encoder: ImageEncoder = instantiate(specs[0], ImageEncoder, "image_encoder")
    if specs[1] == specs[0] and isinstance(image_encoder, PromptEncoder):
        return image_encoder, image_encoder  # one pipeline encoder for both sides, loaded once
    return image_encoder, instantiate(specs[1], (PromptEncoder, TextEncoder), "text_encoder")


def _encode_slice(
    root: Path,
    rank: int,
    source: EditSource,
    mine: list[int],
    specs: tuple[EncoderSpec, EncoderSpec],
    options: BuildOptions,
    on_progress: Callable[[int, int], None] | None,
    say: Callable[[str], None],
) -> SliceProgress:
    """Encode the positions of `mine` no journal has yet, reading ahead of the encoders and writing behind them."""
    todo = unfinished(root, mine, say)
    done = SliceProgress(already=len(mine) - len(todo))
    progress = on_progress or (lambda done, total: None)
    progress(done.already, len(mine))
    if not todo:
        return done
    image_encoder, text_encoder = load_encoders(specs)
    factor = int(image_encoder.spatial_factor)
    options.resize.check(factor)
    window_size = options.batch_size * WINDOW_BATCHES
    windows = pending_windows(mine, todo, window_size)
    depth = math.ceil(options.read_ahead / window_size)
    started, done.encoding_started = time.monotonic(), time.time()
    # Helpers hold back their longest holds of the GIL while the encoders' thread is about to need it; nothing to
    # hold back from when nothing overlaps.
    gate = GilGate() if depth else None
    stopwatch = Stopwatch(gate)
    journal = Journal(root, rank)

    # The first window's images are resized by the pixel threads as the encoder takes their batches, so its first
    # call waits only for the window's decoding; later ones are resized when read, well ahead of the encoder.
    first_window = set(windows[0]) if depth else set()

    def read(position: int) -> Prepared | BadSampleError:
        defer = position in first_window
        return prepare(source, position, options.resize, factor, options.allow_no_context, defer_resize=defer)

    def write(sample: EncodedSample) -> dict[str, Any]:
        return write_sample(root, sample, options.payload_format, options.token_patch_size, options.store_dtype, gate)

    def finish(records: list[dict[str, Any]], encoded: list[EncodedSample], lines: list[dict[str, Any]]) -> int:
        lines = lines + [{"position": e.source.position, "record": r} for e, r in zip(encoded, records)]
        journal.append(sorted(lines, key=lambda line: line["position"]))
        return len(records)

    with (
        ThreadPoolExecutor(options.num_workers, thread_name_prefix="build-io", initializer=lower_priority) as pool,
        ThreadPoolExecutor(
            PIXEL_THREADS, thread_name_prefix="build-pixels", initializer=lower_priority, initargs=(PIXEL_NICENESS,)
        ) as feeder,
        # Not lowered: the encoders' thread waits on it at each window's start, and it mostly waits itself.
        ThreadPoolExecutor(1, thread_name_prefix="build-plan") as planner,
    ):
        reader = ReadAhead(pool, windows, read, depth)
        # Up to WRITE_BEHIND samples (at least two windows) may wait for the disk; none when nothing overlaps.
        writer = WriteBehind(pool, backlog=max(2, WRITE_BEHIND // window_size) if depth else 0)
        reported, reported_positions = 0, done.already  # windows whose journal lines are written, and positions

        def pixel_feed(loaded: list[Prepared | BadSampleError]) -> PixelFeed:
            """The pixels of a window's good samples, their first batches started now."""
            good = [item for item in loaded if isinstance(item, Prepared)]
            return PixelFeed(window_images(good), options.batch_size, feeder, gate=gate)

        def take(k: int) -> tuple[list[Prepared | BadSampleError], PixelFeed]:
            """Window `k` once read, with its first pixel batches started."""
            loaded = reader.take(k)
            return loaded, pixel_feed(loaded)

        try:
            upcoming: Future[tuple[list[Prepared | BadSampleError], PixelFeed]] | None = None
            for k, window in enumerate(windows):
                following = bool(depth) and k + 1 < len(windows)
                feed: PixelFeed | None = None
                prompts: list[PromptEncoding] = []
                if upcoming is not None:
                    # Awaited on the planner's thread while the window before encoded: its reads raise here, in
                    # their turn, once the windows before it are written.
                    loaded, feed = upcoming.result()
                    upcoming = planner.submit(take, k + 1) if following else None
                elif depth:  # the first window, which nothing overlaps: its prompts are encoded as it is read
                    reads = reader.futures(k)
                    upcoming = planner.submit(take, k + 1) if following else None  # after this window's reads
                    loaded, prompts = read_encoding_prompts(reads, text_encoder, options.batch_size, stopwatch)
                    feed = pixel_feed(loaded)
                else:
                    loaded = reader.take(k)
                bad = [(item, p) for item, p in zip(loaded, window) if isinstance(item, BadSampleError)]
                if bad and options.on_bad_sample == "stop":
                    raise bad[0][0]
                good = [item for item in loaded if isinstance(item, Prepared)]
                encoded = encode_window(
                    good, image_encoder, text_encoder, options.batch_size, factor, feed, stopwatch, prompts
                )
                for sample in encoded:
                    if sample.prompt_truncations:
                        done.truncated += 1
                        warn_truncation(sample, done.truncated)
                skipped = []
                for item, position in bad:
                    done.skipped[item.kind] += 1
                    problem = {"location": item.location, "kind": item.kind, "problem": item.problem}
                    skipped.append(
                        {"position": position, "skipped": {"row_index": row_index_of(source, position), **problem}}
                    )
                writer.put(
                    [functools.partial(write, e) for e in encoded],
                    functools.partial(finish, encoded=encoded, lines=skipped),
                )
                while reported < len(writer.finished):  # a running count: a long build has many windows
                    reported_positions += len(windows[reported])
                    reported += 1
                    progress(reported_positions, len(mine))
            writer.drain()
        except BaseException:
            planner.shutdown(cancel_futures=True)  # before the reads are dropped: it may be waiting on them
            reader.cancel()
            writer.abandon()
            raise
        finally:
            journal.close()
    progress(len(mine), len(mine))
    done.written = sum(writer.finished)
    done.encoder_seconds = stopwatch.seconds
    done.encoding_seconds = time.monotonic() - started
    return done


def warn_truncation(sample: EncodedSample, count: int) -> None:
    """One `PromptTruncationWarning` for a sample whose prompt was cut; `count` numbers them on this rank."""
    cuts = "; ".join(t.describe() for t in sample.prompt_truncations)
    warn_cut(sample.source.location, sample.source.sample.sample_id, cuts, count)


def warn_cut(location: str, sample_id: str, cuts: str, count: int) -> None:
    """The warning of `warn_truncation`, from its parts (`cuts`: the truncations described)."""
    warnings.warn(
        PromptTruncationWarning(
            f"{location} (id {sample_id!r}): prompt cut: {cuts}; the dropped tokens are the end "
            f"of the prompt. Recorded in the payload's metadata.prompt_truncation (prompt {count} cut by this rank)"
        ),
        stacklevel=3,
    )
