"""Run the code blocks of README.md and docs/*.md as a reader would, with Sybil's Markdown parsers.

A block runs unless the line above its opening fence is `<!-- not run: <why> -->`. What runs:
- `python`: as a program of its own, `python block.py` in a fresh working directory (a block is
  complete: it imports what it uses; and what it defines stays out of the tests' process);
- `bash`: with `bash -euo pipefail`, the package's `image-edit-data` first on PATH;
- `yaml`: a LightningCLI config fragment, parsed by `image-edit-data fit --print_config` over the quickstart config;
- `json`: a manifest line, built into a cache with the demo encoders (the images it names are drawn first).
`text` blocks (output, diagrams, synopses) are prose. The one substitution: `/data/...` names the
fixture's directory of caches (`DataRoot`), where `/data/edit-cache` is a demo cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from PIL import Image
from sybil import Document, Example, Region, Sybil
from sybil.evaluators.python import pad
from sybil.parsers.markdown import CodeBlockParser

from support import ROOT
from support.builds import DEMO_SPECS
from support.peers import RESIZE_ARGS, image
from support.process_group import run_process_group

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>\S.*?) -->$")
FENCE = re.compile(r"^```(?P<language>\S*)\s*$")
RUN = ("python", "bash", "yaml", "json")
PROSE = "text"
SCRIPT_SECONDS = 600
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


@dataclass
class Fence:
    """A fenced block as the file has it: where it opens, its language, and why it does not run (if it says)."""

    path: Path
    line: int
    language: str
    not_run: str | None


def fences(path: Path) -> list[Fence]:
    """Every fenced block of a Markdown file, in order."""
    found, lines, inside = [], path.read_text().splitlines(), False
    for number, text in enumerate(lines):
        match = FENCE.match(text.strip())
        if match is None:
            continue
        if not inside:
            above = lines[number - 1].strip() if number else ""
            marked = NOT_RUN.match(above)
            found.append(Fence(path, number + 1, match["language"], marked["reason"] if marked else None))
        inside = not inside
    return found


@dataclass
class DataRoot:
    """What the blocks' `/data/` stands for, and where in-process blocks and scripts run."""

    root: Path
    workdir: Path

    def substitute(self, source: str) -> str:
        return source.replace("/data/", f"{self.root}/data/")


class Runner:
    """The evaluators of every language; `place` is set by the test before it evaluates a block."""

    def __init__(self) -> None:
        self.place: DataRoot | None = None

    def here(self) -> DataRoot:
        assert self.place is not None, "set Runner.place before evaluating a block"
        return self.place

    def python(self, example: Example) -> None:
        source = self.here().substitute(str(example.parsed))
        script = self.here().workdir / f"block_{example.line}.py"
        script.write_text(pad(source, example.line + example.parsed.line_offset))  # tracebacks name the page's lines
        done = run_process_group([sys.executable, str(script)], SCRIPT_SECONDS, environment(), self.here().workdir)
        assert done.returncode == 0, f"{example.path}:{example.line} exited with {done.returncode}:\n{tail(done)}"

    def bash(self, example: Example) -> None:
        source = self.here().substitute(str(example.parsed))
        done = run_process_group(
            ["bash", "-euo", "pipefail", "-c", source], SCRIPT_SECONDS, environment(), self.here().workdir
        )
        assert done.returncode == 0, f"{example.path}:{example.line} exited with {done.returncode}:\n{tail(done)}"

    def yaml(self, example: Example) -> None:
        from image_edit_data.__main__ import main

        fragment = self.here().workdir / f"block_{example.line}.yaml"
        fragment.write_text(self.here().substitute(str(example.parsed)))
        assert set(yaml.safe_load(fragment.read_text())) <= {"data", "model", "trainer"}, "a fit config fragment"
        try:
            main(
                ["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--config", str(fragment), "--print_config"]
            )
        except SystemExit as exited:
            assert exited.code in (0, None), f"{example.path}:{example.line}: the CLI refused it (exit {exited.code})"

    def json(self, example: Example) -> None:
        from image_edit_data.preprocess.cli import cache_main

        line = json.loads(str(example.parsed))
        folder = self.here().workdir / f"manifest_{example.line}"
        sizes = (32, 48)
        for number, media in enumerate(line["media"]):
            path = folder / media["file_name"]
            if media["role"] == "mask":
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.new("L", sizes, 0).save(path)
            else:
                image(path, number, sizes)
        manifest = folder / "edits.jsonl"
        manifest.write_text(json.dumps(line) + "\n")
        demo = ["--image-encoder", DEMO_SPECS[0]["class_path"], "--text-encoder", DEMO_SPECS[1]["class_path"]]
        build = ["build", str(folder / "cache"), "--manifest", str(manifest), *demo, "--allow-no-context", "--quiet"]
        assert cache_main([*build, *RESIZE_ARGS]) == 0, f"{example.path}:{example.line}: the build refused it"
        from image_edit_data import ImageEditDataset

        assert len(ImageEditDataset(folder / "cache")) == 1, f"{example.path}:{example.line}: the line was left out"


class Marked:
    """A Sybil parser for one language's fenced blocks that leaves out those marked `<!-- not run: ... -->`."""

    def __init__(self, language: str, runner: Runner) -> None:
        self.parser = CodeBlockParser(language, getattr(runner, language))

    def __call__(self, document: Document) -> Iterable[Region]:
        marked = {f.line for f in fences(Path(document.path)) if f.not_run}
        for region in self.parser(document):
            if document.text.count("\n", 0, region.start) + 1 not in marked:
                yield region


RUNNER = Runner()
SYBIL = Sybil(parsers=[Marked(language, RUNNER) for language in RUN])


def examples() -> Iterator[tuple[str, Example]]:
    """(`file:line`, example) for every block that runs, document by document, in order."""
    for path in DOCUMENTS:
        for example in SYBIL.parse(path):
            yield f"{path.relative_to(ROOT)}:{example.line}", example


def environment() -> dict[str, str]:
    """The checkout's package first; one math thread (the other test worker has the other core)."""
    bin_dir = str(Path(sys.executable).parent)
    paths = [str(ROOT / "src"), os.environ.get("PYTHONPATH")]
    return {
        **os.environ,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(filter(None, paths)),
        "OMP_NUM_THREADS": "1",
    }


def tail(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stdout + done.stderr)[-4000:]
