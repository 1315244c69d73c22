"""Client CPU and wall time per S3 request: s3fs and obstore as the read path runs them, on moto.

Usage: python -m benchmarks.s3_client [--requests 200] [--rounds 2]

Puts one 32 MiB object (a packed shard's size) on moto's server on 127.0.0.1 (dummy credentials), then
per round and client, alternating: `--requests` ranged GETs of 0.9 MB (one sample of the `small`
preset, as `range` mode reads it), one at a time, and five whole-object GETs (as the shard cache
downloads a shard). Prints wall time and this process's CPU per request. The clients: s3fs with the
options `RemoteStore` gives it (botocore's retries and response CRC off), s3fs with botocore's CRC
check on (its default), and obstore's store as `storage/object_get.py` makes it (a buffer, not
copied). Needs the `remote` extra.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import time
from collections.abc import Callable
from typing import Any

from support.local_s3 import make_bucket, moto_server

BUCKET, KEY = "client-bench", "shard.tar"
OBJECT_BYTES, SAMPLE_BYTES, WHOLE_GETS = 32 << 20, 900_000, 5


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def clients(options: dict[str, Any]) -> dict[str, tuple[Callable[[int, int], Any] | None, Callable[[], Any]]]:
    """Per client: (ranged GET of [start, end) or None, whole-object GET)."""
    import fsspec

    from image_edit_data.storage.object_get import get_object, get_range, make_store, object_get_settings
    from image_edit_data.storage.remote import RequestPolicy, client_options

    policy = RequestPolicy()
    ours = fsspec.filesystem("s3", skip_instance_cache=True, **client_options("s3", options, policy))
    crc = {**options, "config_kwargs": {"response_checksum_validation": "when_supported"}}
    with_crc = fsspec.filesystem("s3", skip_instance_cache=True, **client_options("s3", crc, policy))
    for fs in (ours, with_crc):
        fs.retries = 1
    settings = object_get_settings(f"s3://{BUCKET}", options)
    assert settings is not None, "the test endpoint's options map onto obstore"
    store = make_store(settings, policy.try_timeout + 60, policy.connect_timeout, policy.read_timeout)
    path = f"{BUCKET}/{KEY}"
    return {
        "s3fs": (lambda s, e: ours.cat_file(path, start=s, end=e), lambda: ours.cat_file(path)),
        "s3fs+crc": (None, lambda: with_crc.cat_file(path)),
        "obstore": (
            lambda s, e: get_range(store, f"s3://{path}", s, e - s),
            lambda: get_object(store, f"s3://{path}"),
        ),
    }


def measure(requests: int, rounds: int) -> None:
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    with moto_server() as options:
        make_bucket(options, BUCKET)
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **options).pipe_file(f"{BUCKET}/{KEY}", os.urandom(OBJECT_BYTES))
        reads = clients(options)
        for _, whole in reads.values():  # every client connected before any clock
            whole()
        starts = [random.randrange(OBJECT_BYTES - SAMPLE_BYTES) for _ in range(requests)]
        for number in range(rounds):
            for name, (ranged, whole) in reads.items() if number % 2 == 0 else reversed(reads.items()):
                if ranged is not None:
                    cpu, clock = process_cpu(), time.perf_counter()
                    for start in starts:
                        assert len(ranged(start, start + SAMPLE_BYTES)) == SAMPLE_BYTES
                    wall, used = (time.perf_counter() - clock) / requests, (process_cpu() - cpu) / requests
                    print(
                        f"round {number} {name:8s} ranged 0.9 MB: {wall * 1e3:6.2f} ms wall, {used * 1e3:5.2f} ms CPU"
                    )
                cpu, clock = process_cpu(), time.perf_counter()
                for _ in range(WHOLE_GETS):
                    assert len(whole()) == OBJECT_BYTES
                wall, used = (time.perf_counter() - clock) / WHOLE_GETS, (process_cpu() - cpu) / WHOLE_GETS
                print(f"round {number} {name:8s} whole 32 MiB:  {wall * 1e3:6.1f} ms wall, {used * 1e3:5.1f} ms CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="ranged GETs per client and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the clients' order swapped every round")
    arguments = parser.parse_args()
    measure(arguments.requests, arguments.rounds)


if __name__ == "__main__":
    main()
