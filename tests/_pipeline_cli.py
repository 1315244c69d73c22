"""`image-edit-data cache ...` for subprocess tests of the tiny pipelines (run as a script, or by torchrun)."""

from __future__ import annotations

import sys

import _pipeline_helpers  # noqa: F401  diffusers loads the tiny Qwen processor class only from an imported module

from image_edit_data.build.cli import cache_main

if __name__ == "__main__":
    sys.exit(cache_main(sys.argv[1:]))
