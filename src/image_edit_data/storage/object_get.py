"""GETs from S3 through obstore (a Rust object-store client): shard downloads and ranged member reads.

A 32 MiB shard costs the client 31-33 ms of CPU through obstore against 51-59 ms through s3fs,
whose aiohttp body loop runs in Python and holds the GIL the training thread needs
(`benchmarks/s3_client.py`; docs/performance-remote.md); a ranged GET of one member costs it
about half. obstore refuses an answer to a ranged GET with a whole-object status (200), as `rclone
serve s3` gives, so ranged reads go through it only once an s3fs answer showed status 206
(`RemoteStore.ranged_get`). obstore is used only where it reaches
the same object as the same identity s3fs would: an S3 URL whose storage options hold nothing but
keys (or `anon`), an endpoint and a region, with an endpoint or a region given (s3fs finds a
bucket's region by following S3's redirects; obstore does not). Credentials come from the
options, else from botocore's own chain (environment, profile, SSO, instance role), as s3fs gets
them. Any other option (TLS settings, botocore config, a profile argument) keeps every request on
s3fs. Deadlines and retries stay `RemoteStore.call`'s: obstore's own retries are off, a connection
silent for the read timeout ends its try, and each try is bounded by the timeout `call` gives it.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # obstore's typed dicts exist for type checkers only
    from obstore.store import ClientConfig, S3Config, S3Credential, S3CredentialProvider

log = logging.getLogger(__name__)
S3_PROTOCOLS = ("s3", "s3a")  # the URL schemes s3fs serves (remote.py uses them too)
KEYS = frozenset({"key", "secret", "token", "anon", "endpoint_url", "client_kwargs", "config_kwargs"})
CLIENT_KEYS = frozenset({"endpoint_url", "region_name"})
# botocore settings obstore matches: ours (deadlines come from the policy, the CRC check is off anyway).
CONFIG = {"response_checksum_validation": "when_required"}
REFRESH = datetime.timedelta(minutes=5)  # how long obstore keeps credentials from a refreshing source


@dataclass(frozen=True)
class ObjectGetSettings:
    """Where and as whom obstore reads a cache's bucket (picklable: the store is made in each process)."""

    bucket: str
    region: str
    endpoint: str | None
    anonymous: bool
    credentials: tuple[str, str, str | None] | None  # (key, secret, token) from the options; None: botocore's chain


def object_get_settings(url: str, storage_options: Mapping[str, Any]) -> ObjectGetSettings | None:
    """obstore settings reaching `url`'s bucket as s3fs would with `storage_options`; None when they may not."""
    protocol, _, rest = url.partition("://")
    if protocol not in S3_PROTOCOLS or set(storage_options) - KEYS:
        return None
    client = dict(storage_options.get("client_kwargs") or {})
    config = dict(storage_options.get("config_kwargs") or {})
    if set(client) - CLIENT_KEYS or any(CONFIG.get(name) != value for name, value in config.items()):
        return None
    endpoint = storage_options.get("endpoint_url") or client.get("endpoint_url")
    region = client.get("region_name") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region is None and endpoint is None:
        return None  # s3fs would find the bucket's region by following S3's redirects; obstore does not
    key, secret, token = (storage_options.get(name) for name in ("key", "secret", "token"))
    anonymous = bool(storage_options.get("anon", False))
    if (key is None) != (secret is None):
        return None  # half a key pair: s3fs's error to give
    credentials = (str(key), str(secret), None if token is None else str(token)) if key is not None else None
    bucket = rest.split("/", 1)[0]
    return ObjectGetSettings(bucket, str(region or "us-east-1"), endpoint and str(endpoint), anonymous, credentials)


@functools.cache
def object_get_available() -> bool:
    """Whether obstore imports here (the `remote` extra brings it; without it every request goes through s3fs)."""
    try:
        import obstore.store  # noqa: F401
    except ImportError as error:
        if importlib.util.find_spec("obstore") is not None:
            log.warning("obstore is installed but does not import (%s); S3 downloads go through s3fs", error)
        return False
    return True


