"""Benchmarks run from a checkout (`python -m benchmarks.NAME`), never shipped: races with other loaders, stress
harnesses and one-off measurements. They share the tests' local S3 servers (`tests/support/local_s3.py`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
if str(TESTS) not in sys.path:  # `from support.local_s3 import ...`, as the tests import it
    sys.path.insert(0, str(TESTS))


def child_environment() -> dict[str, str]:
    """This process's environment for a child that runs `python -m benchmarks...` from any directory."""
    paths = [str(REPO), str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
