"""`python -m benchmarks.versus_litdata`: our loader against litdata's on the same samples (see run.py)."""

import sys

from image_edit_data.bench.command import make_console

from .run import versus_main

sys.exit(versus_main(sys.argv[1:], make_console()))
