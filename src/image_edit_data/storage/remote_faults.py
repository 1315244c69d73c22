"""What a remote client's error means for another try: botocore's, aiohttp's and obstore's types, then `_retry`.

A status code found on the error decides first (`_retry.http_status`: 404 missing, 408/429/5xx
transient, any other 4xx refused). Then the clients' own types: connection, timeout and
truncated-body errors are transient; missing credentials are refused; obstore's generic error,
which carries neither type nor status, is unclassified (the store tries it again through s3fs,
whose answer has a status). An error that is none of these (a programming error, a bad option)
propagates untouched. Nothing here reads message text.
"""

from __future__ import annotations

import functools

from .._retry import Fault, fault_of, http_status


class RemoteError(OSError):
    """A request to a remote cache failed for good; the message names the URL and what was asked.

    Raised for the endpoint or the connection (a deadline, an error answer, a broken body), never
    for the bytes a cache holds: the corrupt-sample policy does not apply to it.
    """


@functools.cache
def client_types() -> dict[Fault, tuple[type[BaseException], ...]]:
    """The remote clients' exception types by what they mean (those installed: the [remote] extra brings them)."""
    found: dict[Fault, list[type[BaseException]]] = {fault: [] for fault in Fault}
    try:
        from botocore import exceptions as boto
    except ImportError:
        pass
    else:
        found[Fault.TRANSIENT] += [boto.HTTPClientError, boto.ConnectionError, boto.IncompleteReadError]
        found[Fault.REFUSED] += [
            boto.NoCredentialsError,
            boto.PartialCredentialsError,
            boto.CredentialRetrievalError,
            boto.NoRegionError,
        ]
    try:
        import aiohttp
    except ImportError:
        pass
    else:
        found[Fault.TRANSIENT] += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    try:
        from obstore import exceptions as objects
    except ImportError:
        pass
    else:
        found[Fault.UNCLASSIFIED] += [objects.GenericError, objects.JoinError]
        found[Fault.REFUSED] += [objects.PermissionDeniedError, objects.UnauthenticatedError]
    return {fault: tuple(types) for fault, types in found.items()}


def remote_fault(error: BaseException) -> Fault | None:
    """What `error`, raised by one try of a remote request, means for another try (None: not a request fault)."""
    if isinstance(error, RemoteError):
        return None  # a request that used up its own tries
    status = http_status(error)
    if status is not None:
        return fault_of(error)
    for fault, types in client_types().items():
        if types and isinstance(error, types):
            return fault
    return fault_of(error)
