"""One measurement of `bench versus-litdata`, in a fresh process: one loader, a cold epoch, warm epochs, a data check.

    python -m benchmarks.versus_litdata.versus_one '<Measurement as JSON>'

prints the result as one JSON line. A fresh process per measurement gives every cold epoch the
same start (no imports or pools left from the previous loader) and keeps each loader's clients
apart (obstore's runtime must not be running in a process that later forks workers). Epoch 1 is
timed from building the loader (index open, the pool's start and, remote, the index download into a
fresh local directory) to its last batch; imports come before it (ours with workers: the fork
server's too, `import_clients`); later epochs from `iter()` to their last batch. CPU counts this
process and its whole tree of workers (`tree_cpu.py`); the S3 server's CPU is read from its process.
After the timed epochs, the first `verify_batches` batches of one more epoch are digested per sample.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from image_edit_data.bench.measure import process_cpu_seconds

from .sample_digest import our_rows, sample_digest
from .tree_cpu import tree_cpu_seconds

System = Literal["ours", "litdata"]
Layout = Literal["files", "packed", "shard_cache", "range", "litdata"]
Where = Literal["local", "s3"]
Rows = Callable[[Any], Iterator[tuple[int, Sequence[torch.Tensor]]]]


@dataclass(frozen=True)
class Measurement:
    """What one measurement reads, and how."""

    system: System
    layout: Layout
    where: Where
    source: str  # a directory or s3:// URL
    workers: int
    batch_size: int
    epochs: int  # the cold epoch and epochs - 1 warm ones
    local_dir: str  # fresh per measurement: our index copies and shard cache, litdata's chunk cache
    round: int = 0
    storage_options: dict[str, Any] | None = None  # ours: fsspec style; litdata: boto3 client arguments
    server_pid: int | None = None
    endpoint: str = ""  # S3: the server ("moto" or "rclone", local_s3.py)
    shard_window: int = 2
    verify_batches: int = 2
    server_in_clock: bool = False  # ours with workers: start the fork server inside the cold epoch, not before it


@dataclass
class Epoch:
    """One timed epoch: samples, wall seconds, and CPU seconds of the loader's process tree and of the server."""

    samples: int
    seconds: float
    first_batch_seconds: float
    cpu_seconds: float
    server_cpu_seconds: float


@dataclass
class Result:
    """A measurement's epochs and the digests of the samples it checked."""

    measurement: Measurement
    epochs: list[Epoch] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)
    server_start_seconds: float = 0.0  # ours with workers: the fork server's start and imports, before the clock


class Clock:
    """Wall time, the loader tree's CPU and the server's CPU, read together."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid

    def read(self) -> tuple[float, float, float]:
        server = process_cpu_seconds(self.server_pid) if self.server_pid else None
        return time.perf_counter(), tree_cpu_seconds(), server or 0.0


def our_loader(m: Measurement) -> tuple[Any, Callable[[Any], int], Rows]:
    """Our loader over the measurement's layout: member checksums required wherever a layout has them."""
    from image_edit_data.dataloader_config import ImageEditDataloaderConfig

    options: dict[str, Any] = {"num_workers": m.workers, "require_checksums": m.layout != "files"}
    if m.where == "s3":
        options.update(storage_options=m.storage_options, remote_read=m.layout, local_cache_dir=m.local_dir)
        if m.layout == "shard_cache":  # whole shards are fetched: shuffle within a window of them, as litdata does
            options["shard_window"] = m.shard_window
    built = ImageEditDataloaderConfig(m.source, **options).build(dp_rank=0, dp_world_size=1, batch_size=m.batch_size)
    return built.dataloader, lambda batch: int(batch["metadata"]["batch_size"]), our_rows


def litdata_loader(m: Measurement) -> tuple[Any, Callable[[Any], int], Rows]:
    """litdata's loader over its copy of the samples."""
    from .litdata_side import as_bf16, litdata_loader, litdata_rows

    loader = litdata_loader(m.source, m.workers, m.batch_size, m.local_dir, m.storage_options)
    return loader, lambda batch: int(as_bf16(batch)["target_latent"].shape[0]), litdata_rows


def import_clients(m: Measurement) -> float:
    """Import what the loader will use before the clock starts: the cold epoch measures reading, not imports.

    Ours with workers: also start its workers' fork server and wait until it has imported torch and
    the read path, as the DataModule starts it when it is made; litdata's workers are forks of this
    process, which has those imports already (`server_in_clock` leaves the server to the cold epoch,
    as it was measured before 2026-12-05). Returns the seconds the server took (0 without one).
    """
    if m.system == "ours":
        import image_edit_data.dataloader_config
        import image_edit_data.storage.remote

        if m.where == "s3":
            import s3fs  # noqa: F401
        if m.server_in_clock:
            return 0.0
        started = time.perf_counter()
        config = image_edit_data.dataloader_config.ImageEditDataloaderConfig(m.source, num_workers=m.workers)
        config.start_workers_early(wait=True)
        return time.perf_counter() - started if m.workers > 0 else 0.0
    else:
        import litdata
        import litdata.streaming.downloader  # noqa: F401
    return 0.0


def timed_epoch(batches: Iterable[Any], count: Callable[[Any], int], clock: Clock, begin: tuple[float, ...]) -> Epoch:
    """Draw one epoch; its numbers from `begin` (a clock reading) to the last batch."""
    samples, first = 0, None
    for batch in batches:
        samples += count(batch)
        if first is None:
            first = time.perf_counter()
        del batch
    end = clock.read()
    if first is None:
        raise RuntimeError("the loader yielded no batch: the bench needs at least one full batch of samples")
    return Epoch(samples, end[0] - begin[0], first - begin[0], end[1] - begin[1], end[2] - begin[2])


def measure(m: Measurement) -> Result:
    """Build the loader, time its epochs, digest a few samples of one more epoch, and close it."""
    server_seconds = import_clients(m)
    # The imports leave a full collection owed (over torch's objects: tens of ms here); it would fall in whichever
    # loader's epoch allocates first. Either loader starts without it, as a trainer that has run a while does.
    gc.collect()
    clock = Clock(m.server_pid if m.where == "s3" else None)
    result = Result(m, server_start_seconds=server_seconds)
    begin = clock.read()
    loader, count, rows = (our_loader if m.system == "ours" else litdata_loader)(m)
    try:
        for epoch in range(m.epochs):
            result.epochs.append(timed_epoch(loader, count, clock, begin if epoch == 0 else clock.read()))
        iterator = iter(loader)
        for _, batch in zip(range(m.verify_batches), iterator):
            count(batch)
            result.digests.update((number, sample_digest(tensors)) for number, tensors in rows(batch))
        del iterator
    finally:
        if hasattr(loader, "close"):
            loader.close()
    return result


def main(argv: list[str]) -> int:
    """Run the measurement given as JSON in `argv[0]`; print its result as one JSON line."""
    m = Measurement(**json.loads(argv[0]))
    print(json.dumps(asdict(measure(m))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
