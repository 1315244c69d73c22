"""Node-local verdicts on remote shards that failed their size or hash check on two downloads in a row.

A verdict is a small JSON file `<sha256>.damaged` in the shard cache directory, named like the
cached shard by the hash the manifest gives (a repacked cache's new shard is a different file),
and written atomically, so every worker and rank of the node sees all of it or nothing. With a
verdict, the shard is never downloaded or read whole again on the node; readers check it before
any ranged read of the shard (storage/reader.py). Delete the file once the remote object is repaired.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .._atomic import write_bytes_atomic
from ..index.packed import ShardInfo

SUFFIX = ".damaged"


@dataclass(frozen=True)
class Verdict:
    """What a download found wrong with a shard: its size (`bytes`) or hash (`xxh3_128`, `sha256`), found, expected."""

    field: str
    found: str
    expected: str

    def reason(self) -> str:
        """The finding as an error names it."""
        if self.field == "bytes":
            return f"shard is {self.found} bytes, the manifest says {self.expected}"
        return f"shard hashes to {self.found}, the manifest says {self.expected}"


class DamagedShards:
    """The verdicts of one remote cache's shard cache directory (picklable: a path only)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, shard: ShardInfo) -> Path:
        """Where the verdict on `shard` lives."""
        return self.directory / f"{shard.sha256}{SUFFIX}"

    def record(self, shard: ShardInfo, verdict: Verdict) -> None:
        """Mark `shard` damaged for every process on the node."""
        data = json.dumps({"path": shard.path, **asdict(verdict)}, indent=2).encode()
        write_bytes_atomic(self.path(shard), data + b"\n")

    def find(self, shard: ShardInfo) -> Verdict | None:
        """The verdict on `shard`, or None when none was recorded (one failed `open` per call)."""
        try:
            text = self.path(shard).read_bytes()
        except FileNotFoundError:
            return None
        try:
            entry = json.loads(text)
            return Verdict(str(entry["field"]), str(entry["found"]), str(entry["expected"]))
        except (ValueError, KeyError, TypeError):  # an edited file still marks the shard: its name is the verdict
            return Verdict("sha256", "(unreadable verdict file)", shard.sha256)
