"""Claim: credentials in storage options and URLs are redacted wherever a config, a repr or a message shows them,
and a redacted value read back counts as not given."""

from __future__ import annotations

import logging

import pytest

from image_edit_data import ImageEditDataloaderConfig
from image_edit_data.lightning import ImageEditDataModule
from image_edit_data.storage.location import CacheLocation
from image_edit_data.storage.remote import RemoteStore
from image_edit_data.storage.secrets import REDACTED, redacted, redacted_options, redacted_url

OPTIONS = {
    "key": "AKIA-KEY",
    "secret": "s3cr3t",
    "token": "session-tok",
    "anon": False,
    "endpoint_url": "https://minio.local:9000",
    "client_kwargs": {"region_name": "eu-west-1", "aws_session_token": "tok2", "proxies": {"https": "http://u:pw@p:1"}},
    "config_kwargs": {"read_timeout": 30},
    "account_key": "azure-key",
    "sas_token": "sv=x&sig=y",
    "password": "hunter2",
}


def test_every_credential_in_storage_options_is_redacted_and_nothing_else() -> None:
    shown = redacted_options(OPTIONS)
    assert shown == {
        "key": REDACTED,
        "secret": REDACTED,
        "token": REDACTED,
        "anon": False,
        "endpoint_url": "https://minio.local:9000",
        "client_kwargs": {
            "region_name": "eu-west-1",
            "aws_session_token": REDACTED,
            "proxies": {"https": f"http://{REDACTED}@p:1"},
        },
        "config_kwargs": {"read_timeout": 30},
        "account_key": REDACTED,
        "sas_token": REDACTED,
        "password": REDACTED,
    }
    assert OPTIONS["secret"] == "s3cr3t"  # a copy: the options in use keep their values


def test_credentials_inside_urls_are_redacted_and_other_urls_left_alone() -> None:
    assert (
        redacted_url("https://user:pw@host:8443/bucket/x?versionId=3")
        == f"https://{REDACTED}@host:8443/bucket/x?versionId=3"
    )
    signed = redacted_url("https://h/b/k?X-Amz-Credential=AKIA&X-Amz-Signature=abc&partNumber=2")
    assert "AKIA" not in signed and "abc" not in signed and "partNumber=2" in signed
    assert redacted_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redacted_url("/a/local/path") == "/a/local/path"


def test_a_config_tree_redacts_the_storage_options_of_every_source() -> None:
    tree = {"cache_dir": "s3://b/c", "storage_options": {"secret": "x"}, "sources": [{"storage_options": {"key": "k"}}]}
    assert redacted(tree) == {
        "cache_dir": "s3://b/c",
        "storage_options": {"secret": REDACTED},
        "sources": [{"storage_options": {"key": REDACTED}}],
    }


def test_the_data_module_saves_redacted_hyperparameters_and_keeps_the_real_options_in_use() -> None:
    module = ImageEditDataModule(cache_dir="s3://bucket/c", num_workers=0, storage_options=dict(OPTIONS))
    assert module.hparams["storage_options"]["secret"] == REDACTED
    assert module.hparams["storage_options"]["endpoint_url"] == OPTIONS["endpoint_url"]
    assert module.config.storage_options == OPTIONS  # the loader still reads with them
    assert "s3cr3t" not in repr(module.config) and "s3cr3t" not in repr(module.config.location())


def test_a_redacted_value_read_back_counts_as_not_given(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    location = CacheLocation.of("s3://bucket/c", storage_options=redacted_options(OPTIONS))
    assert "key" not in location.storage_options and "secret" not in location.storage_options
    assert location.storage_options["client_kwargs"]["region_name"] == "eu-west-1"
    assert "aws_session_token" not in location.storage_options["client_kwargs"]
    assert "storage_options.secret is '<redacted>'" in caplog.text
    config = ImageEditDataloaderConfig("s3://bucket/c", storage_options={"key": REDACTED, "secret": REDACTED})
    assert config.location().storage_options == {}  # the S3 client then takes credentials from its environment


def test_a_remote_store_shows_neither_its_options_nor_an_endpoints_password() -> None:
    store = RemoteStore("s3://bucket/c", {**OPTIONS, "endpoint_url": "http://me:pw@127.0.0.1:9"})
    assert "pw" not in repr(store) and "s3cr3t" not in repr(store) and "127.0.0.1:9" in repr(store)
    assert store.endpoint == f"http://{REDACTED}@127.0.0.1:9"
