"""metadata.json and its JSON shards -> a compact columnar `CacheIndex`, and the stored copy reopened next time."""

from .index import MANIFEST, UNKNOWN, CacheIndex, load_index
from .store import STORE_DIR, candidate_paths, open_index, store_key

__all__ = ["MANIFEST", "STORE_DIR", "UNKNOWN", "CacheIndex", "candidate_paths", "load_index", "open_index", "store_key"]
