"""Credentials in storage options and URLs, kept out of everything that leaves the process.

Hyperparameters (hence checkpoints and the loggers' `hparams.yaml`), the configs LightningCLI prints
and saves, reprs, logs and error messages show `<redacted>` where a credential was: the value of
any storage option named like one (`key`, `secret`, `token`, `password`, `session_token`,
`account_key`, ...), at any depth, and the user and password inside a URL, or a signature in its
query. A redacted value read back (a DataModule loaded from its checkpoint, a saved config passed
again) counts as not given: the client then finds credentials where it always looks (for S3:
`AWS_ACCESS_KEY_ID` and the rest of botocore's chain), or the user passes them again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

log = logging.getLogger(__name__)
REDACTED = "<redacted>"
OPTIONS = "storage_options"  # the config key whose values are fsspec options, at any depth of a config
SECRET_NAMES = frozenset({"key", "sig", "signature", "sas", "apikey", "passphrase"})
SECRET_PARTS = ("secret", "token", "password", "passwd", "credential", "private_key", "account_key", "api_key")
SECRET_SUFFIXES = ("_key", "_key_id", "_sas", "_signature")


def is_secret(name: str) -> bool:
    """Whether an option or query parameter named `name` holds a credential."""
    lowered = name.lower().replace("-", "_")
    return lowered in SECRET_NAMES or lowered.endswith(SECRET_SUFFIXES) or any(p in lowered for p in SECRET_PARTS)


def redacted_url(text: str) -> str:
    """`text` with the user and password of a URL, and secret query parameters, replaced by `<redacted>`."""
    if "://" not in text or ("@" not in text and "?" not in text):
        return text
    try:
        parts = urlsplit(text)
    except ValueError:
        return text
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_secret(name) for name, _ in pairs):
            query = urlencode([(n, REDACTED if is_secret(n) else v) for n, v in pairs], safe="<>")
    if netloc == parts.netloc and query == parts.query:
        return text
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redacted_options(options: Any) -> Any:
    """Storage options (a mapping, maybe nested) with every credential in them replaced by `<redacted>`."""
    if isinstance(options, Mapping):
        return {
            name: REDACTED if is_secret(str(name)) and value not in (None, "") else redacted_options(value)
            for name, value in options.items()
        }
    if isinstance(options, list | tuple):
        return type(options)(redacted_options(item) for item in options)
    if isinstance(options, str):
        return redacted_url(options)
    return options


def redacted(value: Any) -> Any:
    """A config tree (dicts, lists, strings) with the credentials of every `storage_options` in it, and of
    every URL, replaced by `<redacted>`."""
    if isinstance(value, Mapping):
        return {name: redacted_options(item) if name == OPTIONS else redacted(item) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redacted(item) for item in value)
    if isinstance(value, str):
        return redacted_url(value)
    return value


def without_redacted(options: Mapping[str, Any], where: str = OPTIONS) -> dict[str, Any]:
    """`options` without the entries a redaction left (`<redacted>`): they were not given, so the client looks
    for credentials where it always does. Each entry left out is logged."""
    kept: dict[str, Any] = {}
    for name, value in options.items():
        if value == REDACTED:
            log.warning(
                "%s.%s is %r (a value redacted from a checkpoint or a saved config): left out, so the client takes "
                "credentials from its environment; pass it again to use it",
                where,
                name,
                REDACTED,
            )
            continue
        kept[name] = without_redacted(value, f"{where}.{name}") if isinstance(value, Mapping) else value
    return kept
