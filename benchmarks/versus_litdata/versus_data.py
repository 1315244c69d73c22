"""The data of `bench versus-litdata`: one synthetic cache written three ways, locally and into the S3 endpoint.

Our one-file cache (`files/`), the same cache packed by `cache pack` (`packed/`, member checksums
in its index) and the same samples written by `litdata.optimize` (`litdata/`), with shards and
chunks of the same size; the packed cache and the litdata dataset are then put in one bucket of
each S3 endpoint. Every sample's digest is taken from the one-file cache, the reference both loaders must match.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.local_s3 import Endpoint, LocalS3, boto3_options, make_bucket, upload_directory

from image_edit_data.bench.synthetic import synthetic_spec, write_synthetic_cache
from image_edit_data.index.store import open_index
from image_edit_data.payload.payload import load_payload
from image_edit_data.preprocess.tools.pack import pack_cache

from .litdata_side import write_litdata
from .sample_digest import payload_tensors, sample_digest, sample_number

BUCKET = "versus-litdata"


@dataclass(frozen=True)
class LocalCopies:
    """The three local copies of the samples, and each sample's reference digest."""

    files: Path
    packed: Path
    litdata: Path
    digests: dict[int, str]


@dataclass(frozen=True)
class RemoteCopies:
    """The packed cache and the litdata dataset in the endpoint, with the options each loader reaches it by."""

    packed: str
    litdata: str
    ours_options: dict[str, Any]  # fsspec style
    litdata_options: dict[str, Any]  # boto3 client arguments
    server_pid: int
    endpoint: Endpoint


def write_local_copies(root: Path, samples: int, preset: str, chunk_bytes: int) -> LocalCopies:
    """Write the synthetic cache under `root`, pack it, write it with litdata, and digest every sample."""
    spec = synthetic_spec(preset, None, None, 1, "safetensors")
    files = write_synthetic_cache(root / "files", samples, spec)
    pack_cache(files, str(root / "packed"), chunk_bytes)
    write_litdata(files, root / "litdata", chunk_bytes)
    return LocalCopies(files, root / "packed", root / "litdata", reference_digests(files))


def reference_digests(cache_dir: Path) -> dict[int, str]:
    """Each sample's digest, read from the one-file cache by the plain payload loader."""
    index = open_index(cache_dir)
    digests = {}
    for i in range(len(index)):
        relative = index.relative_path(i)
        payload = load_payload(cache_dir / relative, relative)
        digests[sample_number(payload["metadata"]["original_ids"])] = sample_digest(payload_tensors(payload))
    return digests


def upload_copies(local: LocalCopies, chunk_bytes: int, server: LocalS3, staging: Path) -> RemoteCopies:
    """Pack the one-file cache into the endpoint (as `cache pack` to a URL does) and upload the litdata dataset."""
    options = server.options
    make_bucket(options, BUCKET)
    packed, litdata = f"s3://{BUCKET}/packed", f"s3://{BUCKET}/litdata"
    pack_cache(local.files, packed, chunk_bytes, storage_options=options, staging_dir=str(staging))
    upload_directory(options, local.litdata, litdata)
    return RemoteCopies(packed, litdata, options, boto3_options(options), server.pid, server.endpoint)
