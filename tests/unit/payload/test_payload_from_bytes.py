"""`payload_from_bytes`: fetched safetensors bytes parse in memory, their tensors views of those bytes."""

from __future__ import annotations

import re

import pytest
import torch
import xxhash
from support.caches import make_payload

from image_edit_data.contract.file_tensor import FileTensor
from image_edit_data.errors import CacheFormatError
from image_edit_data.payload import materialized, payload_from_bytes, to_safetensors

MASK = {"edit_mask": torch.zeros(8, 8)}


def test_fetched_bytes_parse_into_tensors_that_view_them_and_equal_the_payload() -> None:
    payload = make_payload(3, conditioning=MASK)
    data = to_safetensors(payload)
    opened = payload_from_bytes(data, "s3://bucket/cache/x.safetensors")
    target = opened.fields["target_latent"]
    assert isinstance(target, FileTensor) and target.memory is not None and target.memory.obj is data
    assert opened.descriptor is None and opened.check is None
    for name in ("target_latent", "prompt_embeddings", "prompt_attention_mask"):
        assert torch.equal(materialized(opened.fields[name]), payload[name])
    assert torch.equal(materialized(opened.fields["context_latents"][0]), payload["context_latents"][0])
    assert opened.fields["metadata"] == payload["metadata"]


def test_a_checksum_travels_with_the_payload_and_hashes_the_bytes_in_file_order() -> None:
    data = to_safetensors(make_payload(1))
    opened = payload_from_bytes(data, "shard.tar[x.safetensors]", xxhash.xxh3_64_intdigest(data))
    assert opened.check is not None
    target = opened.fields["target_latent"]
    copied = bytearray(data[target.offset : target.offset + target.nbytes])  # as the batch holds it
    assert opened.check.digest([(target.offset, memoryview(copied))]) == opened.check.expected
    assert opened.check.digest([]) == opened.check.expected


def test_bytes_that_do_not_match_are_fetched_again_once_and_the_confirmed_mismatch_names_both_checksums() -> None:
    data = to_safetensors(make_payload(2))
    damaged = bytearray(data)
    damaged[-3] ^= 0x10
    fetches: list[int] = []

    def refetch() -> bytes:
        fetches.append(1)
        return bytes(damaged)

    expected = xxhash.xxh3_64_hexdigest(data)
    opened = payload_from_bytes(
        bytes(damaged), "shard.tar[x]", int(expected, 16), source="ranged read", refetch=refetch
    )
    assert opened.check is not None
    found = xxhash.xxh3_64_hexdigest(bytes(damaged))
    message = f"shard.tar[x]: xxh3_64: member bytes hash to {found}, the index says {expected} (ranged read"
    with pytest.raises(CacheFormatError, match=re.escape(message)):
        opened.check.verified_bytes()
    assert fetches == [1]  # the bytes as fetched, then fetched once more before they count as damaged

    good = payload_from_bytes(bytes(damaged), "shard.tar[x]", int(expected, 16), refetch=lambda: data)
    assert good.check is not None and bytes(good.check.verified_bytes()) == data


def test_a_damaged_header_with_a_checksum_is_confirmed_as_damage_and_without_one_is_unreadable() -> None:
    data = to_safetensors(make_payload(4))
    damaged = bytearray(data)
    damaged[8] = ord("[")  # the JSON header is an array, not an object
    with pytest.raises(CacheFormatError, match=r"x: payload: not a readable safetensors file \(header is not"):
        payload_from_bytes(bytes(damaged), "x")
    with pytest.raises(CacheFormatError, match=r"x: xxh3_64: member bytes hash to [0-9a-f]{16}, the index says"):
        payload_from_bytes(bytes(damaged), "x", xxhash.xxh3_64_intdigest(data))
    # The first bytes were damaged in flight; the ones fetched again are intact: the payload parses from them.
    opened = payload_from_bytes(bytes(damaged), "x", xxhash.xxh3_64_intdigest(data), refetch=lambda: data)
    assert opened.fields["metadata"]["original_ids"] == {"id": "s4"}
