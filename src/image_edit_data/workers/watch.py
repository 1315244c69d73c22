"""Turn a loader worker that stops answering into an error that says which worker, and doing what.

Each worker of a pool writes its phase into one row of a small shared-memory table: started,
loading batch (epoch, step) since when, or idle. When torch's loader timeout fires in the training
process, the table names the worker that never started or the one stuck in a batch, and for how
long, so a supervisor sees a clear error rather than a silent hang, and restarts from the exact resume.
"""

from __future__ import annotations

import functools
import gc
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from .._process import pid_alive

NOT_STARTED, IDLE, LOADING = 0, 1, 2
PHASE, EPOCH, STEP, SINCE = range(4)


class LoaderWorkerTimeoutError(RuntimeError):
    """A loader worker did not start or deliver a batch within the configured timeout."""


class WorkerWatch:
    """One row per worker of a pool, in shared memory: phase, (epoch, step) of its batch, since when (ns)."""

    def __init__(self, num_workers: int, rank: int, timeout: float) -> None:
        self.workers = num_workers
        self.table = self.new_table()
        self.rank = rank
        self.timeout = timeout
        self.owner = os.getpid()  # the training process the workers serve

    def new_table(self) -> torch.Tensor:
        """A zeroed table in shared memory: no worker has started."""
        return torch.zeros(self.workers, 4, dtype=torch.int64).share_memory_()

    def worker_init_fn(self) -> Callable[[int], None]:
        """The loader's `worker_init_fn`: picklable, so it works with every start method."""
        return functools.partial(start_worker, self)

    def renew(self) -> None:
        """A new pool gets a table of its own: a worker of an earlier pool that still runs writes only to its own."""
        self.table = self.new_table()

    def mark(self, worker: int, phase: int, epoch: int = -1, step: int = -1) -> None:
        """Record `worker`'s phase now."""
        self.table[worker] = torch.tensor([phase, epoch, step, time.monotonic_ns()])

    def describe(self) -> str:
        """Which workers are late, and how, as one sentence for the error."""
        now = time.monotonic_ns()
        workers = len(self.table)
        rows = self.table.tolist()
        late = []
        for worker, (phase, epoch, step, since) in enumerate(rows):
            if phase == NOT_STARTED:
                late.append(f"worker {worker} of {workers} never started (stuck in start-up)")
            elif phase == LOADING:
                seconds = (now - since) / 1e9
                doing = f"has been loading batch {step} of epoch {epoch} for {seconds:.0f} s"
                late.append(f"worker {worker} of {workers} {doing}")
        if not late:
            late.append(f"all {workers} workers are idle, so a batch or its hand-over to this process was lost")
        return (
            f"rank {self.rank}: a loader worker did not answer within worker_timeout={self.timeout:g} s: "
            + "; ".join(late)
            + ". The pool was shut down; restart the run to resume exactly from its last checkpoint "
            "(or raise worker_timeout if batches are legitimately that slow)"
        )


class WatchedDataset(Dataset):
    """A dataset as a watched pool's workers fetch it: each batch marks the worker loading it, then idle.

    The loader hands this to torch in place of the dataset, so the phase is the fetch's business and
    the dataset knows nothing of workers. Every other attribute is the wrapped dataset's.
    """

    def __init__(self, dataset: Dataset, watch: WorkerWatch) -> None:
        self.dataset = dataset
        self.watch = watch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, idx: int) -> Any:
        return self.dataset[idx]

    def __getitems__(self, indices: list[int]) -> Any:
        info = get_worker_info()
        if info is None:  # fetched in the training process: nothing to watch
            return self.dataset.__getitems__(indices)  # type: ignore[attr-defined]
        step = getattr(indices, "step", None)  # a `PlannedBatch` from our sampler knows its place in the plan
        epoch = getattr(indices, "epoch", -1)
        self.watch.mark(info.id, LOADING, int(epoch), -1 if step is None else int(step))
        try:
            return self.dataset.__getitems__(indices)  # type: ignore[attr-defined]
        finally:
            self.watch.mark(info.id, IDLE)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "dataset" not in self.__dict__:  # unpickling asks before `dataset` is set
            raise AttributeError(name)
        return getattr(self.__dict__["dataset"], name)


def start_worker(watch: WorkerWatch, worker: int) -> None:
    """Runs in each new worker: mark it started, and end it when the training process ends."""
    # What the worker inherited (and the dataset it received) lives as long as it does: out of the
    # collector's reach, a full collection never writes to those pages, which would copy them all
    # into the worker (a pool now lives for the whole fit, long enough for one to come).
    gc.freeze()
    watch.mark(worker, IDLE)
    exit_with(watch.owner)


def exit_with(owner: int) -> None:
    """End this worker as soon as process `owner` has ended, however it ended.

    Torch's workers watch their parent process; a fork server's workers have the server as parent,
    which (holding the server's liveness pipe open for each other) would outlive a training process
    that was killed. A thread blocked on a pidfd of the owner costs nothing until the owner ends.
    """
    if owner == os.getppid():
        return  # forked from the owner itself: torch's own parent check covers it
    try:
        handle = os.pidfd_open(owner)
    except (AttributeError, OSError):  # TODO(portability): no pidfd (not Linux >= 5.3): poll instead
        handle = None
    if handle is None and not pid_alive(owner):
        os._exit(1)
    threading.Thread(target=_wait_then_exit, args=(owner, handle), name="owner-watch", daemon=True).start()


def _wait_then_exit(owner: int, handle: int | None) -> None:
    if handle is not None:
        select.select([handle], [], [])  # readable once the owner has exited
    else:
        while pid_alive(owner):
            time.sleep(1.0)
    os._exit(1)
