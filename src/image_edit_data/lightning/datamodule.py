"""`ImageEditDataModule`: dataset, bucket sampler and collate behind Lightning's hooks, resumable.

The DataModule is the one owner of the data position. Its `state_dict()` is the sampler's: the
epoch and the batches *trained on* (the loader moves it as it hands a batch to Lightning, so it
never counts prefetched batches; `sampling/resume.py`) plus a fingerprint of the cache and data
config; `load_state_dict()` keeps it until `train_dataloader()` builds the sampler at that
position. The loader itself reports no state, so Lightning's own loader restore cannot skip the
same batches a second time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import lightning.pytorch as pl

from ..dataloader_config import DiffusionDataloaderBuild, ImageEditDataloaderConfig
from ..dataset import ImageEditDataset
from ..index.index import MANIFEST
from ..mixture_dataset import MixtureDataset
from ..preprocess.demo_cache import write_demo_cache
from ..sampling.resume import restore
from ..sampling.sampler import BucketBatchSampler, ResumeMismatchError, migrate_state
from ..storage.secrets import redacted
from .loader_wrapper import FailedLoader, LightningLoader

log = logging.getLogger(__name__)


ResumeMismatch = Literal["raise", "restart_epoch"]
Built = TypeVar("Built")


def built_or_failed(build: Callable[[], Built]) -> Built | FailedLoader:
    """`build()`, or a loader that raises its error at first use: never raise inside Lightning's loader request."""
    try:
        return build()
    except Exception as error:
        return FailedLoader(error)


