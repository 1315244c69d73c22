"""`python -m benchmarks.versus_nemo [CACHE_DIR] [BENCH OPTIONS] [--reference-path DIR]` (see __init__.py)."""

import sys

from .command import versus_nemo_main

sys.exit(versus_nemo_main(sys.argv[1:]))
