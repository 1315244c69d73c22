"""The contracts: compound shape signatures, every rule a cache must follow, path containment, the batch's keys."""

from . import validate
from .batch import Batch, BatchMetadata, Sample, SkippedSample
from .paths import ContainedOpener, contained, open_regular, read_regular_file, resolve_inside
from .signature import Shape3, Signature, sort_key

__all__ = [
    "Batch",
    "BatchMetadata",
    "ContainedOpener",
    "Sample",
    "Shape3",
    "Signature",
    "SkippedSample",
    "contained",
    "open_regular",
    "read_regular_file",
    "resolve_inside",
    "sort_key",
    "validate",
]
