"""Client CPU and wall time per S3 request: s3fs (our client) against obstore (litdata's), on moto.

Usage: python scripts/bench_s3_client.py [--requests 200] [--rounds 2]

Puts one 32 MiB object (a packed shard's size) on moto's server on 127.0.0.1 (dummy credentials), then
per round and client, alternating: `--requests` ranged GETs of 0.9 MB (one sample of the `small`
preset, as `range` mode reads it), one at a time, and five whole-object GETs (as the shard cache
downloads a shard). Prints wall time and this process's CPU per request. Both clients have their
own retries off, as the read path runs them. Needs the `remote` extra and obstore (`pip install obstore`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import resource
import time
from collections.abc import Callable
from typing import Any

from image_edit_data.bench.local_s3 import make_bucket, moto_server

BUCKET, KEY = "client-bench", "shard.tar"
OBJECT_BYTES, SAMPLE_BYTES, WHOLE_GETS = 32 << 20, 900_000, 5


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def clients(options: dict[str, Any]) -> dict[str, tuple[Callable[[int, int], bytes], Callable[[], bytes]]]:
    """Per client: (ranged GET of [start, end), whole-object GET)."""
    import obstore
    import s3fs
    from obstore.store import S3Store

    fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={"retries": {"total_max_attempts": 1}}, **options)
    fs.retries = 1
    store = S3Store(
        BUCKET,
        endpoint=options["endpoint_url"],
        access_key_id=options["key"],
        secret_access_key=options["secret"],
        region="us-east-1",
        client_options={"allow_http": True},
        retry_config={"max_retries": 0, "backoff": {}, "retry_timeout": datetime.timedelta(seconds=30)},
    )
    path = f"{BUCKET}/{KEY}"
    return {
        "s3fs": (lambda s, e: fs.cat_file(path, start=s, end=e), lambda: fs.cat_file(path)),
        "obstore": (
            lambda s, e: bytes(obstore.get_range(store, KEY, start=s, end=e)),
            lambda: bytes(obstore.get(store, KEY).bytes()),
        ),
    }


def measure(requests: int, rounds: int) -> None:
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    with moto_server() as options:
        make_bucket(options, BUCKET)
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **options).pipe_file(f"{BUCKET}/{KEY}", os.urandom(OBJECT_BYTES))
        reads = clients(options)
        for ranged, _ in reads.values():  # both clients connected before any clock
            ranged(0, 1)
        starts = [random.randrange(OBJECT_BYTES - SAMPLE_BYTES) for _ in range(requests)]
        for number in range(rounds):
            for name, (ranged, whole) in reads.items() if number % 2 == 0 else reversed(reads.items()):
                cpu, clock = process_cpu(), time.perf_counter()
                for start in starts:
                    assert len(ranged(start, start + SAMPLE_BYTES)) == SAMPLE_BYTES
                wall, used = (time.perf_counter() - clock) / requests, (process_cpu() - cpu) / requests
                print(f"round {number} {name:8s} ranged 0.9 MB: {wall * 1e3:6.2f} ms wall, {used * 1e3:5.2f} ms CPU")
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
