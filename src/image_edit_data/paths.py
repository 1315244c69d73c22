"""Keep every file a cache names inside the cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from .validate import fail


def contained(root: Path, value: object, file: str, field: str) -> str:
    """Check a path from a cache file lexically and return it relative to `root` (POSIX separators).

    Absolute paths are accepted only when they lie under `root`. Symlinks are checked later by
    `resolve_inside`, when the file is opened.
    """
    if not isinstance(value, str) or not value:
        fail(file, field, f"expected a non-empty path string, got {value!r}")
    if "\x00" in value:
        fail(file, field, f"path {value!r} contains a NUL byte")
    candidate = value if os.path.isabs(value) else os.path.join(root, value)
    relative = os.path.relpath(os.path.normpath(candidate), root)
    if relative == os.curdir or relative == os.pardir or relative.startswith(os.pardir + os.sep):
        fail(file, field, f"path {value!r} is outside cache directory {root}")
    return relative.replace(os.sep, "/")


def resolve_inside(root: Path, relative: str, file: str, field: str) -> Path:
    """Resolve `relative` under `root`, following symlinks, and refuse anything that lands outside."""
    resolved = Path(os.path.realpath(os.path.join(root, relative)))
    if resolved != root and root not in resolved.parents:
        fail(file, field, f"path {relative!r} resolves to {resolved}, outside cache directory {root}")
    return resolved
