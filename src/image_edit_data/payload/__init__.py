"""One sample's payload file -> tensors (safetensors or torch.save), and what to do with a broken one."""

from .corrupt import CorruptPolicy, SkipLog, TooManyCorruptSamplesError
from .member_check import MemberCheck
from .payload import (
    OpenPayload,
    PayloadFormat,
    format_of,
    load_payload,
    materialized,
    open_member,
    open_payload,
    payload_from_bytes,
    save_payload,
    to_safetensors,
)

__all__ = [
    "CorruptPolicy",
    "MemberCheck",
    "OpenPayload",
    "PayloadFormat",
    "SkipLog",
    "TooManyCorruptSamplesError",
    "format_of",
    "load_payload",
    "materialized",
    "open_member",
    "open_payload",
    "payload_from_bytes",
    "save_payload",
    "to_safetensors",
]
