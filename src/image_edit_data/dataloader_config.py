"""`ImageEditDataloaderConfig.build()`: dataset + bucket sampler + collate -> a StatefulDataLoader."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .batch.collate import collate_image_edit
from .dataset import ImageEditDataset
from .mixture_dataset import CacheSource, MixtureDataset, as_sources
from .payload.corrupt import CorruptPolicy
from .sampling.mixture_draw import Mixture
from .sampling.plan import BucketOrder
from .sampling.sampler import BucketBatchSampler, EvalBatchSampler, check_rank
from .storage.location import DEFAULT_SHARD_CACHE_BYTES, CacheLocation, RemoteRead
from .storage.remote import RequestPolicy
from .workers.resumable_loader import ResumableDataLoader
from .workers.start import WorkerStart, check_start, start_server_early, wait_for_server


class DiffusionDataloaderBuild(NamedTuple):
    """A built loader and the sampler that drives it (for `set_epoch` and resume state)."""

    dataloader: ResumableDataLoader
    sampler: BucketBatchSampler


def bucket_batch_sizes(
    dataset: ImageEditDataset | MixtureDataset,
    batch_size: int,
    dynamic: bool,
    base_resolution: tuple[int, int],
    latent_scale: int,
) -> list[int]:
    """Per-bucket batch size: `batch_size` everywhere, or sized to one token budget when `dynamic`.

    Dynamic: a sample costs the pixel area of its target plus all its contexts, in
    `quantization`-sized cells (latent dims x `latent_scale`, each rounded up). The budget is
    `batch_size` samples of a base sample (target and one context at `base_resolution`), and
    each bucket gets `max(1, budget // cost)` samples per batch.
    """
    if not dynamic:
        return [batch_size] * len(dataset.signatures)
    q = dataset.quantization
    width, height = base_resolution
    base_cost = 2 * (-(-height // q)) * (-(-width // q))
    budget = batch_size * base_cost
    return [max(1, budget // sig.quantized_cells(q, latent_scale)) for sig in dataset.signatures]


@dataclass
class ImageEditDataloaderConfig:
    """Construction-time configuration of a cached image-edit dataloader: one cache, or a mixture (`sources`)."""

    cache_dir: str | None = None
    """Directory holding metadata.json, its shards and the payloads (or a URL); set this or `sources`."""
    quantization: int = 64
    """Pixel cell size for the dynamic batch size's cost."""
    base_resolution: tuple[int, int] = (1024, 1024)
    """(width, height) at which a batch holds exactly `batch_size` samples when dynamic."""
    drop_last: bool = True
    """Drop each bucket's short last batch instead of yielding it short."""
    shuffle: bool = True
    """Shuffle samples within buckets and the order of batches, from (seed, epoch)."""
    dynamic_batch_size: bool = False
    """Size each bucket's batches to one latent-token budget (target + all contexts)."""
    num_workers: int = 4
    """Loader worker processes per rank (0 loads in the training process); may change across a resume.

    4, the NeMo reference's default, so this config stays a drop-in for it; the DataModule shares it.
    """
    pin_memory: bool = True
    """Pin batches in page-locked memory (only when CUDA is available)."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead."""
    multiprocessing_context: WorkerStart | None = None
    """How workers start: "forkserver", "spawn" or "fork"; None: "forkserver", or "fork" once per loader where it must.

    None forks the training process (once, at the pool's start) only when a fork-free worker could
    not re-create the main module: a script without `if __name__ == "__main__":`, `python - < file`,
    or a dataset defined in a notebook (logged once). An explicit fork-free choice there raises at once.
    """
    worker_timeout: float = 600.0
    """Seconds a worker may take to start or to load one batch before the loader raises, naming it (0: wait forever)."""
    seed: int = 42
    """Seed of every shuffle; the same on all ranks."""
    bucket_order: BucketOrder = "interleaved"
    """"interleaved": batches of all buckets shuffled together; "sequential": bucket after bucket."""
    latent_scale: int = 8
    """Pixels per latent position (the VAE's downsampling), for the dynamic batch size's cost."""
    elastic: bool = False
    """Allow resuming mid-epoch on a different world size (remaining samples are dealt anew)."""
    on_corrupt_sample: CorruptPolicy = "raise"
    """"raise" stops at a broken payload; "skip" drops it from its batch, logs and quarantines it."""
    max_corrupt_fraction: float = 0.01
    """With "skip": fail anyway once more than this fraction of the cache was skipped (per loader process)."""
    quarantine_file: str | None = None
    """With "skip": JSONL file listing skipped samples (default: `.image_edit_data/quarantine.jsonl` in the cache)."""
    storage_options: dict[str, Any] | None = field(default=None, repr=False)  # holds credentials: not shown
    """fsspec options when `cache_dir` is a URL (`{"endpoint_url": ...}`; credentials best from the environment).

    Credentials given here (`key`, `secret`, `token`, ...) are redacted from hyperparameters, checkpoints
    and printed configs (docs/remote-caches.md)."""
    remote_read: RemoteRead = "range"
    """Remote packed caches: "range" reads each sample with one ranged request; "shard_cache" downloads shards."""
    local_cache_dir: str | None = None
    """Node-local directory for remote index copies and cached shards (default: the user cache directory)."""
    shard_cache_bytes: int = DEFAULT_SHARD_CACHE_BYTES
    """Byte budget of the local shard cache (at least the largest shard)."""
    remote_requests: RequestPolicy | None = None
    """URL caches: deadlines and attempts of each request (default: `RequestPolicy()`, docs/remote-caches.md)."""
    require_checksums: bool = False
    """Refuse a cache whose reads no member checksum checks (one packed before checksums, or one file per sample)."""
    shard_window: int = 0
    """Packed caches: shuffle shards, and samples only within this many shards, for local reads (0: whole bucket)."""
    sources: list[CacheSource] | None = None
    """A mixture instead of `cache_dir`: caches, each with `cache_dir`, `weight`, optional `name` and remote options."""
    samples_per_epoch: int | None = None
    """Samples drawn per epoch, shared out by weight (default: all samples of all sources once)."""

    def __post_init__(self) -> None:
        self.base_resolution = tuple(self.base_resolution)  # type: ignore[assignment]  # YAML and callers pass lists
        if (self.cache_dir is None) == (self.sources is None):
            raise ValueError("set either cache_dir (one cache) or sources (a mixture of caches), not both or neither")
        if self.sources is not None:
            self.sources = as_sources(self.sources)
        n = self.samples_per_epoch
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"samples_per_epoch must be a positive integer, got {n!r}")

    def location(self, cache_dir: str | None = None, source: CacheSource | None = None) -> CacheLocation:
        """`cache_dir` (default: the configured one), or a source's, with its remote options, parsed once."""
        if source is not None:
            return CacheLocation.of(
                source.cache_dir,
                storage_options=self.storage_options if source.storage_options is None else source.storage_options,
                remote_read=source.remote_read or self.remote_read,
                local_cache_dir=source.local_cache_dir or self.local_cache_dir,
                shard_cache_bytes=self.shard_cache_bytes,
                remote_requests=self.remote_requests if source.remote_requests is None else source.remote_requests,
            )
        location = cache_dir or self.cache_dir
        if location is None:
            raise ValueError("this config reads a mixture (sources); name a cache_dir to open a single cache")
        return CacheLocation.of(
            location,
            storage_options=self.storage_options,
            remote_read=self.remote_read,
            local_cache_dir=self.local_cache_dir,
            shard_cache_bytes=self.shard_cache_bytes,
            remote_requests=self.remote_requests,
        )

    def start_workers_early(self, wait: bool = False) -> None:
        """Start the fork server this config's workers will come from, now; nothing without workers or when they fork.

        The server imports torch, the read path and Lightning (when loaded) once per process: a second
        or more, before which no pool can deliver a batch. Started early, it imports while this process
        does other work: opening the cache calls this (the DataModule opens it in Lightning's `setup`,
        in each rank's process). It starts nothing while this process re-runs its main script's top
        level (a worker starting up), and nothing a process forked later could use: call it in the
        process that trains. With `wait`, return only once the server has imported them (within
        `worker_timeout`), so that the loader's first pool pays only for its own start.
        """
        started = start_server_early(self.multiprocessing_context, self.num_workers)
        if started and wait:
            wait_for_server(self.worker_timeout or None)

    def open_dataset(self, cache_dir: str | None = None) -> ImageEditDataset | MixtureDataset:
        """Open `cache_dir` (default: the configured cache or mixture) with this config's corrupt-sample policy.

        With workers, the fork server starts first (unless it runs) and loads itself while the cache opens.
        """
        self.start_workers_early()
        if cache_dir is not None or self.sources is None:
            return self.open_location(self.location(cache_dir))
        names = [s.display_name for s in self.sources]
        opened = []
        for source, name in zip(self.sources, names):
            quarantine = None
            if self.quarantine_file and len(self.sources) > 1:  # one list per source: indices are per cache
                path = Path(self.quarantine_file)
                quarantine = path.with_name(f"{path.stem}.{name}{path.suffix}")
            require = self.require_checksums if source.require_checksums is None else source.require_checksums
            opened.append(self.open_location(self.location(source=source), quarantine, require))
        return MixtureDataset(opened, names, [s.weight for s in self.sources])

    def open_location(
        self, location: CacheLocation, quarantine: Path | None = None, require_checksums: bool | None = None
    ) -> ImageEditDataset:
        """Open one cache with this config's corrupt-sample policy (and checksum requirement, unless given)."""
        if quarantine is None:
            quarantine = Path(self.quarantine_file) if self.quarantine_file else location.quarantine_default()
        return ImageEditDataset(
            location,
            quantization=self.quantization,
            on_corrupt_sample=self.on_corrupt_sample,
            max_corrupt_fraction=self.max_corrupt_fraction,
            quarantine_file=quarantine,
            require_checksums=self.require_checksums if require_checksums is None else require_checksums,
        )

    def mixture_of(self, dataset: ImageEditDataset | MixtureDataset) -> Mixture | None:
        """How an epoch draws from `dataset`'s sources, or None when it reads every sample once."""
        if isinstance(dataset, MixtureDataset):
            weights, names, unchecked = tuple(dataset.weights), tuple(dataset.names), dataset.unchecked
            mixture = Mixture(dataset.sizes, weights, self.samples_per_epoch, dataset.fingerprints, names, unchecked)
        else:
            fingerprints, unchecked = (dataset.index.fingerprint,), (dataset.index.unchecked,)
            mixture = Mixture((len(dataset),), (1.0,), self.samples_per_epoch, fingerprints, (), unchecked)
        return None if mixture.reads_each_sample_once else mixture

    def build(self, *, dp_rank: int, dp_world_size: int, batch_size: int) -> DiffusionDataloaderBuild:
        """Open the cache and build this rank's sampler and stateful loader."""
        return self.build_for(dataset=None, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=batch_size)

    def build_for(
        self,
        *,
        dataset: ImageEditDataset | MixtureDataset | None,
        dp_rank: int,
        dp_world_size: int,
        batch_size: int,
        epoch: int = 0,
        evaluation: bool = False,
    ) -> DiffusionDataloaderBuild:
        """`build()` over an already opened dataset, with the extra knobs the DataModule needs."""
        check_rank(dp_rank, dp_world_size)
        for name, value in (("batch_size", batch_size), ("prefetch_factor", self.prefetch_factor)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be non-negative, got {self.num_workers}")
        if self.worker_timeout < 0:
            raise ValueError(f"worker_timeout must be non-negative (0 waits forever), got {self.worker_timeout}")
        if dataset is None:
            dataset = self.open_dataset()
        if len(dataset) == 0:
            raise ValueError(f"{dataset.cache_dir}: the cache holds no samples; there is nothing to load")
        batch_sizes = bucket_batch_sizes(
            dataset, batch_size, self.dynamic_batch_size, self.base_resolution, self.latent_scale
        )
        if isinstance(dataset, MixtureDataset):
            members, shard_of, fingerprint = dataset.bucket_members(), dataset.member_shard(), dataset.fingerprints[0]
            unchecked = dataset.unchecked[0]
        else:
            members, shard_of = dataset.index.bucket_members(), dataset.index.member_shard
            fingerprint, unchecked = dataset.index.fingerprint, dataset.index.unchecked
        sampler_class = EvalBatchSampler if evaluation else BucketBatchSampler
        sampler = sampler_class(
            bucket_members=members,
            batch_sizes=batch_sizes,
            rank=dp_rank,
            world_size=dp_world_size,
            seed=self.seed,
            shuffle=self.shuffle and not evaluation,
            drop_last=self.drop_last and not evaluation,
            bucket_order=self.bucket_order,
            epoch=epoch,
            data_fingerprint=fingerprint,
            unchecked=unchecked,
            elastic=self.elastic,
            shard_of=shard_of,
            shard_window=self.shard_window,
            mixture=None if evaluation else self.mixture_of(dataset),
        )
        if not evaluation:  # batches workers may hold unloaded (prefetch_factor each), plus the one in hand
            sampler.observer = dataset.prefetcher(max(1, self.num_workers) * self.prefetch_factor + 1)
        check_start(self.multiprocessing_context)  # the name is checked even without workers
        workers: dict[str, Any] = {}
        if self.num_workers > 0:
            workers = {"prefetch_factor": self.prefetch_factor, "worker_start": self.multiprocessing_context}
        with warnings.catch_warnings():  # here, not for the whole process: importing this module changes no filter
            # torchdata 0.11 calls a torch API that warns on every loader; the warning is for torchdata's authors.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            loader = ResumableDataLoader(
                dataset,
                batch_sampler=sampler,
                collate_fn=collate_image_edit,
                num_workers=self.num_workers,
                worker_timeout=self.worker_timeout,
                pin_memory=self.pin_memory and torch.cuda.is_available(),
                # Our own generator: worker seeds then never draw from (or disturb) torch's global RNG.
                generator=torch.Generator().manual_seed(self.seed),
                **workers,
            )
        return DiffusionDataloaderBuild(dataloader=loader, sampler=sampler)
