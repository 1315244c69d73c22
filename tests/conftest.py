"""Shared fixtures: tests run on CPU with caches written into tmp_path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
