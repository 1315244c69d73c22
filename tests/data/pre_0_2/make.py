"""Write `step=4.ckpt`: a checkpoint of the fit in config.yaml, made by the code before the 0.2 moves.

Run from a checkout of commit ee4b5e5 (the last one before the moves), with this folder's files:
    PYTHONPATH=<that checkout>/src:<that checkout>/tests python make.py OUT_DIR
It builds the tiny cache the test rebuilds (`tiny_cache(counts=(6, 5, 4))`), fits for 2 epochs,
checkpointing every 4 steps into OUT_DIR/ckpt; the test keeps `step=4.ckpt`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from support.caches import tiny_cache

from image_edit_data.lightning.cli import lightning_main

HERE = Path(__file__).parent

if __name__ == "__main__":
    out = Path(sys.argv[1])
    cache = tiny_cache(out / "cache", counts=(6, 5, 4))
    args = ["fit", "--config", str(HERE / "config.yaml"), "--data.cache_dir", str(cache)]
    lightning_main([*args, "--trainer.default_root_dir", str(out), "--trainer.callbacks.dirpath", str(out / "ckpt")])
