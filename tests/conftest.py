"""Shared fixtures: tests run on CPU with caches written into tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.caches import tiny_cache


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module's tests: the tensors are tiny, and on a busy 2-core machine a
    second thread only adds contention (up to ~10x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is fetched from a hub: every model and tokenizer is made locally."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen-Image-Edit Plus pipeline saved to disk, one per test module."""
    from support.pipelines import qwen_image_edit_pipeline  # diffusers and transformers: only where used

    return qwen_image_edit_pipeline(tmp_path_factory.mktemp("pipelines") / "qwen-image-edit-plus")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny three-bucket cache (13, 11 and 9 samples), one per test module."""
    return tiny_cache(tmp_path_factory.mktemp("cache"), counts=(13, 11, 9))


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """moto's S3 server on 127.0.0.1 with an empty bucket "bucket"; its storage options (dummy credentials)."""
    from support.local_s3 import make_bucket, moto_server

    with moto_server() as options:
        make_bucket(options, "bucket")
        yield options


# The longest test files (seconds summed over their tests in one run of the suite on a 2-core VM with two pytest
# workers, 2026-12-06), longest first, except that the files which mostly wait (deadlines, sleeping stand-in
# encoders: marked "waits") alternate with those that keep both cores busy, so that one worker's wait is the other's
# second core. Two workers take a file at a time in this order; longest first keeps one long file from ending the
# run alone while the other worker idles. A file missing here only loses its place in the queue.
LONGEST_FILES = [
    "integration/fit/test_strategies.py",  # 99
    "integration/remote/test_remote_faults.py",  # 55, waits
    "integration/resume/test_resume_fuzz.py",  # 46
    "integration/preprocess/test_ray_build.py",  # 42, waits
    "project/test_wheel.py",  # 36
    "unit/workers/test_worker_watch.py",  # 38, waits
    "integration/remote/test_remote_cache.py",  # 38
    "docs/test_code_blocks.py",  # 37
    "unit/bench/test_bench.py",  # 31
    "integration/fit/test_mixture_fit.py",  # 30
    "integration/fit/test_diffusers_edit.py",  # 30
    "unit/preprocess/test_pipeline_encoders.py",  # 25
    "integration/resume/test_loader_resume.py",  # 23
    "unit/workers/test_start_forms.py",  # 21
    "benchmarks/test_versus_litdata.py",  # 21
    "benchmarks/test_stress.py",  # 16
    "unit/workers/test_server_start.py",  # 15
    "benchmarks/test_versus_nemo.py",  # 14
    "integration/preprocess/test_nemo_equivalence.py",  # 12
    "unit/lightning/test_loader_lifecycle.py",  # 11
    "integration/fit/test_lora.py",  # 11
    "project/test_notebook.py",  # 10
    "integration/preprocess/test_cache_cli.py",  # 9
    "unit/entry/test_cli.py",  # 7
    "project/test_public_api.py",  # 7
    "project/test_import_side_effects.py",  # 6
]


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test that starts the local S3 server (moto, in a process of its own) is slow-tier, like every test that
    starts processes: the edit loop stays under 90 s."""
    if "s3" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the longest files first, then the other files holding slow tests, then the rest: with two
    workers taking a file at a time, the long multi-process runs overlap the many short tests instead
    of ending the run alone."""
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    tests = Path(__file__).parent
    rank = {tests / name: position for position, name in enumerate(LONGEST_FILES)}

    def order(item: pytest.Item) -> tuple[int, bool]:
        return rank.get(item.path, len(rank)), item.path not in heavy

    items.sort(key=order)  # stable: each file's tests keep their order
