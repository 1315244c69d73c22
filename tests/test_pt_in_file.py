"""`.pt` tensors are read straight from the file when they are plain byte ranges, and loaded by torch otherwise."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from cachefactory import make_payload, write_cache

import image_edit_data.payload.payload as payload_module
import image_edit_data.payload.torch_save._private_torch as private_module
from image_edit_data import ImageEditDataset, collate_image_edit
from image_edit_data.contract.file_tensor import FileTensor
from image_edit_data.payload.payload import open_payload
from image_edit_data.payload.torch_save._private_torch import (
    NotAByteRange,
    direct_unpickling_works,
    file_tensor,
    same_structure,
    structure_on_meta,
)
from image_edit_data.payload.torch_save.torch_zip import data_range, stored_data_ranges, zip_entries

CONDITIONING = {"image_grid_thw": torch.tensor([[1, 4, 4]])}


def varied_payloads(count: int = 4) -> list[dict[str, Any]]:
    """Payloads of mixed dtypes whose tensors are views into shared storages at offsets."""
    items = []
    for i in range(count):
        payload = make_payload(i, contexts=((4, 8, 8), (4, 8, 8)), sequence=3 + i, conditioning=CONDITIONING)
        latents = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(i))
        payload["target_latent"] = latents[2]  # views at offsets into one storage
        payload["context_latents"] = [latents[0], latents[1]]
        prompt = torch.randn(10 + i, 6, generator=torch.Generator().manual_seed(100 + i)).to(torch.bfloat16)
        payload["prompt_embeddings"] = prompt[2 : 2 + 3 + i]
        payload["prompt_attention_mask"] = torch.arange(3 + i) % 2 == 0
        items.append(payload)
    return items


def cache_tensors(fields: dict[str, Any]) -> list[Any]:
    return [
        fields["target_latent"],
        *fields["context_latents"],
        fields["prompt_embeddings"],
        fields["prompt_attention_mask"],
        *fields["conditioning_tensors"].values(),
    ]


def assert_batch_holds(batch: dict[str, Any], items: list[dict[str, Any]]) -> None:
    for row, index in enumerate(batch["metadata"]["sample_indices"]):
        expected = items[index]
        length = expected["prompt_embeddings"].shape[0]
        assert torch.equal(batch["image_latents"][row], expected["target_latent"])
        for got, want in zip(batch["context_latents"], expected["context_latents"], strict=True):
            assert torch.equal(got[row], want)
        assert torch.equal(batch["text_embeddings"][row, :length], expected["prompt_embeddings"])
        assert torch.equal(batch["text_attention_mask"][row, :length], expected["prompt_attention_mask"])
        assert torch.equal(batch["conditioning_tensors"]["image_grid_thw"][row], CONDITIONING["image_grid_thw"])


def batch_of_all(root: Path) -> dict[str, Any]:
    dataset = ImageEditDataset(root)
    return collate_image_edit(dataset.__getitems__(list(range(len(dataset)))))


def rewrite_zip(path: Path, compression: int = zipfile.ZIP_STORED, edit: Any = None, rename: Any = None) -> None:
    """Rewrite a torch.save zip entry by entry, optionally compressed or with entries edited or renamed."""
    with zipfile.ZipFile(path) as source:
        entries = [(info.filename, source.read(info.filename)) for info in source.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=compression) as target:
        for name, data in entries:
            target.writestr(rename(name) if rename else name, edit(name, data) if edit else data)
    path.write_bytes(out.getvalue())


def test_pt_tensors_are_read_from_the_file_at_their_storage_offsets(tmp_path: Path) -> None:
    items = varied_payloads()
    root = write_cache(tmp_path, items)
    with open_payload(root / "samples" / "sample_00000001.pt", "sample 1") as payload:
        tensors = cache_tensors(payload.fields)
        assert all(type(t) is FileTensor for t in tensors)
        # The target is the third latent of a storage shared with the contexts: it starts 2 latents in.
        assert tensors[0].offset - tensors[1].offset == 2 * 4 * 8 * 8 * 4
        assert torch.equal(tensors[0].materialize(), items[1]["target_latent"])
    assert_batch_holds(batch_of_all(root), items)


@pytest.mark.parametrize("case", ["non-contiguous", "deflated", "big-endian", "old torch"])
def test_payloads_that_are_not_plain_byte_ranges_are_loaded_by_torch_with_the_same_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    items = varied_payloads()
    if case == "non-contiguous":
        for payload in items:
            payload["target_latent"] = payload["target_latent"].transpose(1, 2)
    root = write_cache(tmp_path, items)
    paths = sorted((root / "samples").iterdir())
    if case == "deflated":
        for path in paths:
            rewrite_zip(path, zipfile.ZIP_DEFLATED)
    if case == "big-endian":
        for path in paths:
            to_big_endian(path)
    if case == "old torch":  # a torch whose private unpickler fails the self-check
        monkeypatch.setattr(payload_module, "direct_reads", lambda: False)
    with open_payload(paths[0], "sample 0") as payload:
        assert not any(type(t) is FileTensor for t in cache_tensors(payload.fields))
    assert_batch_holds(batch_of_all(root), items)


@pytest.mark.parametrize("direct", [True, False], ids=["private path", "public path"])
def test_the_private_and_the_public_path_give_the_same_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    items = varied_payloads()
    root = write_cache(tmp_path, items)
    real_load = torch.load
    loads: list[Any] = []

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        loads.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counted_load)
    if not direct:
        monkeypatch.setattr(payload_module, "direct_reads", lambda: False)
    with open_payload(root / "samples" / "sample_00000002.pt", "sample 2") as payload:
        assert all((type(t) is FileTensor) is direct for t in cache_tensors(payload.fields))
        assert payload.fields["metadata"] == items[2]["metadata"]
    assert_batch_holds(batch_of_all(root), items)
    if direct:
        assert loads == []  # the private path never goes through torch.load
    else:
        assert loads and all(k["weights_only"] and k["mmap"] for k in loads)


@pytest.mark.parametrize("case", ["works", "self-check fails", "public forced"])
def test_which_pt_path_runs_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    monkeypatch.setattr(private_module, "_DIRECT", None)
    monkeypatch.delenv(private_module.PUBLIC_ENV, raising=False)
    if case == "self-check fails":
        monkeypatch.setattr(private_module, "direct_unpickling_works", lambda: False)
    if case == "public forced":
        monkeypatch.setenv(private_module.PUBLIC_ENV, "1")
    with caplog.at_level("INFO", logger=private_module.__name__):
        results = {private_module.direct_reads() for _ in range(3)}
    assert results == {case == "works"}
    (record,) = caplog.records
    assert record.levelname == ("WARNING" if case == "self-check fails" else "INFO")
    assert ("private weights-only Unpickler" in record.message) is (case != "public forced")
    assert ("torch.load" in record.message) is (case != "works")


def direct_structure(path: Path) -> dict[str, Any] | None:
    """`structure_on_meta` of a saved file, whose zip layout must be the plain one."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(descriptor).st_size
        entries = zip_entries(descriptor, size)
        assert entries is not None
        ranges = stored_data_ranges(descriptor, entries, size)
        assert ranges is not None
        return structure_on_meta(descriptor, entries, ranges, size)
    finally:
        os.close(descriptor)


