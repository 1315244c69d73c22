"""Every rule of the cache contract, in one place.

Index rules run once when a cache is opened; payload rules run per sample against its index
record. Every violation is a `CacheFormatError` (a `ValueError`) whose message reads
``<file>: <field>: <problem>`` so a user can go straight to the bad entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CacheFormatError as CacheFormatError  # re-exported: the contract's error
from ..errors import fail, show
from .batch import EDIT_MASK
from .file_tensor import FileTensor
from .signature import Signature

MAX_COUNT = 2**31 - 1  # token counts are stored as int32 in the index
MAX_DIM = 2**63 - 1  # torch sizes are int64; a larger dimension can never match a tensor
# Pickle can nest without limit, and a batch's metadata is later pickled to the main process,
# copied and logged; these bounds are far beyond any real payload's metadata.
MAX_METADATA_DEPTH = 32
MAX_METADATA_VALUES = 100_000


def _is_int(value: object) -> bool:
    """True for JSON/Python integers, false for booleans (which Python counts as ints)."""
    return type(value) is int


def nonnegative_int(value: object, file: str, field: str) -> int:
    """Check a token count or similar non-negative integer (below 2**31)."""
    if not _is_int(value) or not 0 <= value <= MAX_COUNT:  # type: ignore[operator]
        fail(file, field, f"expected a non-negative integer below 2**31, got {show(value)}")
    return value  # type: ignore[return-value]


def shape(value: object, rank: int, file: str, field: str, allow_zero: bool = False) -> tuple[int, ...]:
    """Check a JSON shape list of `rank` integers (positive unless `allow_zero`)."""
    if not isinstance(value, (list, tuple)) or len(value) != rank:
        fail(file, field, f"must contain exactly {rank} dimensions (a list of {rank} integers), got {show(value)}")
    lowest = 0 if allow_zero else 1
    for dim in value:
        if not _is_int(dim) or not lowest <= dim <= MAX_DIM:
            kind = "non-negative" if allow_zero else "positive"
            fail(file, field, f"expected {kind} integer dimensions below 2**63, got {show(value)}")
    return tuple(value)


def signature(value: object, file: str, field: str) -> Signature:
    """Parse `{"target": [C,H,W], "contexts": [[C,h,w], ...]}` (contexts may be empty; `"mask": true` optional)."""
    if not isinstance(value, Mapping):
        fail(file, field, f"expected an object with 'target' and 'contexts', got {type(value).__name__}")
    target = shape(value.get("target"), 3, file, f"{field}.target")
    contexts = value.get("contexts")
    if not isinstance(contexts, list):
        fail(file, f"{field}.contexts", f"expected a list of [C, h, w] shapes (or none), got {show(contexts)}")
    parsed = tuple(shape(c, 3, file, f"{field}.contexts[{i}]") for i, c in enumerate(contexts))
    mask = value.get("mask", False)
    if type(mask) is not bool:
        fail(file, f"{field}.mask", f"expected true or false, got {show(mask)}")
    return Signature(target=target, contexts=parsed, mask=mask)  # type: ignore[arg-type]


def _plain_tensor(value: object, file: str, field: str) -> torch.Tensor | FileTensor:
    """Check for a dense CPU tensor backed by its own data (so it costs no more memory than its file).

    A `FileTensor` passes as it is: its header entry was checked to hold exactly its bytes.
    """
    if type(value) is FileTensor:
        return value
    if not isinstance(value, torch.Tensor):
        fail(file, field, f"expected a tensor, got {type(value).__name__}")
    if value.device.type != "cpu" or value.layout != torch.strided:
        fail(file, field, f"expected a dense CPU tensor, got layout {value.layout} on device {value.device}")
    # A zero-stride view of a tiny storage can claim any shape; stacking it would allocate all of it.
    needed = (value.storage_offset() + value.numel()) * value.element_size()
    if value.numel() and value.untyped_storage().nbytes() < needed:
        fail(
            file,
            field,
            f"shape {list(value.shape)} needs {needed} bytes but the stored data holds "
            f"{value.untyped_storage().nbytes()} (an expanded or overlapping view)",
        )
    return value


def latent(value: object, file: str, field: str) -> tuple[int, int, int]:
    """Check a floating `[C, H, W]` latent tensor and return its shape."""
    value = _plain_tensor(value, file, field)
    if value.ndim != 3:
        fail(file, field, f"expected shape [channels, height, width], got {tuple(value.shape)}")
    if not value.is_floating_point():
        fail(file, field, f"expected a floating-point dtype, got {value.dtype}")
    return tuple(value.shape)  # type: ignore[return-value]


def _tensor_field(payload: Mapping[str, Any], name: str, file: str) -> torch.Tensor | FileTensor:
    """Fetch a required tensor entry of a payload."""
    return _plain_tensor(payload.get(name), file, name)


def payload(raw: object, expected: Signature, file: str, manifest_revision: str | None) -> dict[str, Any]:
    """Check one loaded payload against the contract and its index record; return the sample dict."""
    if not isinstance(raw, Mapping):
        fail(file, "payload", f"expected a mapping of cache fields, got {type(raw).__name__}")
    target = _tensor_field(raw, "target_latent", file)
    target_shape = latent(target, file, "target_latent")
    contexts = raw.get("context_latents")
    if not isinstance(contexts, (list, tuple)):
        fail(file, "context_latents", f"expected a list of tensors (empty: no context), got {type(contexts).__name__}")
    context_shapes = tuple(latent(c, file, f"context_latents[{i}]") for i, c in enumerate(contexts))
    conditioning = raw.get("conditioning_tensors", {})
    if conditioning is None:
        conditioning = {}
    if not isinstance(conditioning, Mapping):
        fail(file, "conditioning_tensors", f"expected a mapping of name to tensor, got {type(conditioning).__name__}")
    actual = Signature(target=target_shape, contexts=context_shapes, mask=EDIT_MASK in conditioning)
    if actual != expected:
        problem = f"tensor shapes {actual.describe()} do not match metadata shard signature {expected.describe()}"
        fail(file, "compound_bucket_signature", problem)

    embeddings = _tensor_field(raw, "prompt_embeddings", file)
    if embeddings.ndim != 2 or not embeddings.is_floating_point():
        fail(
            file,
            "prompt_embeddings",
            f"expected a floating tensor [sequence, hidden], got {tuple(embeddings.shape)} {embeddings.dtype}",
        )
    mask = _tensor_field(raw, "prompt_attention_mask", file)
    if mask.ndim != 1 or mask.shape[0] != embeddings.shape[0]:
        fail(
            file,
            "prompt_attention_mask",
            f"prompt_attention_mask must have shape [sequence] matching prompt_embeddings ({embeddings.shape[0]},), "
            f"got {tuple(mask.shape)}",
        )
    if mask.is_floating_point() or mask.is_complex():
        fail(file, "prompt_attention_mask", f"expected a bool or integer dtype, got {mask.dtype}")

    checked: dict[str, Any] = {}
    for name, tensor in conditioning.items():
        if not isinstance(name, str) or not name:
            fail(file, "conditioning_tensors", f"expected non-empty string names, got {show(name)}")
        if name == EDIT_MASK:
            checked[name] = edit_mask(tensor, target_shape[1:], file)
        else:
            checked[name] = _plain_tensor(tensor, file, f"conditioning_tensors.{name}")

    metadata = _sample_metadata(raw.get("metadata"), actual, embeddings.shape[0], checked, file, manifest_revision)
    return {
        "target_latent": target,
        "context_latents": list(contexts),
        "prompt_embeddings": embeddings,
        "prompt_attention_mask": mask,
        "conditioning_tensors": checked,
        "metadata": metadata,
    }


def edit_mask(value: object, spatial: tuple[int, ...], file: str) -> torch.Tensor:
    """Check an edit mask (floating `[H, W]` at the target latent's `spatial` size, values in [0, 1]); return it read.

    A mask is small (one channel at latent resolution) and its values weight the loss, so it is read and
    checked on every load rather than only by `cache validate`; the batch then copies it from memory.
    """
    field = f"conditioning_tensors.{EDIT_MASK}"
    tensor = _plain_tensor(value, file, field)
    if tuple(tensor.shape) != tuple(spatial):
        fail(file, field, f"expected shape {list(spatial)} (the target latent's [H, W]), got {list(tensor.shape)}")
    if not tensor.is_floating_point():
        fail(file, field, f"expected a floating-point dtype (float32), got {tensor.dtype}")
    values = tensor.materialize() if isinstance(tensor, FileTensor) else tensor
    if not bool(((values >= 0) & (values <= 1)).all()):  # NaN fails both comparisons
        nan, inf = int(torch.isnan(values).sum()), int(torch.isinf(values).sum())
        if nan or inf:
            fail(file, field, f"expected finite values in [0, 1], got {nan} NaN and {inf} Inf values")
        low, high = float(values.min()), float(values.max())
        fail(file, field, f"expected values in [0, 1] (1 = edited), got values from {low:g} to {high:g}")
    return values


SCALAR_TYPES = frozenset((str, int, float, bool, type(None)))


def bounded(value: object, file: str, field: str) -> None:
    """Refuse a nested value deeper than MAX_METADATA_DEPTH or holding more than MAX_METADATA_VALUES values.

    Only containers are walked; scalars are counted where they sit (this runs for every sample,
    so the common JSON shapes, dicts with string keys and lists, take the short paths).
    """
    count = 1
    stack: list[tuple[Any, int]] = [(value, 1)]
    push, pop = stack.append, stack.pop
    while stack:
        item, depth = pop()
        kind = type(item)
        odd_keys = False
        children: Any
        if kind is dict:
            size = 2 * len(item)
            children = item.values()
            odd_keys = not SCALAR_TYPES.issuperset(map(type, item))  # e.g. tuple keys of pickled metadata
        elif kind is list:
            size, children = len(item), item
        elif isinstance(item, Mapping):
            children = [*item.keys(), *item.values()]
            size = len(children)
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = list(item)
            size = len(children)
        else:
            continue
        if not size:
            continue
        if depth >= MAX_METADATA_DEPTH:
            fail(file, field, f"nests deeper than {MAX_METADATA_DEPTH} levels")
        count += size
        if count > MAX_METADATA_VALUES:
            fail(file, field, f"holds more than {MAX_METADATA_VALUES} values")
        for child in children:
            if type(child) not in SCALAR_TYPES:
                push((child, depth + 1))
        if odd_keys:
            for key in item:
                if type(key) not in SCALAR_TYPES:
                    push((key, depth + 1))


def _sample_metadata(
    raw: object,
    sig: Signature,
    sequence_length: int,
    conditioning: Mapping[str, torch.Tensor],
    file: str,
    manifest_revision: str | None,
) -> dict[str, Any]:
    """Check a payload's `metadata` entry and fill in the token-length defaults."""
    if not isinstance(raw, Mapping):
        fail(file, "metadata", f"expected a mapping, got {type(raw).__name__}")
    bounded(raw, file, "metadata")
    ids = raw.get("original_ids")
    if not isinstance(ids, Mapping) or not ids:
        fail(file, "metadata.original_ids", f"expected a non-empty mapping, got {show(ids)}")
    for name, value in ids.items():
        if not isinstance(name, str) or not name or not (isinstance(value, str) or _is_int(value)):
            fail(file, "metadata.original_ids", f"expected non-empty names mapped to str or int ids, got {show(name)}")

    revision = raw.get("source_revision")
    if revision is not None:
        if not isinstance(revision, str) or not revision:
            fail(file, "metadata.source_revision", f"expected a non-empty string, got {show(revision)}")
        if manifest_revision is not None and revision != manifest_revision:
            fail(
                file,
                "metadata.source_revision",
                f"{show(revision)} differs from the manifest's {show(manifest_revision)}",
            )

    spatial = shape(raw.get("target_spatial_shape"), 2, file, "metadata.target_spatial_shape")
    if spatial != sig.target[1:]:
        fail(file, "metadata.target_spatial_shape", f"expected {list(sig.target[1:])}, got {list(spatial)}")
    raw_context_shapes = raw.get("context_spatial_shapes")
    if not isinstance(raw_context_shapes, list):
        fail(file, "metadata.context_spatial_shapes", f"expected a list of [h, w], got {show(raw_context_shapes)}")
    context_spatial = [
        list(shape(s, 2, file, f"metadata.context_spatial_shapes[{i}]")) for i, s in enumerate(raw_context_shapes)
    ]
    expected_context_spatial = [list(c[1:]) for c in sig.contexts]
    if context_spatial != expected_context_spatial:
        fail(file, "metadata.context_spatial_shapes", f"expected {expected_context_spatial}, got {context_spatial}")
    declared = signature(raw.get("compound_bucket_signature"), file, "metadata.compound_bucket_signature")
    if declared != sig:
        fail(
            file, "metadata.compound_bucket_signature", f"declares {declared.describe()}, tensors are {sig.describe()}"
        )

    declared_conditioning = raw.get("conditioning_shapes", {})
    if not isinstance(declared_conditioning, Mapping):
        fail(file, "metadata.conditioning_shapes", f"expected a mapping, got {type(declared_conditioning).__name__}")
    if set(declared_conditioning) != set(conditioning):
        fail(
            file,
            "metadata.conditioning_shapes",
            f"names {sorted(map(str, declared_conditioning))} differ from conditioning_tensors {sorted(conditioning)}",
        )
    conditioning_shapes: dict[str, list[int]] = {}
    for name, tensor in conditioning.items():
        field = f"metadata.conditioning_shapes.{name}"
        declared_shape = shape(declared_conditioning[name], tensor.ndim, file, field, allow_zero=True)
        if declared_shape != tuple(tensor.shape):
            fail(file, field, f"declares {list(declared_shape)}, tensor is {list(tensor.shape)}")
        conditioning_shapes[name] = list(declared_shape)

    target_tokens = raw.get("target_token_length", sig.target[1] * sig.target[2])
    target_tokens = nonnegative_int(target_tokens, file, "metadata.target_token_length")
    context_tokens = raw.get("context_token_lengths")
    if context_tokens is None:
        context_tokens = [c[1] * c[2] for c in sig.contexts]
    if not isinstance(context_tokens, list) or len(context_tokens) != len(sig.contexts):
        fail(
            file, "metadata.context_token_lengths", f"expected {len(sig.contexts)} integers, got {show(context_tokens)}"
        )
    context_tokens = [
        nonnegative_int(n, file, f"metadata.context_token_lengths[{i}]") for i, n in enumerate(context_tokens)
    ]
    text_tokens = nonnegative_int(raw.get("text_token_length", sequence_length), file, "metadata.text_token_length")
    if text_tokens > sequence_length:
        fail(file, "metadata.text_token_length", f"{text_tokens} exceeds the prompt sequence length {sequence_length}")

    normalized = dict(raw)
    normalized.update(
        original_ids=dict(ids),
        source_revision=revision,
        target_spatial_shape=list(spatial),
        context_spatial_shapes=context_spatial,
        compound_bucket_signature=sig.to_json(),
        conditioning_shapes=conditioning_shapes,
        target_token_length=target_tokens,
        context_token_lengths=context_tokens,
        text_token_length=text_tokens,
    )
    return normalized