class ImageEditDataModule(pl.LightningDataModule):
    """Cached image-edit data for any `Trainer`, with exact mid-epoch resume.

    The data options are the fields of `ImageEditDataloaderConfig`, passed by keyword (`num_workers=2`,
    `quarantine_file=...`); LightningCLI reads their types, defaults and docs from that dataclass, so
    a YAML config sets them flat under `data:`.

    Args:
        cache_dir: Training cache directory (metadata.json, shards, payloads), or a URL. Leave it unset to train
            on a mixture instead: `sources`, a list of `CacheSource` (`cache_dir`, `weight`, ...; docs/mixtures.md).
        batch_size: Samples per batch and rank (the base size when `dynamic_batch_size`).
        val_cache_dir: Optional validation cache; every sample is seen once per validation run.
        on_resume_mismatch: "raise" refuses a checkpoint whose data or config differ; "restart_epoch"
            deliberately reshuffles: it keeps the epoch number and starts that epoch afresh.
        demo_samples: When > 0 and `cache_dir` (or `val_cache_dir`, or a local source) holds no cache yet,
            first write the procedural demo cache there with this many samples (a tenth for validation).
            For quickstarts.
        **options: Any other field of `ImageEditDataloaderConfig`, `sources` and `samples_per_epoch` among them.
    """

    def __init__(
        self,
        cache_dir: str | None = None,
        batch_size: int = 4,
        val_cache_dir: str | None = None,
        on_resume_mismatch: ResumeMismatch = "raise",
        demo_samples: int = 0,
        **options: Any,
    ) -> None:
        super().__init__()
        if on_resume_mismatch not in ("raise", "restart_epoch"):
            raise ValueError(f"on_resume_mismatch must be 'raise' or 'restart_epoch', got {on_resume_mismatch!r}")
        self.batch_size = batch_size
        self.val_cache_dir = val_cache_dir
        self.on_resume_mismatch = on_resume_mismatch
        self.demo_samples = demo_samples
        # Nothing starts here: a DataModule is often made where workers and spawned ranks re-run the script's top
        # level, or in a process that forks the ranks. The workers' fork server starts in `setup`, in the rank.
        self.config = ImageEditDataloaderConfig(cache_dir=cache_dir, **options)
        # Every data option, defaults included, so each checkpoint records the whole data config; credentials
        # in storage options (and inside URLs) are redacted: checkpoints and hparams.yaml get shared.
        module_options = {"batch_size": batch_size, "val_cache_dir": val_cache_dir}
        module_options |= {"on_resume_mismatch": on_resume_mismatch, "demo_samples": demo_samples}
        self.save_hyperparameters(redacted({**dataclasses.asdict(self.config), **module_options}))
        self.train_dataset: ImageEditDataset | MixtureDataset | None = None
        self.val_dataset: ImageEditDataset | MixtureDataset | None = None
        self.train_loader: LightningLoader | None = None
        # The loaders handed to Lightning, by role ("train", "val", "test"): a new one replaces (and closes)
        # the last of its role, as `reload_dataloaders_every_n_epochs` asks for one each time.
        self._loaders: dict[str, LightningLoader] = {}
        self._pending_state: dict[str, Any] | None = None

    def prepare_data(self) -> None:
        """Write the demo caches when asked to and absent (Lightning runs this on one process only)."""
        if self.demo_samples <= 0:
            return
        config = self.config
        if config.sources is None:
            targets = [(config.location(), self.demo_samples, 0)]
        else:  # one demo cache per source, each from its own seed (0, 2, 3, ...: 1 is validation's)
            seeds = [0, *range(2, len(config.sources) + 1)]
            targets = [(config.location(source=s), self.demo_samples, n) for s, n in zip(config.sources, seeds)]
        if self.val_cache_dir:
            targets.append((config.location(self.val_cache_dir), max(1, self.demo_samples // 10), 1))
        for location, count, seed in targets:
            if location.local_path is None:
                continue  # a remote cache is never written here
            if not (location.local_path / MANIFEST).exists():
                write_demo_cache(location.local_path, count, seed)

    def setup(self, stage: str) -> None:
        """Open the caches this stage needs (index only: cheap, and done once); the workers' fork server starts first.

        Lightning calls this in each rank's own process, so the server is that process's child, whatever
        the strategy (a forked rank cannot use a server its parent started).
        """
        if stage == "fit" and self.train_dataset is None:
            self.train_dataset = self.config.open_dataset()
        if stage in ("fit", "validate") and self.val_cache_dir and self.val_dataset is None:
            self.val_dataset = self.config.open_dataset(self.val_cache_dir)
        if stage == "test" and self.val_dataset is None:
            self.val_dataset = self.config.open_dataset(self.val_cache_dir)  # None: the training cache or mixture

    def data_parallel(self) -> tuple[int, int]:
        """(rank, world size) of data parallelism, as Lightning's strategy shards data."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))

    def train_dataloader(self) -> LightningLoader | FailedLoader:
        """This rank's training loader, positioned at the restored or current epoch."""
        return built_or_failed(self._train_loader)

    def _train_loader(self) -> LightningLoader:
        if self.train_dataset is None:
            self.setup("fit")
        built = self._build_train()
        sampler = built.sampler
        if self._pending_state is not None:
            self.restore_position(sampler, self._pending_state)
            self._pending_state = None
        self.train_loader = self.hand_out("train", LightningLoader(built.dataloader, sampler))
        return self.train_loader

    def _build_train(self) -> DiffusionDataloaderBuild:
        rank, world = self.data_parallel()
        built = self.config.build_for(
            dataset=self.train_dataset,
            dp_rank=rank,
            dp_world_size=world,
            batch_size=self.batch_size,
            epoch=self.fit_epoch(),
        )
        built.sampler.max_batches = self.batch_limit(len(built.sampler))
        return built

    def restore_position(self, sampler: BucketBatchSampler, state: dict[str, Any], log_restart: bool = True) -> None:
        """Apply a checkpointed position, or restart the epoch when the user chose to reshuffle."""
        try:
            restarted = restore(sampler, state, restart_on_mismatch=self.on_resume_mismatch == "restart_epoch")
        except ResumeMismatchError as error:
            raise ResumeMismatchError(
                f"{error}. To continue anyway with a fresh shuffle of epoch {state['epoch']}, "
                "set on_resume_mismatch='restart_epoch' on the data module."
            ) from None
        if restarted and log_restart:
            log.warning("%s; restarting epoch %s as on_resume_mismatch='restart_epoch' asks", restarted, state["epoch"])

    def batch_limit(self, batches: int) -> int | None:
        """Batches Lightning will take per epoch under `limit_train_batches`, so the sampler ends there too."""
        if self.trainer is None:
            return None
        limit = self.trainer.limit_train_batches
        if limit is None:
            return None
        if isinstance(limit, int):
            return min(batches, limit)
        return int(batches * limit) if limit < 1.0 else None

    def fit_epoch(self) -> int:
        """The epoch the fit loop is in or about to start.

        `epoch_progress.current.processed`, not `trainer.current_epoch`: at an epoch-end checkpoint the
        latter still names the finished epoch, while `processed` already counts it.
        """
        trainer: Any = self.trainer
        return int(trainer.fit_loop.epoch_progress.current.processed) if trainer is not None else 0

    def val_dataloader(self) -> LightningLoader | FailedLoader | list:
        """Validation loader: fixed order, no rank padding, batches dealt round-robin to ranks."""
        return built_or_failed(self._val_loader)

    def _val_loader(self) -> LightningLoader | list:
        if self.val_dataset is None and self.val_cache_dir:
            self.setup("validate")
        return self.hand_out("val", self.eval_loader()) if self.val_dataset is not None else []

    def test_dataloader(self) -> LightningLoader | FailedLoader:
        """Test loader over `val_cache_dir` (or the training cache when none is set)."""
        return built_or_failed(self._test_loader)

    def _test_loader(self) -> LightningLoader:
        if self.val_dataset is None:
            self.setup("test")
        return self.hand_out("test", self.eval_loader())

    def eval_loader(self) -> LightningLoader:
        """A loader that shows every evaluation sample exactly once across ranks."""
        rank, world = self.data_parallel()
        built = self.config.build_for(
            dataset=self.val_dataset, dp_rank=rank, dp_world_size=world, batch_size=self.batch_size, evaluation=True
        )
        return LightningLoader(built.dataloader, built.sampler)

    def hand_out(self, role: str, loader: LightningLoader) -> LightningLoader:
        """`loader` for `role`, closing the one it replaces (its workers, prefetch threads and shard pins)."""
        replaced = self._loaders.get(role)
        if replaced is not None:
            replaced.close()
        self._loaders[role] = loader
        return loader

    def teardown(self, stage: str) -> None:
        """Shut down the loaders' workers when a fit, validation or test ends."""
        self.close_loaders()

    def on_exception(self, exception: BaseException) -> None:
        """Shut down the loaders' workers when a run fails (Lightning does not, for our loaders)."""
        self.close_loaders()

    def close_loaders(self) -> None:
        """Stop every loader this module handed out (their resources; the training one keeps its position)."""
        for loader in self._loaders.values():
            loader.close()
        self._loaders = {"train": self.train_loader} if self.train_loader is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """Epoch, batches trained on and fingerprint: the same on every rank, as rank 0's is the one saved.

        The position counts the batches the loader handed to Lightning (which trains every batch it
        takes before taking the next), so it never counts batches that workers merely prefetched and
        does not depend on Lightning's epoch counters.
        """
        if self.train_loader is None:
            return {}
        return self.train_loader.batch_sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpointed position until `train_dataloader()` builds the sampler; refuse a mismatch now.

        Checking here, before Lightning asks for the loader, keeps the error out of Lightning's
        loader request: Lightning 2.6 leaves `DataLoader.__setattr__` patched for the rest of the
        process when that request raises, and every later loader then keeps its iterators alive.
        """
        if not state_dict:
            return
        self._pending_state = migrate_state(state_dict)
        if self.trainer is not None and self.train_dataset is not None:
            self.restore_position(self._build_train().sampler, self._pending_state, log_restart=False)
