"""Write `state.json`: a loader's state saved mid-epoch over a three-source mixture by the draw-1 code.

Run from a checkout of commit ee4b5e5 (mixtures drew each stratum through fresh permutations per
pass, and their fingerprint had no `mixture_draw` key):
    PYTHONPATH=<that checkout>/src:<that checkout>/tests python make.py
It builds the caches of the `caches` fixture in `tests/unit/sampling/test_mixture.py`, weights 3:1:1,
and saves the standalone loader's and the sampler's state after 10 batches of epoch 1.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from support.caches import tiny_cache

from image_edit_data import ImageEditDataloaderConfig

HERE = Path(__file__).parent

if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    large = tiny_cache(root / "large", counts=(14, 10, 6))
    small = tiny_cache(root / "small", counts=(3, 2, 2))
    third = tiny_cache(root / "third", counts=(9,), buckets=(((4, 4, 8), ((4, 4, 8),)),))
    sources = [{"cache_dir": str(c), "weight": w} for c, w in zip((large, small, third), (3.0, 1.0, 1.0))]
    built = ImageEditDataloaderConfig(sources=sources, num_workers=0).build(dp_rank=0, dp_world_size=1, batch_size=2)
    built.sampler.set_epoch(1)
    iterator = iter(built.dataloader)
    for _ in range(10):
        next(iterator)
    state = {"loader": built.dataloader.state_dict(), "sampler": built.sampler.state_dict()}
    (HERE / "state.json").write_text(json.dumps(state, indent=1) + "\n")
