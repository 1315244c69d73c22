"""The contracts: compound shape signatures, every rule a cache must follow, path containment, the batch's keys.

Also the value types those rules check: `FileTensor`, a payload tensor not yet read from its file.
"""

from . import validate
from .batch import EDIT_MASK, Batch, BatchMetadata, Sample, SkippedSample
from .file_tensor import FileTensor, read_into
from .paths import ContainedOpener, contained, open_regular, read_regular_file, resolve_inside
from .signature import Shape3, Signature, sort_key

__all__ = [
    "EDIT_MASK",
    "Batch",
    "BatchMetadata",
    "ContainedOpener",
    "FileTensor",
    "Sample",
    "Shape3",
    "Signature",
    "SkippedSample",
    "contained",
    "open_regular",
    "read_into",
    "read_regular_file",
    "resolve_inside",
    "sort_key",
    "validate",
]
