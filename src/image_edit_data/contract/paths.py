"""Keep every file a cache names inside the cache directory, and read only regular files."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import fail, show

MAX_PATH_BYTES = 4096  # Linux PATH_MAX; a longer path cannot be opened, only echoed in errors


def contained(root: Path, value: object, file: str, field: str) -> str:
    """Check a path from a cache file lexically and return it relative to `root` (POSIX separators).

    Absolute paths are accepted only when they lie under `root`. Symlinks are checked later by
    `resolve_inside`, when the file is opened.
    """
    if not isinstance(value, str) or not value:
        fail(file, field, f"expected a non-empty path string, got {show(value)}")
    if len(value) > MAX_PATH_BYTES:  # checked before anything echoes the value
        fail(file, field, f"path of {len(value)} characters is longer than the {MAX_PATH_BYTES} bytes a path may have")
    if "\x00" in value:
        fail(file, field, f"path {show(value)} contains a NUL byte")
    try:
        length = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # JSON escapes can spell lone surrogates, which no file name holds
        fail(file, field, f"path {show(value)} is not valid Unicode (it contains a lone surrogate)")
    if length > MAX_PATH_BYTES:
        fail(file, field, f"path of {length} bytes is longer than the {MAX_PATH_BYTES} bytes a path may have")
    candidate = value if os.path.isabs(value) else os.path.join(root, value)
    relative = os.path.relpath(os.path.normpath(candidate), root)
    if relative == os.curdir:
        fail(file, field, f"path {show(value)} is the cache directory itself, not a file in it")
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        fail(file, field, f"path {show(value)} is outside cache directory {root}")
    return relative.replace(os.sep, "/")


def resolve_inside(root: Path, relative: str, file: str, field: str) -> Path:
    """Resolve `relative` under `root`, following symlinks, and refuse anything that lands outside."""
    resolved = Path(os.path.realpath(os.path.join(root, relative)))
    if resolved != root and root not in resolved.parents:
        fail(file, field, f"path {show(relative)} resolves to {resolved}, outside cache directory {root}")
    return resolved


def open_regular(path: Path | str, display: str, follow: bool = True) -> tuple[int, os.stat_result]:
    """An open descriptor of `path` and its stat, refusing anything but a regular file.

    Opening without blocking and checking the open descriptor means a FIFO cannot hang the reader
    and a device cannot feed it forever. OS errors propagate for the caller to word (ELOOP when
    `follow` is false and `path` is a symlink).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    descriptor = os.open(path, flags)
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a pipe, socket or device"
            fail(display, "file", f"expected a regular file, got {kind}")
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor, info


class ContainedOpener:
    """Open files named relative to `root` without leaving it, resolving each directory only once.

    A file is opened as (resolved directory)/(name) without following a symlink in the last step;
    only a file that is itself a symlink pays for resolving its whole path (`resolve_inside`).
    """

    MAX_DIRECTORIES = 4096  # bounds the memory of a cache that gives every payload its own directory

    def __init__(self, root: Path) -> None:
        self.root = root
        self.directories: dict[str, str] = {}

    def open(self, relative: str, display: str) -> tuple[str, int, os.stat_result]:
        """The path opened, its descriptor and its stat (see `open_regular`)."""
        head, _, name = relative.rpartition("/")
        directory = self.directories.get(head)
        if directory is None:
            if len(self.directories) >= self.MAX_DIRECTORIES:
                self.directories.clear()
            resolved = resolve_inside(self.root, head, display, "cache_file") if head else self.root
            directory = self.directories[head] = str(resolved)
        path = os.path.join(directory, name)
        try:
            return (path, *open_regular(path, display, follow=False))
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
        path = str(resolve_inside(self.root, relative, display, "cache_file"))
        return (path, *open_regular(path, display))


def read_regular_file(path: Path, display: str, max_bytes: int | None = None) -> bytes:
    """The bytes of `path`, refusing anything but a regular file (and files over `max_bytes`)."""
    descriptor, info = open_regular(path, display)
    with os.fdopen(descriptor, "rb") as handle:
        if max_bytes is not None and info.st_size > max_bytes:
            fail(display, "file", f"is {info.st_size} bytes, more than the {max_bytes} bytes allowed")
        if max_bytes is None:
            return handle.read()
        data = handle.read(info.st_size + 1)  # read(n) allocates n bytes up front, so not max_bytes
    if len(data) > info.st_size:
        fail(display, "file", "grew while being read")
    return data
