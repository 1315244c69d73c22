"""Claim: every code block of README.md and docs/*.md runs as written, or says next to it why it does not.

Users copy the README. Each `python`, `bash`, `yaml` and `json` block runs here as a reader would
run it (`support/doc_blocks.py` says how, per language), with one substitution: `/data/...` names
a directory of caches the fixture made. A block that cannot run in CI (it trains for long, needs
a GPU, model weights or a remote store, or measures) carries `<!-- not run: <why> -->` on the line
above it, which the page's source shows next to the block; output, diagrams and synopses are
`text`. Python and shell blocks run as processes of their own: the slow tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ROOT
from support.doc_blocks import DOCUMENTS, PROSE, RUN, RUNNER, DataRoot, examples, fences
from sybil import Example

from image_edit_data.preprocess.demo_cache import write_demo_cache


def marks(example: Example) -> list[pytest.MarkDecorator]:
    """Python and bash blocks run as processes of their own."""
    language = example.region.evaluator.__name__  # type: ignore[union-attr]
    return [pytest.mark.slow] if language in ("python", "bash") else []


BLOCKS = [pytest.param(example, id=name, marks=marks(example)) for name, example in examples()]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`/data/` of the blocks: `/data/edit-cache` is a small demo cache (the reference model's sizes)."""
    root = tmp_path_factory.mktemp("blocks")
    write_demo_cache(root / "data" / "edit-cache", 32, 0)
    return root


@pytest.fixture
def place(data_root: Path, tmp_path: Path) -> Iterator[DataRoot]:
    RUNNER.place = DataRoot(data_root, tmp_path)
    yield RUNNER.place
    RUNNER.place = None


@pytest.mark.parametrize("example", BLOCKS)
def test_the_block_runs_as_written(example: Example, place: DataRoot) -> None:
    example.evaluate()


@pytest.mark.parametrize("page", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_runs_or_says_why_not(page: Path) -> None:
    for fence in fences(page):
        where = f"{page.relative_to(ROOT)}:{fence.line}"
        assert fence.language in (*RUN, PROSE), f"{where}: a block names its language ({', '.join(RUN)} or text)"
        if fence.language == PROSE:
            assert fence.not_run is None, f"{where}: a text block never runs; it needs no reason"


def test_the_runner_finds_the_blocks_that_run_and_leaves_the_marked_ones_out(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- not run: needs a GPU -->\n```bash\nnvidia-smi\n```\n\n"
        "```text\noutput\n```\n```yaml\ndata: {}\n```\n"
    )
    found = fences(page)
    assert [(f.line, f.language, f.not_run) for f in found] == [
        (1, "python", None),
        (6, "bash", "needs a GPU"),
        (10, "text", None),
        (13, "yaml", None),
    ]
    from support.doc_blocks import SYBIL

    assert [example.line for example in SYBIL.parse(page)] == [1, 13]