def object_key(url: str) -> str:
    """The key of an object URL within its bucket."""
    return url.partition("://")[2].split("/", 1)[1]


def make_store(settings: ObjectGetSettings, timeout: float, connect_timeout: float, read_timeout: float) -> Any:
    """An obstore S3 store for `settings`, its own retries off, each request bounded by `timeout` seconds and
    ended by `read_timeout` seconds of silence (waiting for the answer or for more of its body)."""
    from obstore.store import S3Store

    client: ClientConfig = {
        "connect_timeout": datetime.timedelta(seconds=connect_timeout),
        "read_timeout": datetime.timedelta(seconds=read_timeout),
        "timeout": datetime.timedelta(seconds=timeout),
    }
    config: S3Config = {"region": settings.region}
    if settings.endpoint is not None:
        config["endpoint"] = settings.endpoint
        client["allow_http"] = settings.endpoint.startswith("http://")
    provider = None
    if settings.anonymous:
        config["skip_signature"] = True
    else:
        provider = credential_provider(settings.credentials)
    return S3Store(
        settings.bucket,
        config=config,
        client_options=client,
        retry_config={"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=timeout)},
        credential_provider=provider,
    )


def credential_provider(given: tuple[str, str, str | None] | None) -> S3CredentialProvider:
    """Credentials for obstore: the options' keys, or botocore's chain (refreshed every few minutes)."""
    if given is not None:
        key, secret, token = given

        def fixed() -> S3Credential:
            return {"access_key_id": key, "secret_access_key": secret, "token": token, "expires_at": None}

        return fixed
    import botocore.session  # s3fs's own dependency, through aiobotocore

    found = botocore.session.get_session().get_credentials()
    if found is None:
        raise PermissionError("no AWS credentials found (environment, profile, SSO or instance role)")

    def chained() -> S3Credential:
        frozen = found.get_frozen_credentials()
        expires = datetime.datetime.now(datetime.timezone.utc) + REFRESH
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expires,
        }

    return chained


def runtime_usable() -> bool:
    """Whether obstore may run in this process: not a fork of one whose obstore runtime had started.

    obstore's requests run on a runtime of Rust threads that a forked child does not inherit, so
    a request there would wait for threads that do not exist (seen: a 46 s hang to the deadline).
    Such a child sends its requests through s3fs instead; a process that never started the runtime
    before forking leaves its children free to use obstore.
    """
    return _runtime_pid is None or _runtime_pid == os.getpid()


_runtime_pid: int | None = None  # the process whose obstore runtime has started


def get_object(store: Any, url: str) -> Any:
    """The whole object at `url` as a buffer; obstore's not-found and access errors as Python's own."""
    import obstore

    return _request(lambda: obstore.get(store, object_key(url)).bytes())


def get_range(store: Any, url: str, start: int, length: int) -> Any:
    """`length` bytes of the object at `url` from `start`, as a buffer (fewer where the object ends sooner).

    Errors as `get_object`'s. Only for an endpoint known to answer ranges with status 206: obstore
    refuses any other answer with its generic error.
    """
    import obstore

    return _request(lambda: obstore.get_range(store, object_key(url), start=start, length=length))


def _request(send: Callable[[], Any]) -> Any:
    """Run one obstore request in this process, its not-found and access errors as Python's own."""
    global _runtime_pid
    from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

    if not runtime_usable():
        raise RuntimeError("obstore cannot run in a process forked after it started (use s3fs here)")
    _runtime_pid = os.getpid()
    try:
        return send()
    except NotFoundError as error:
        raise FileNotFoundError(str(error)) from error
    except (PermissionDeniedError, UnauthenticatedError) as error:
        raise PermissionError(str(error)) from error
