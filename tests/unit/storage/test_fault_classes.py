"""Claim: a failed read is classified by its exception type and status code, never by its message text.

Transient faults (timeouts, resets, truncated bodies, 408, 429, 5xx) are retried; a missing object is a
content fault; permission, missing credentials and any other 4xx are refused at once; obstore's generic
error says neither, so it is tried once more through the client that reports a status; programming
errors propagate untouched, after one try.
"""

from __future__ import annotations

import errno

import aiohttp
import obstore.exceptions
import pytest
from botocore.exceptions import ClientError, NoCredentialsError, ReadTimeoutError

from image_edit_data import CacheReadError, RemoteError
from image_edit_data._retry import Fault, fault_of, http_status
from image_edit_data.storage.remote import RemoteStore, RequestPolicy
from image_edit_data.storage.remote_faults import remote_fault


def answer(status: int, code: str = "Whatever") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Get")


def translated(status: int, number: int = errno.EBUSY) -> OSError:
    """An error as s3fs raises it: an `OSError` whose cause is botocore's answer."""
    error = OSError(number, "Service Unavailable")
    error.__cause__ = answer(status)
    return error


@pytest.mark.parametrize(
    ("error", "fault"),
    [
        (answer(503), Fault.TRANSIENT),
        (answer(500), Fault.TRANSIENT),
        (answer(429, "SlowDown"), Fault.TRANSIENT),
        (answer(408), Fault.TRANSIENT),
        (answer(404, "NoSuchKey"), Fault.MISSING),
        (answer(403, "AccessDenied"), Fault.REFUSED),
        (answer(400, "RequestTimeout"), Fault.REFUSED),  # the status decides, not what the code or text says
        (answer(416, "InvalidRange"), Fault.REFUSED),
        (translated(400, errno.EIO), Fault.REFUSED),  # s3fs's EIO over a 400: the status wins
        (translated(503), Fault.TRANSIENT),
        (ReadTimeoutError(endpoint_url="http://e"), Fault.TRANSIENT),
        (aiohttp.ClientPayloadError("Response payload is not completed"), Fault.TRANSIENT),
        (NoCredentialsError(), Fault.REFUSED),
        (TimeoutError(), Fault.TRANSIENT),
        (ConnectionResetError(errno.ECONNRESET, "reset"), Fault.TRANSIENT),
        (FileNotFoundError(errno.ENOENT, "does not exist", "s3://b/k"), Fault.MISSING),
        (PermissionError(errno.EACCES, "denied"), Fault.REFUSED),
        (OSError(errno.EIO, "I/O error"), Fault.TRANSIENT),
        (OSError(errno.ESTALE, "stale"), Fault.TRANSIENT),
        (obstore.exceptions.GenericError("Received non-partial response when range requested"), Fault.UNCLASSIFIED),
        (obstore.exceptions.GenericError("Server returned non-2xx status code: 404 Not Found"), Fault.UNCLASSIFIED),
        (obstore.exceptions.PermissionDeniedError("forbidden"), Fault.REFUSED),
        (TypeError("a timeout of the wrong type"), None),  # a bug: words in the message change nothing
        (ValueError("connection reset"), None),
        (RemoteError("s3://b/k: reading failed after 5 attempts"), None),  # a request that used its tries
        (CacheReadError("f", "cannot be read (tried 3 times)"), None),
    ],
)
def test_a_fault_is_classified_by_type_and_status(error: BaseException, fault: Fault | None) -> None:
    assert remote_fault(error) is fault


def test_local_faults_follow_the_same_rules_without_the_clients() -> None:
    assert fault_of(OSError(errno.EMFILE, "too many open files")) is Fault.TRANSIENT
    assert fault_of(OSError(errno.ENOENT, "gone")) is Fault.MISSING
    assert fault_of(OSError(errno.EACCES, "denied")) is Fault.REFUSED
    assert http_status(translated(429)) == 429 and http_status(OSError(errno.EIO, "x")) is None


def test_a_programming_error_in_a_request_is_raised_after_one_try_naming_the_object() -> None:
    store = RemoteStore("s3://bucket/c", {"endpoint_url": "http://127.0.0.1:9"}, RequestPolicy(base_delay=0.01))

    def broken(timeout: float, classifying: bool) -> bytes:
        raise TypeError("unsupported operand")

    with pytest.raises(TypeError, match="unsupported operand") as raised:
        store.call("reading", "s3://bucket/c/x", broken)
    assert store.stats.requests == 1
    assert "while reading s3://bucket/c/x" in " ".join(raised.value.__notes__)


def test_an_error_no_type_explains_is_tried_next_through_the_classifying_client() -> None:
    store = RemoteStore("s3://bucket/c", {"endpoint_url": "http://127.0.0.1:9"}, RequestPolicy(base_delay=0.01))
    routes: list[bool] = []

    def request(timeout: float, classifying: bool) -> bytes:
        routes.append(classifying)
        if not classifying:
            raise obstore.exceptions.GenericError("something")
        raise translated(400)

    with pytest.raises(RemoteError, match="refused .* not tried again"):
        store.call("reading", "s3://bucket/c/x", request)
    assert routes == [False, True]  # once through obstore, then once through s3fs, whose 400 ends it
