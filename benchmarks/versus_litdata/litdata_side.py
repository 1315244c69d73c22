"""The litdata half of `bench versus-litdata`: the same samples written with `litdata.optimize`, and its loader.

litdata (0.2.76, the `bench` extra) is imported only here, on first use. Its tensor serializer
goes through numpy, which has no bfloat16, so each bf16 tensor is stored as its int16 view (the
same bytes) and viewed back as bf16 after collate, which copies nothing. Each item also carries
its sample number, so the bench can check that both loaders hand out the same bytes per sample.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from image_edit_data.index.store import open_index
from image_edit_data.payload.payload import load_payload

from .sample_digest import sample_number

STORED_BF16 = torch.int16  # litdata cannot write bf16; the int16 view holds the same bytes


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(STORED_BF16) if tensor.dtype == torch.bfloat16 else tensor


def litdata_item(cache_dir: str, relative: str) -> dict[str, Any]:
    """One sample of our one-file cache as a litdata item (module level: `optimize` runs it in spawned workers)."""
    payload = load_payload(Path(cache_dir) / relative, relative)
    return {
        "sample": sample_number(payload["metadata"]["original_ids"]),
        "target_latent": _stored(payload["target_latent"]),
        "context_latents": [_stored(c) for c in payload["context_latents"]],
        "prompt_embeddings": _stored(payload["prompt_embeddings"]),
        "prompt_attention_mask": payload["prompt_attention_mask"],
    }


@contextlib.contextmanager
def _quiet_descriptors() -> Iterator[None]:
    """Send stdout and stderr of this process and the workers it starts to /dev/null (optimize's progress chatter)."""
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        try:
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for descriptor in saved:
                os.close(descriptor)


def write_litdata(cache_dir: Path, output_dir: Path, chunk_bytes: int) -> None:
    """Write every sample of the one-file cache `cache_dir` as a litdata dataset in `output_dir`."""
    import litdata

    index = open_index(cache_dir)
    relatives = [index.relative_path(i) for i in range(len(index))]
    item = partial(litdata_item, str(cache_dir))
    with _quiet_descriptors():
        litdata.optimize(item, relatives, str(output_dir), chunk_bytes=chunk_bytes, num_workers=1, mode="overwrite")


def allow_plain_http() -> None:
    """Let litdata's obstore client reach an http:// endpoint (the local moto server).

    litdata passes its own obstore client options without `allow_http`, so an http:// endpoint fails
    with "builder error" (and the `AWS_ALLOW_HTTP` variable is ignored once options are passed).
    A module-level dict of litdata's: the one private name this bench touches, for the test endpoint only.
    """
    import litdata.streaming.downloader as downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True


def litdata_loader(
    input_dir: str, workers: int, batch_size: int, cache_dir: str | None, storage_options: dict[str, Any] | None
) -> Any:
    """litdata's StreamingDataLoader over `input_dir` (a local directory or s3:// URL), shuffled, with its defaults."""
    import litdata

    if input_dir.startswith("s3://"):
        allow_plain_http()
        dataset = litdata.StreamingDataset(
            input_dir, cache_dir=cache_dir, storage_options=storage_options, shuffle=True
        )
    else:
        dataset = litdata.StreamingDataset(input_dir, shuffle=True)
    return litdata.StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers)


def as_bf16(batch: dict[str, Any]) -> dict[str, Any]:
    """A litdata batch with its stored int16 views back as bf16 (no copy), as training would use it."""
    batch["target_latent"] = batch["target_latent"].view(torch.bfloat16)
    batch["context_latents"] = [c.view(torch.bfloat16) for c in batch["context_latents"]]
    batch["prompt_embeddings"] = batch["prompt_embeddings"].view(torch.bfloat16)
    return batch


def litdata_rows(batch: dict[str, Any]) -> Iterator[tuple[int, Sequence[torch.Tensor]]]:
    """Per sample of a litdata batch: its number and its tensors (target, contexts, prompt, mask) in digest order."""
    for row, number in enumerate(batch["sample"].tolist()):
        tensors = [batch["target_latent"][row], *(c[row] for c in batch["context_latents"])]
        yield int(number), [*tensors, batch["prompt_embeddings"][row], batch["prompt_attention_mask"][row]]
