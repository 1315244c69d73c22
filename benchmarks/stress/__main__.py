"""`python -m benchmarks.stress`: DDP fits with loader workers over many epoch changes (see run.py)."""

import sys

from .run import stress_main

sys.exit(stress_main(sys.argv[1:]))
