"""`image-edit-data cache ...` for subprocess tests of the tiny pipelines (run as a script, or by torchrun)."""

from __future__ import annotations

import sys
from pathlib import Path

from image_edit_data.preprocess.cli import cache_main

if __package__ in (None, ""):  # run as a script, as the tests do: make the `support` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import support.pipelines  # noqa: F401  diffusers loads the tiny Qwen processor class only from an imported module

if __name__ == "__main__":
    sys.exit(cache_main(sys.argv[1:]))
