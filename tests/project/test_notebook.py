"""Claim: notebooks/explore_cache.ipynb runs top to bottom on CPU, and its resume check holds."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import find_kernel_specs
from nbclient import NotebookClient
from support import ROOT

NOTEBOOK = ROOT / "notebooks" / "explore_cache.ipynb"

pytestmark = pytest.mark.slow


def tagged(notebook: nbformat.NotebookNode, tag: str) -> int:
    """Position of the one cell carrying `tag`."""
    positions = [i for i, cell in enumerate(notebook.cells) if tag in cell.metadata.get("tags", [])]
    assert len(positions) == 1, f"expected one cell tagged {tag!r}, found {len(positions)}"
    return positions[0]


def stdout_of(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_explore_cache_notebook_runs_and_resumes_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real Jupyter kernel runs the shipped notebook as users run it."""
    if "python3" not in find_kernel_specs():
        from ipykernel.kernelspec import install

        install(user=True)
    monkeypatch.delenv("WRITE_README_PNG", raising=False)  # the README picture stays as committed
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    cache_dir = tmp_path / "cache"
    # Injected after the parameters cell, as papermill would.
    notebook.cells.insert(
        tagged(notebook, "parameters") + 1, nbformat.v4.new_code_cell(f"CACHE_DIR = {str(cache_dir)!r}")
    )

    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()

    assert (cache_dir / "metadata.json").is_file()
    resume_output = stdout_of(notebook.cells[tagged(notebook, "resume")])
    assert "resume check passed" in resume_output, resume_output
