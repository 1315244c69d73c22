"""Claim: the deadlines and retry budget are set per cache, reach the S3 client, and bad values are refused."""

from __future__ import annotations

import pytest

from image_edit_data import ImageEditDataloaderConfig, RequestPolicy
from image_edit_data.storage.remote import client_options


def test_a_mixture_source_sets_its_own_policy_and_the_others_take_the_configs() -> None:
    sources = [
        {"cache_dir": "s3://bucket/a", "remote_requests": {"deadline": 7.0}},
        {"cache_dir": "s3://bucket/b"},
    ]
    config = ImageEditDataloaderConfig(sources=sources, remote_requests=RequestPolicy(deadline=9.0, attempts=2))
    assert config.sources is not None
    first, second = (config.location(source=source).requests for source in config.sources)
    assert (first.deadline, first.attempts) == (7.0, 5)
    assert (second.deadline, second.attempts) == (9.0, 2)
    assert ImageEditDataloaderConfig("s3://bucket/a").location().requests == RequestPolicy()


def test_the_s3_client_gets_the_deadlines_and_no_retries_or_crc_of_its_own_unless_the_user_set_them() -> None:
    policy = RequestPolicy(connect_timeout=2.0, read_timeout=3.0)
    ours = client_options("s3", {"endpoint_url": "http://127.0.0.1:9"}, policy)["config_kwargs"]
    assert ours == {
        "connect_timeout": 2.0,
        "read_timeout": 3.0,
        "retries": {"total_max_attempts": 1},
        "response_checksum_validation": "when_required",  # our hashes check every byte; the CRC would again
    }
    user = {"read_timeout": 60, "response_checksum_validation": "when_supported"}
    theirs = client_options("s3", {"config_kwargs": user}, policy)["config_kwargs"]
    assert theirs["read_timeout"] == 60 and theirs["connect_timeout"] == 2.0
    assert theirs["response_checksum_validation"] == "when_supported"
    assert "config_kwargs" not in client_options("gs", {}, policy)


def test_a_policy_with_an_unknown_or_bad_field_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="remote_requests: unknown option 'timeout'"):
        RequestPolicy.of({"timeout": 3})
    with pytest.raises(ValueError, match=r"remote_requests.deadline must be a positive number of seconds, got 0"):
        RequestPolicy(deadline=0)
    with pytest.raises(ValueError, match=r"remote_requests.attempts must be a positive integer"):
        RequestPolicy.of({"attempts": 0})