def test_the_direct_unpickler_call_matches_torch_load_onto_meta(tmp_path: Path) -> None:
    path = tmp_path / "payload.pt"
    torch.save(varied_payloads(2)[1], path)
    expected = torch.load(path, map_location="meta", weights_only=True)
    got = direct_structure(path)
    assert got is not None and direct_unpickling_works()
    assert same_structure(got, expected) and got["metadata"] == expected["metadata"]
    # Each noted file offset holds the tensor's bytes (checked on the file: torch 2.6's meta loading notes none).
    data, offsets = path.read_bytes(), []
    for noted, real in zip(cache_tensors(got), cache_tensors(torch.load(path, weights_only=True)), strict=True):
        storage = noted.untyped_storage()
        offsets.append(storage._checkpoint_offset)
        raw = torch.frombuffer(bytearray(data[offsets[-1] : offsets[-1] + storage.nbytes()]), dtype=torch.uint8)
        assert torch.equal(raw.view(noted.dtype).as_strided(noted.shape, noted.stride(), noted.storage_offset()), real)
    assert len(set(offsets)) < len(offsets)  # views of one storage share its offset
    expected["target_latent"] = expected["target_latent"][1:]  # the comparison notices a different view
    assert not same_structure(got, expected)


class Sneaky:
    """Pickles as a call to os.system: the weights-only unpickler must refuse it."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("case", ["forbidden global", "storage key not in the zip", "not a dict"])
def test_unusual_or_hostile_pickles_are_left_to_torch_load_and_reported(tmp_path: Path, case: str) -> None:
    path = tmp_path / "payload.pt"
    payload: Any = varied_payloads(1)[0]
    if case == "forbidden global":
        payload["metadata"]["note"] = Sneaky()
    if case == "not a dict":
        payload = [payload["target_latent"]]
    torch.save(payload, path)
    if case == "storage key not in the zip":
        rewrite_zip(path, edit=None, rename=lambda name: name.replace("/data/0", "/data/77"))
    assert direct_structure(path) is None
    message = {
        "forbidden global": "refused by the weights-only loader",
        "not a dict": "expected a dict of cache fields, got list",
    }.get(case, "not a readable torch.save file")
    with pytest.raises(ValueError, match=f"sample 0.*{message}"):
        open_payload(path, "sample 0")
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


@pytest.mark.parametrize("direct", [True, False], ids=["private path", "public path"])
@pytest.mark.parametrize("view", ["contiguous", "transposed"])
def test_a_storage_longer_than_its_zip_entry_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, view: str
) -> None:
    # torch's mapped loading would read the missing bytes from the next zip entry without a word.
    # data/0 is the storage of the three latents (3 x 4x8x8 float32 = 3072 bytes).
    path = tmp_path / "payload.pt"
    payload = varied_payloads(1)[0]
    if view == "transposed":
        payload["target_latent"] = payload["target_latent"].transpose(1, 2)
    torch.save(payload, path)
    rewrite_zip(path, edit=lambda name, data: data[:-4] if name.endswith("/data/0") else data)
    if not direct:
        monkeypatch.setattr(payload_module, "direct_reads", lambda: False)
    with pytest.raises(
        ValueError, match="sample 0: payload: a tensor storage needs 3072 bytes, its zip entry holds 3068"
    ):
        open_payload(path, "sample 0")


def to_big_endian(path: Path) -> None:
    """Rewrite a torch.save file as a big-endian machine would have written it."""
    itemsize_at = {}  # entry name -> bytes per element of the tensors stored in it
    structure = direct_structure(path)  # storages noting their file offsets
    assert structure is not None
    descriptor = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(descriptor).st_size
        entries = zip_entries(descriptor, size)
        assert entries is not None
        name_at = {data_range(descriptor, entry, size): entry.name.decode() for entry in entries}
    finally:
        os.close(descriptor)
    starts = {found[0]: name for found, name in name_at.items() if found is not None}
    for tensor in cache_tensors(structure):
        itemsize_at[starts[tensor.untyped_storage()._checkpoint_offset]] = tensor.element_size()

    def swapped(name: str, data: bytes) -> bytes:
        if name.endswith("/byteorder"):
            return b"big"
        width = itemsize_at.get(name, 1)
        return b"".join(data[i : i + width][::-1] for i in range(0, len(data), width))

    rewrite_zip(path, edit=swapped)


def test_the_byte_order_entry_decides_whether_tensors_can_be_read_in_place(tmp_path: Path) -> None:
    path = tmp_path / "payload.pt"
    torch.save(varied_payloads(1)[0], path)
    for byteorder, readable in ((None, True), (b"little", True), (b"big", False)):
        if byteorder is not None:
            rewrite_zip(path, edit=lambda name, data, b=byteorder: b if name.endswith("/byteorder") else data)
        descriptor = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(descriptor).st_size
            entries = zip_entries(descriptor, size)
            assert entries is not None
            assert (stored_data_ranges(descriptor, entries, size) is not None) is readable
        finally:
            os.close(descriptor)


def test_a_tensor_outside_every_stored_entry_is_not_read_in_place(tmp_path: Path) -> None:
    torch.save({"t": torch.arange(8.0)}, tmp_path / "t.pt")
    structure = direct_structure(tmp_path / "t.pt")
    assert structure is not None
    meta = structure["t"]
    start = meta.untyped_storage()._checkpoint_offset
    assert file_tensor(meta, 3, {start: start + 32}, "x").offset == start
    assert file_tensor(meta[2:], 3, {start: start + 32}, "x").offset == start + 8
    for entry_ends in ({start + 1: start + 64}, {}):
        with pytest.raises(NotAByteRange):
            file_tensor(meta, 3, entry_ends, "x")
    with pytest.raises(ValueError, match="x: payload: a tensor storage needs 32 bytes, its zip entry holds 31"):
        file_tensor(meta, 3, {start: start + 31}, "x")
