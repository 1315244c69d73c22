"""Claims about `cache build --engine ray`: the build on a local Ray cluster equals the single-process build, survives
a killed worker and a stopped job, and Ray stays an optional import."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ROOT
from support.builds import build_args, cli_command, cli_env, index_files, reference_cache, write_manifest
from support.caches import same_samples
from support.processes import command_line, end_session, session_members

from image_edit_data import ImageEditDataset
from image_edit_data.preprocess.cli import cache_main
from image_edit_data.preprocess.run.build_cache import BuildOptions, SliceProgress
from image_edit_data.preprocess.run.journal import journal_path
from image_edit_data.preprocess.run.ray_engine import import_ray, window_lines
from image_edit_data.preprocess.sources.base import MISSING_IMAGE, BadSampleError
from image_edit_data.preprocess.sources.manifest import JsonlManifestSource

RAY_ENGINE = ROOT / "src" / "image_edit_data" / "preprocess" / "run" / "ray_engine.py"
ROWS = 16
DELAY = 0.2


def journaled(cache: Path) -> list[int]:
    """The positions in the journal, in file order (a torn last line left out)."""
    path = journal_path(cache, 0)
    if not path.exists():
        return []
    return [json.loads(line)["position"] for line in path.read_bytes().split(b"\n")[:-1]]


def wait_until(condition: object, process: subprocess.Popen[str], what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if process.poll() is not None:
            raise AssertionError(f"the build ended before {what}: {process.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s")
        time.sleep(0.05)


@pytest.fixture
def ray_tmp() -> Iterator[str]:
    """A short directory for the cluster's sockets and logs (a socket path may not exceed 107 bytes)."""
    directory = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_a_ray_build_stopped_and_rerun_with_its_encoder_killed_equals_the_single_process_build(
    tmp_path: Path, ray_tmp: str
) -> None:
    """Real processes: each run of the command starts a local Ray cluster on 2 CPUs in its own session, which ends
    with it (the test ends the session in any case); the first run is stopped as a whole, the second loses its
    encoder actor's process to SIGKILL mid-build."""
    manifest = write_manifest(tmp_path / "raw", rows=ROWS)
    cache = tmp_path / "ray"
    # Each image encoder call sleeps DELAY: a window of 4 samples (8 calls) takes 1.6 s, time to stop or kill between.
    # One image per encoder call, so the windows Ray redoes meet the kernels the reference meets.
    args = build_args(manifest, cache, "--batch-size", "1", delay=str(DELAY))
    args += ["--engine", "ray", "--ray-num-cpus", "2"]
    env = cli_env(RAY_TMPDIR=ray_tmp)
    run = {"env": env, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "start_new_session": True}

    first = subprocess.Popen(cli_command(*args), **run)  # type: ignore[call-overload]
    try:
        wait_until(lambda: len(journaled(cache)) >= 4, first, "first window journaled")
    finally:
        end_session(first.pid)
        first.communicate()
    stopped = journaled(cache)
    assert 4 <= len(stopped) < ROWS and not (cache / "metadata.json").exists()

    second = subprocess.Popen(cli_command(*args), **run)  # type: ignore[call-overload]
    try:
        wait_until(lambda: len(journaled(cache)) > len(stopped), second, "a window of the rerun journaled")
        encoders = [pid for pid in session_members(second.pid) if "Map(Encoding)" in command_line(pid)]
        assert len(encoders) == 1 and len(journaled(cache)) < ROWS, "the encoder should be killed mid-build"
        os.kill(encoders[0], signal.SIGKILL)
        out, err = second.communicate(timeout=240)
    finally:
        end_session(second.pid)
    assert second.returncode == 0, out + err[-3000:]
    assert f"({len(stopped)} of {ROWS} already done)" in out and "on Ray: 1 encoder actor(s)" in out
    assert sorted(journaled(cache)) == list(range(ROWS))  # every position once: none lost, none twice
    reference = reference_cache(manifest, tmp_path / "reference", delay=DELAY, batch_size=1)
    assert index_files(cache) == index_files(reference)
    same_samples(ImageEditDataset(cache), ImageEditDataset(reference))


def test_without_ray_the_ray_engine_is_refused_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets when Ray is not installed
    with pytest.raises(ImportError, match=r"--engine ray needs Ray Data.*pip install 'image-edit-data\[ray\]'"):
        import_ray()
    manifest = write_manifest(tmp_path / "raw", rows=2)
    assert cache_main([*build_args(manifest, tmp_path / "c"), "--engine", "ray"]) == 1
    assert "pip install 'image-edit-data[ray]'" in capsys.readouterr().out


def test_the_ray_engine_runs_as_one_process_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    manifest = write_manifest(tmp_path / "raw", rows=2)
    args = [*build_args(manifest, tmp_path / "c"), "--engine", "ray", "--rank", "0", "--world-size", "2"]
    assert cache_main(args) == 1
    assert "the ray engine spreads the work over its cluster from one process; got world_size 2" in (
        capsys.readouterr().out
    )


def test_ray_is_imported_only_inside_the_ray_engines_functions() -> None:
    top_level = [
        node for node in ast.parse(RAY_ENGINE.read_text()).body if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    modules = [alias.name for node in top_level if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module or "" for node in top_level if isinstance(node, ast.ImportFrom)]
    assert not [name for name in modules if name.split(".")[0] == "ray"]


def test_the_ray_driver_journals_each_position_once_and_stops_at_a_bad_sample_when_asked(tmp_path: Path) -> None:
    source = JsonlManifestSource(write_manifest(tmp_path / "raw", rows=4))
    record = {"cache_file": "samples/sample_00000000.pt", "row_index": 0}
    bad = BadSampleError("edits.jsonl line 2", MISSING_IMAGE, "target: file 'images/gone.png' does not exist")
    row = {"written": [{"position": 0, "record": record, "cuts": "", "where": ("edits.jsonl line 1", "s000")}]}
    row |= {"bad": [(1, bad)], "encoder_seconds": 0.1}
    done, journaled = SliceProgress(), set[int]()
    lines = window_lines(source, row, BuildOptions(on_bad_sample="skip"), journaled, done)
    assert [line["position"] for line in lines] == [0, 1] and lines[1]["skipped"]["kind"] == MISSING_IMAGE
    assert (done.written, dict(done.skipped)) == (1, {MISSING_IMAGE: 1})
    # The same window again (Ray redid it): nothing is journaled or counted twice.
    assert window_lines(source, row, BuildOptions(on_bad_sample="skip"), journaled, done) == []
    assert (done.written, dict(done.skipped)) == (1, {MISSING_IMAGE: 1})
    with pytest.raises(BadSampleError, match="edits.jsonl line 2: target: file 'images/gone.png' does not exist"):
        window_lines(source, row, BuildOptions(), set(), SliceProgress())
