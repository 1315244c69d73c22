"""Path options made absolute when a command starts, before any child process (with its own cwd) reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def resolve_path_options(args: Any, names: tuple[str, ...]) -> None:
    """Replace each named option of `args` that is set by its absolute path, `~` expanded and symlinks resolved.

    A relative path means the directory the command was started in; a child process (a fork server's,
    or one the pool starts with another working directory) would read it against its own.
    """
    for name in names:
        value = getattr(args, name)
        if value is not None:
            setattr(args, name, str(Path(value).expanduser().resolve()))
