"""One sample's payload file -> tensors (safetensors or torch.save), and what to do with a broken one."""

from .corrupt import CorruptPolicy, SkipLog, TooManyCorruptSamplesError
from .payload import (
    OpenPayload,
    PayloadFormat,
    format_of,
    load_payload,
    materialized,
    open_payload,
    save_payload,
    to_safetensors,
)

__all__ = [
    "CorruptPolicy",
    "OpenPayload",
    "PayloadFormat",
    "SkipLog",
    "TooManyCorruptSamplesError",
    "format_of",
    "load_payload",
    "materialized",
    "open_payload",
    "save_payload",
    "to_safetensors",
]
