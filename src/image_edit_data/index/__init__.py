"""metadata.json and its JSON shards -> a compact columnar `CacheIndex`; the stored copy; the packed index format."""

from .index import MANIFEST, UNKNOWN, CacheIndex, load_index
from .packed import LAYOUT, ShardInfo, is_packed
from .store import STORE_DIR, candidate_paths, open_index, store_key

__all__ = [
    "LAYOUT",
    "MANIFEST",
    "STORE_DIR",
    "UNKNOWN",
    "CacheIndex",
    "ShardInfo",
    "candidate_paths",
    "is_packed",
    "load_index",
    "open_index",
    "store_key",
]
