"""The cache contract: compound shape signatures, every rule a cache must follow, path containment."""

from . import validate
from .paths import ContainedOpener, contained, open_regular, read_regular_file, resolve_inside
from .signature import Shape3, Signature, sort_key

__all__ = [
    "ContainedOpener",
    "Shape3",
    "Signature",
    "contained",
    "open_regular",
    "read_regular_file",
    "resolve_inside",
    "sort_key",
    "validate",
]
