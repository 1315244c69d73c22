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


# The longest test files, longest first (seconds summed over their tests on a 2-core VM, 2026-12-05).
# Two workers take a file at a time in this order; longest first keeps one long file from ending
# the run alone while the other worker idles. A file missing here only loses its place in the queue.
LONGEST_FILES = [
    "integration/fit/test_diffusers_edit.py",  # 70
    "integration/resume/test_resume_fuzz.py",  # 57
    "integration/resume/test_loader_resume.py",  # 48
    "integration/remote/test_remote_cache.py",  # 46
    "unit/workers/test_worker_watch.py",  # 45
    "unit/bench/test_bench.py",  # 45
    "integration/fit/test_mixture_fit.py",  # 43
    "unit/entry/test_cli.py",  # 42
    "integration/remote/test_remote_faults.py",  # 36
    "integration/fit/test_lora.py",  # 33
    "unit/workers/test_start_forms.py",  # 30
    "benchmarks/test_versus_litdata.py",  # 29
    "unit/preprocess/test_pipeline_encoders.py",  # 28
    "unit/lightning/test_loader_lifecycle.py",  # 25
    "benchmarks/test_stress.py",  # 23
    "integration/resume/test_elastic_resume.py",  # 23
    "integration/resume/test_datamodule_resume.py",  # 22
    "unit/workers/test_server_start.py",  # 16
]


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
