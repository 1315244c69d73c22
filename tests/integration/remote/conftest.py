"""Fixtures of the remote tests: a tiny cache and the same cache packed into the test bucket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.caches import tiny_cache

from image_edit_data.preprocess.cli import cache_main


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cache(tmp_path_factory.mktemp("src"), counts=(7, 5, 4), suffix=".safetensors")


@pytest.fixture(scope="module")
def packed_url(s3: dict[str, Any], source: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The source packed straight into the bucket through the command line (8 KiB shards: several of them)."""
    staging = tmp_path_factory.mktemp("staging")
    argv = ["pack", str(source), "s3://bucket/packed", "--shard-bytes", "8192"]
    assert cache_main([*argv, "--storage-options", json.dumps(s3), "--staging-dir", str(staging)]) == 0
    return "s3://bucket/packed"
