"""Claim: a DataModule made anywhere trains with loader workers under every strategy and start method.

Each case is a real Python process, or a real Jupyter kernel, as a user runs it: the DataModule
made at a script's top level (the README's shape), inside its main guard or in a function, or in a
notebook cell; one CPU device, or two ranks under `ddp` (Lightning launches a second interpreter),
`ddp_spawn`, `ddp_fork` and `ddp_notebook`; and a script that sets `forkserver` or `spawn` as the
start method. Every rank has `num_workers=2`. Each rank must train on exactly its share of the epoch
(the pure epoch plan, computed here), the ranks disjoint and together covering every sample, its
workers started fork-free, with no error.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import find_kernel_specs
from nbclient import NotebookClient
from support import ROOT, TESTS
from support.caches import tiny_cache
from support.fits import planned, records
from support.process_group import run_process_group

# Real processes, each case in a test of its own: every case starts an interpreter (or a kernel), ranks and workers,
# because the claim is about what a process does while it starts up (runs the main module again, forks ranks).
pytestmark = pytest.mark.slow

SECONDS = 240
SAMPLES = 8  # two buckets of 4: at batch size 2, one batch per bucket and rank, nothing padded or dropped
FALLBACK_NOTICE = "loader workers start with multiprocessing_context='fork'"

IMPORTS = """
import multiprocessing
import sys

import lightning.pytorch as pl
import torch
from support.strategy_fits import WorkerRecordingModel

from image_edit_data import ImageEditDataModule

CACHE, OUT, STRATEGY, DEVICES = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
"""
MAKE = """
data = ImageEditDataModule(cache_dir=CACHE, batch_size=2, num_workers=2)
model = WorkerRecordingModel(OUT)
trainer = pl.Trainer(
    accelerator="cpu", strategy=STRATEGY, devices=DEVICES, max_epochs=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, default_root_dir=OUT,
)
"""
FIT = """
trainer.fit(model, datamodule=data)
if torch.distributed.is_initialized():  # gloo's threads joined now, not torn down at interpreter exit
    torch.distributed.destroy_process_group()
"""


def guarded(*lines: str) -> str:
    return 'if __name__ == "__main__":\n' + textwrap.indent("".join(lines), "    ")


FORMS = {
    "top level": IMPORTS + MAKE + guarded(FIT),
    "main guard": IMPORTS + guarded(MAKE, FIT),
    "function": IMPORTS + "\n\ndef train():\n" + textwrap.indent(MAKE + FIT, "    ") + "\n\n" + guarded("train()\n"),
}


def with_start_method(method: str) -> str:
    return IMPORTS + MAKE + guarded(f"multiprocessing.set_start_method({method!r})\n", FIT)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("cache"), counts=(4, 4))


def environment() -> dict[str, str]:
    paths = [str(ROOT / "src"), str(TESTS), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "PYTHONWARNINGS": "ignore"}


def check_shares(cache: Path, out: Path, devices: int, log: str) -> None:
    """Each rank trained on its planned batches of epoch 0 with fork-free workers; together, every sample once."""
    trained = records(out, devices)
    plan = planned(cache, devices, 0)
    for rank in range(devices):
        assert [ids for _, ids in trained[rank]] == plan[rank], f"rank {rank}: {trained[rank]}\n{log}"
        workers = json.loads((out / f"workers.rank{rank}.json").read_text())
        assert workers == {"start": "forkserver", "num_workers": 2}, f"rank {rank}: {workers}\n{log}"
    seen = [i for rank in trained for _, ids in rank for i in ids]
    assert sorted(seen) == list(range(SAMPLES)), log  # disjoint ranks, every sample
    assert FALLBACK_NOTICE not in log


def run_script(source: str, cache: Path, out: Path, strategy: str, devices: int) -> None:
    out.mkdir()
    script = out / "train.py"
    script.write_text(source)
    done = run_process_group(
        [sys.executable, str(script), str(cache), str(out), strategy, str(devices)], SECONDS, environment()
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    check_shares(cache, out, devices, log[-4000:])


@pytest.mark.parametrize("strategy", ["auto", "ddp", "ddp_spawn", "ddp_fork"])
def test_a_datamodule_made_at_a_scripts_top_level_trains_with_workers(
    cache_dir: Path, tmp_path: Path, strategy: str
) -> None:
    """Real processes, in the README's shape: each worker, and each rank ddp launches or spawns, runs the top level
    again, making a DataModule there while it starts up."""
    run_script(FORMS["top level"], cache_dir, tmp_path / "run", strategy, 1 if strategy == "auto" else 2)


def test_a_datamodule_made_under_the_main_guard_trains_under_ddp_fork(cache_dir: Path, tmp_path: Path) -> None:
    """Real processes: Lightning forks the ranks after the DataModule is made; each rank's workers need a fork server
    of its own (one the parent started is not the rank's child)."""
    run_script(FORMS["main guard"], cache_dir, tmp_path / "run", "ddp_fork", 2)


def test_a_datamodule_made_in_a_function_trains_on_one_device(cache_dir: Path, tmp_path: Path) -> None:
    """A real process: its workers run the script's top level again, which defines the function and calls nothing."""
    run_script(FORMS["function"], cache_dir, tmp_path / "run", "auto", 1)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_script_that_sets_the_start_method_trains_with_workers(cache_dir: Path, tmp_path: Path, method: str) -> None:
    """A real process whose interpreter-wide start method is not fork (forkserver is Python 3.14's default)."""
    run_script(with_start_method(method), cache_dir, tmp_path / "run", "auto", 1)


def test_a_datamodule_made_in_a_notebook_cell_trains_under_ddp_notebook(cache_dir: Path, tmp_path: Path) -> None:
    """A real Jupyter kernel: Lightning forks the two ranks from it, after a cell made the DataModule."""
    if "python3" not in find_kernel_specs():
        from ipykernel.kernelspec import install

        install(user=True)
    out = tmp_path / "run"
    out.mkdir()
    arguments = ["notebook", str(cache_dir), str(out), "ddp_notebook", "2"]
    cells = [f"import sys\nsys.argv = {arguments!r}\n" + IMPORTS, MAKE, FIT]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    kernel = {"timeout": SECONDS, "kernel_name": "python3", "resources": {"metadata": {"path": str(out)}}}
    NotebookClient(notebook, **kernel).execute(env=environment())
    outputs = [output for cell in notebook.cells for output in cell.outputs]
    log = "".join(output.get("text", "") for output in outputs if output.get("output_type") == "stream")
    check_shares(cache_dir, out, 2, log[-4000:])
