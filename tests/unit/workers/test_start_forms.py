"""Claim: with `num_workers=2`, every way of starting Python trains, or fails within seconds naming the fix.

A fork-free worker ("forkserver", the default's first choice) imports the main module again. Real
interpreters run each form: a script with and without `if __name__ == "__main__":`, `python -c`,
`python - < script.py`, an explicit `multiprocessing_context` that cannot work, a script that trains
at its top level besides its guard, and a Jupyter kernel running a notebook (through nbclient),
which also trains on a dataset class defined in the notebook.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import find_kernel_specs
from nbclient import NotebookClient
from support import ROOT
from support.caches import tiny_cache

pytestmark = pytest.mark.slow  # real interpreters, each importing torch and starting a pool

SECONDS = 45  # per form: an interpreter start, a pool start and 12 samples, on a busy 2-core machine
SAMPLES = 12
FALLBACK_NOTICE = "loader workers start with multiprocessing_context='fork'"
FIX = 'keep the code that trains under `if __name__ == "__main__":`'

TRAIN = """
from image_edit_data import ImageEditDataloaderConfig


def train(cache, start=None):
    config = ImageEditDataloaderConfig(cache_dir=cache, num_workers=2, worker_timeout=20, multiprocessing_context=start)
    built = config.build(dp_rank=0, dp_world_size=1, batch_size=2)
    ids = sorted(i for batch in built.dataloader for i in batch["metadata"]["sample_indices"])
    built.dataloader.close()
    print("TRAINED", len(ids), "with", built.dataloader.worker_start, flush=True)
"""


def script(cache: Path, body: str) -> str:
    return f"{TRAIN}\nCACHE = {str(cache)!r}\n{body}\n"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("cache"), counts=(6, 6))


def environment() -> dict[str, str]:
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


def run_form(arguments: list[str], stdin: Path | None, cwd: Path) -> tuple[int | None, str, str]:
    """Exit code (None: no answer within `SECONDS`, then killed), stdout and stderr of one interpreter."""
    with open(stdin or os.devnull) as feed:
        try:
            done = subprocess.run(
                [sys.executable, *arguments],
                stdin=feed,
                capture_output=True,
                text=True,
                cwd=cwd,
                env=environment(),
                timeout=SECONDS,
            )
        except subprocess.TimeoutExpired as hung:
            return None, str(hung.stdout or ""), str(hung.stderr or "")
    return done.returncode, done.stdout, done.stderr


def test_every_way_of_starting_python_trains_with_workers_or_fails_at_once_naming_the_fix(
    tmp_path: Path, cache_dir: Path
) -> None:
    guarded = tmp_path / "guarded.py"
    guarded.write_text(script(cache_dir, 'if __name__ == "__main__":\n    train(CACHE)'))
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text(script(cache_dir, "train(CACHE)"))
    explicit = tmp_path / "explicit.py"
    explicit.write_text(script(cache_dir, 'train(CACHE, "forkserver")'))
    beside = tmp_path / "beside_the_guard.py"
    beside.write_text(script(cache_dir, 'if __name__ == "__main__":\n    print("main")\ntrain(CACHE)'))
    forms = {  # name: (command, stdin, trains with, or None for a failure naming the fix)
        "script with a main guard": ([str(guarded)], None, "forkserver"),
        "script without a main guard": ([str(unguarded)], None, "fork"),
        "python -c": (["-c", script(cache_dir, "train(CACHE)")], None, "forkserver"),
        "python - < script": (["-"], unguarded, "fork"),
        "explicit forkserver, no main guard": ([str(explicit)], None, None),
        "training beside the main guard": ([str(beside)], None, None),
    }
    # Two at a time, as many as the machine has cores: a burst of interpreters would starve the other test worker.
    with ThreadPoolExecutor(2) as pool:
        runs = {name: pool.submit(run_form, form[0], form[1], tmp_path) for name, form in forms.items()}
    results = {name: run.result() for name, run in runs.items()}
    for name, (code, stdout, stderr) in results.items():
        expected = forms[name][2]
        assert code is not None, f"{name}: no answer in {SECONDS} s\n{stdout}\n{stderr[-3000:]}"
        if expected is None:
            assert code != 0 and FIX in stderr, f"{name}:\n{stdout}\n{stderr[-3000:]}"
        else:
            assert f"TRAINED {SAMPLES} with {expected}" in stdout, f"{name}:\n{stdout}\n{stderr[-3000:]}"
            assert (FALLBACK_NOTICE in stderr) == (expected == "fork"), f"{name}: {stderr[-3000:]}"
    assert "cannot start loader workers here" in results["explicit forkserver, no main guard"][2]
    assert (
        "exited unexpectedly before the pool delivered its first batch" in results["training beside the main guard"][2]
    )


NOTEBOOK_CELLS = [
    TRAIN,
    "train(CACHE)",
    """
from image_edit_data import ImageEditDataset


class DefinedHere(ImageEditDataset):  # lives in __main__, which a fork-free worker cannot import
    pass


config = ImageEditDataloaderConfig(cache_dir=CACHE, num_workers=2, worker_timeout=20)
built = config.build_for(dataset=DefinedHere(CACHE), dp_rank=0, dp_world_size=1, batch_size=2)
samples = sum(len(batch["metadata"]["sample_indices"]) for batch in built.dataloader)
print("TRAINED", samples, "with", built.dataloader.worker_start)
built.dataloader.close()
""",
]


def streams(cell: nbformat.NotebookNode) -> str:
    return "".join(output.get("text", "") for output in cell.outputs if output.get("output_type") == "stream")


def test_a_notebook_kernel_trains_with_workers_on_the_packages_dataset_and_on_one_defined_in_the_notebook(
    tmp_path: Path, cache_dir: Path
) -> None:
    if "python3" not in find_kernel_specs():
        from ipykernel.kernelspec import install

        install(user=True)
    notebook = nbformat.v4.new_notebook()
    cells = [f"CACHE = {str(cache_dir)!r}", *NOTEBOOK_CELLS]
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    client = NotebookClient(
        notebook, timeout=SECONDS, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute(env=environment())
    outputs = [streams(cell) for cell in notebook.cells]
    assert f"TRAINED {SAMPLES} with forkserver" in outputs[2], outputs[2]
    assert f"TRAINED {SAMPLES} with fork" in outputs[3] and FALLBACK_NOTICE in outputs[3], outputs[3]
