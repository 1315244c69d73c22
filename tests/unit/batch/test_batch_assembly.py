"""Batches are read straight from the payload files into one buffer, and cross from workers as that buffer."""

from __future__ import annotations

import io
import os
import pickle
import threading
import zipfile
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
import torch.multiprocessing
from support.caches import make_payload, write_cache
from torch.utils.data import DataLoader

import image_edit_data.batch.collate as collate_module
import image_edit_data.batch.fill as fill_module
import image_edit_data.batch.shared_batch as shared_batch_module
from image_edit_data import CacheFormatError, ImageEditDataloaderConfig, ImageEditDataset, collate_image_edit
from image_edit_data.batch.buffer import BatchBuffer, BufferPool
from image_edit_data.batch.fill import halves_by_bytes
from image_edit_data.batch.shared_batch import SharedBatch
from image_edit_data.batch.shared_ring import CAPACITY, RECEIVED
from image_edit_data.payload.torch_save.torch_zip import zip_entries

CONDITIONING = {"image_grid_thw": torch.tensor([[1, 4, 4]])}


def payloads(count: int = 6) -> list[dict]:
    items = [make_payload(i, sequence=2 + i % 4, conditioning=CONDITIONING) for i in range(count)]
    for i, payload in enumerate(items):
        payload["prompt_embeddings"] = payload["prompt_embeddings"].to(torch.bfloat16)
        payload["prompt_attention_mask"] = torch.arange(len(payload["prompt_attention_mask"])) % 2 == i % 2
    return items


def batches(root: Path, num_workers: int) -> list[dict]:
    build = ImageEditDataloaderConfig(cache_dir=str(root), num_workers=num_workers, shuffle=False).build(
        dp_rank=0, dp_world_size=1, batch_size=3
    )
    return list(build.dataloader)


def assert_same_batch(a: dict, b: dict) -> None:
    for key in ("image_latents", "text_embeddings", "text_attention_mask"):
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert all(torch.equal(x, y) for x, y in zip(a["context_latents"], b["context_latents"], strict=True))
    assert torch.equal(a["conditioning_tensors"]["image_grid_thw"], b["conditioning_tensors"]["image_grid_thw"])
    assert a["metadata"] == b["metadata"]


class DirtyBuffer(BatchBuffer):
    """A batch buffer holding garbage where nothing is written."""

    def __init__(self, nbytes: int, shared: bool) -> None:
        super().__init__(nbytes, shared)
        self.tensor.fill_(0xFF)


@pytest.mark.parametrize("num_workers", [0, 2])  # workers fill shared memory through its file
def test_safetensors_and_pt_caches_give_the_same_batches_with_padding_zeroed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    items = payloads()
    pt = write_cache(tmp_path / "pt", items)
    st = write_cache(tmp_path / "st", items, suffix=".safetensors")
    monkeypatch.setattr(collate_module, "BatchBuffer", DirtyBuffer)
    from_pt, from_st = batches(pt, num_workers), batches(st, num_workers)  # workers fork: the patch holds
    assert len(from_pt) == len(from_st) == 2
    for a, b in zip(from_pt, from_st):
        assert_same_batch(a, b)
        for row, index in enumerate(a["metadata"]["sample_indices"]):
            length = items[index]["prompt_embeddings"].shape[0]
            assert torch.equal(a["text_embeddings"][row, :length], items[index]["prompt_embeddings"])
            assert not a["text_embeddings"][row, length:].any()
            assert not a["text_attention_mask"][row, length:].any()
            assert torch.equal(a["image_latents"][row], items[index]["target_latent"])


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_worker_batches_arrive_as_plain_dicts_over_one_shared_buffer(tmp_path: Path, suffix: str) -> None:
    root = write_cache(tmp_path, payloads(), suffix=suffix)
    in_process, from_workers = batches(root, 0), batches(root, 2)
    assert len(in_process) == len(from_workers) == 2
    for a, b in zip(in_process, from_workers):
        assert type(b) is dict
        assert_same_batch(a, b)
        tensors = [b["image_latents"], *b["context_latents"], b["text_embeddings"], b["text_attention_mask"]]
        tensors.append(b["conditioning_tensors"]["image_grid_thw"])
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def test_worker_blocks_are_reused_once_freed_and_batches_still_held_are_never_overwritten(tmp_path: Path) -> None:
    items = [make_payload(i, sequence=3) for i in range(40)]
    root = write_cache(tmp_path, items, suffix=".safetensors")
    build = ImageEditDataloaderConfig(cache_dir=str(root), num_workers=1, shuffle=False).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    rings_before = set(RECEIVED)
    held = list(build.dataloader)  # more batches than a worker's ring has blocks, all kept
    assert len(held) == 20 > CAPACITY
    for batch in held:
        for row, index in enumerate(batch["metadata"]["sample_indices"]):
            assert torch.equal(batch["image_latents"][row], items[index]["target_latent"])
            assert torch.equal(batch["text_embeddings"][row], items[index]["prompt_embeddings"])
    del held, batch
    (token,) = set(RECEIVED) - rings_before  # the loader's one worker
    ring = RECEIVED[token]
    assert len(ring.blocks) <= CAPACITY  # batches beyond the ring's blocks came in one-off blocks
    blocks_after_first_epoch = {slot: generation for slot, (generation, _) in ring.blocks.items()}
    for batch in build.dataloader:  # each batch freed before the next: the worker's blocks come back
        assert torch.equal(batch["image_latents"][0], items[batch["metadata"]["sample_indices"][0]]["target_latent"])
    assert set(RECEIVED) - rings_before == {token}  # the same worker served the next epoch
    assert {slot: generation for slot, (generation, _) in ring.blocks.items()} == blocks_after_first_epoch


def test_pooled_batch_memory_is_reused_only_once_every_tensor_of_its_batch_is_freed() -> None:
    pool = BufferPool(capacity=2)
    first = pool.take(1000)
    first.fill_(1)
    view = first[10:20].view(torch.int16)  # a view alone keeps the block lent
    address = first.data_ptr()
    del first
    second = pool.take(1000)
    assert second.data_ptr() != address
    second.fill_(2)
    assert torch.all(view == 0x0101)
    del view
    assert pool.take(900).data_ptr() == address  # free again, and big enough
    assert pool.take(100).data_ptr() not in (address, second.data_ptr())  # reusing 1000 bytes for 100 wastes too much


def test_shared_batch_pickles_tensors_added_by_other_code_as_usual() -> None:
    buffer = torch.arange(64, dtype=torch.uint8)
    inside = buffer[16:32].view(torch.float32).view(2, 2)
    outside = torch.tensor([7.0, 8.0])
    batch = SharedBatch({"a": inside, "b": [inside[1], outside], "c": {"d": outside}, "e": "text"}, buffer)
    received = pickle.loads(ForkingPickler.dumps(batch))
    assert type(received) is dict
    assert torch.equal(received["a"], inside) and torch.equal(received["b"][0], inside[1])
    assert torch.equal(received["b"][1], outside) and torch.equal(received["c"]["d"], outside)
    assert received["e"] == "text"
    assert received["a"].untyped_storage().data_ptr() == received["b"][0].untyped_storage().data_ptr()


def test_shared_batch_searches_only_its_placed_keys_for_views_of_the_buffer() -> None:
    buffer = torch.arange(64, dtype=torch.uint8)
    inside = buffer[16:32].view(torch.float32).view(2, 2)
    batch = SharedBatch({"a": inside, "meta": {"rows": [1, 2], "view": inside}}, buffer, placed_keys={"a"})
    skeleton = batch.__reduce__()[1][1]
    assert isinstance(skeleton["a"], shared_batch_module.Placed)
    assert skeleton["meta"]["view"] is inside  # left for pickle's own tensor sharing
    received = pickle.loads(ForkingPickler.dumps(batch))
    assert torch.equal(received["a"], inside) and torch.equal(received["meta"]["view"], inside)
    assert received["meta"]["rows"] == [1, 2]


def test_other_collate_functions_see_sample_dicts_that_view_the_batch(tmp_path: Path) -> None:
    items = payloads()
    dataset = ImageEditDataset(write_cache(tmp_path, items, suffix=".safetensors"))
    loader = DataLoader(dataset, batch_sampler=[[4, 1, 5]], collate_fn=list)
    (samples,) = list(loader)
    assert [s["sample_index"] for s in samples] == [4, 1, 5]
    for sample in samples:
        expected = items[sample["sample_index"]]
        assert torch.equal(sample["target_latent"], expected["target_latent"])
        assert torch.equal(sample["prompt_embeddings"], expected["prompt_embeddings"])
        assert torch.equal(sample["prompt_attention_mask"], expected["prompt_attention_mask"])
        assert torch.equal(sample["conditioning_tensors"]["image_grid_thw"], CONDITIONING["image_grid_thw"])
    assert_same_batch(collate_image_edit(samples), collate_image_edit(dataset.__getitems__([4, 1, 5])))


def test_a_payload_that_shrinks_after_its_header_was_checked_is_a_clear_error(tmp_path: Path) -> None:
    root = write_cache(tmp_path, payloads(2), suffix=".safetensors")
    dataset = ImageEditDataset(root)
    sample, payload = dataset.open_sample(0)
    try:
        path = root / "samples" / "sample_00000000.safetensors"
        os.truncate(path, path.stat().st_size - 10)
        with pytest.raises(CacheFormatError, match=r"^samples/sample_00000000.safetensors: payload: file ended"):
            collate_image_edit([sample])
    finally:
        payload.close()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_batches_read_by_two_threads_equal_batches_read_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    root = write_cache(tmp_path, payloads(), suffix=suffix)
    serial = batches(root, num_workers=0)
    helper_rows: list[int] = []
    fill_each = fill_module._fill_each

    def noting_fill_each(buffer: BatchBuffer, order: list[int], *rest: object) -> list:
        if threading.current_thread().name.startswith("image-edit-data-read"):
            helper_rows.append(len(order))
        return fill_each(buffer, order, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(fill_module, "PARALLEL_READ_MIN_BYTES", 1)
    monkeypatch.setattr(fill_module, "usable_cores", lambda: 2)  # as on any machine with two cores
    monkeypatch.setattr(fill_module, "_fill_each", noting_fill_each)
    monkeypatch.setattr(collate_module, "BatchBuffer", DirtyBuffer)
    parallel = batches(root, num_workers=0)
    assert len(helper_rows) == 2 and all(1 <= n <= 2 for n in helper_rows)  # of each batch's 3 samples
    for a, b in zip(serial, parallel, strict=True):
        assert_same_batch(a, b)


@pytest.mark.parametrize("broken", [0, 1])  # one of the two files is read by the helper thread
def test_a_file_that_fails_in_either_reader_thread_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: int
) -> None:
    root = write_cache(tmp_path, payloads(2), suffix=".safetensors")
    monkeypatch.setattr(fill_module, "PARALLEL_READ_MIN_BYTES", 1)
    monkeypatch.setattr(fill_module, "usable_cores", lambda: 2)
    dataset = ImageEditDataset(root)
    opened = [dataset.open_sample(0), dataset.open_sample(1)]
    try:
        path = root / "samples" / f"sample_0000000{broken}.safetensors"
        os.truncate(path, path.stat().st_size - 10)
        with pytest.raises(
            CacheFormatError, match=rf"^samples/sample_0000000{broken}.safetensors: payload: file ended"
        ):
            collate_image_edit([sample for sample, _ in opened])
    finally:
        for _, payload in opened:
            payload.close()


def test_legacy_pt_payloads_are_read_too(tmp_path: Path) -> None:
    items = payloads(3)
    root = write_cache(tmp_path, items)
    for i, payload in enumerate(items):
        buffer = io.BytesIO()
        torch.save(payload, buffer, _use_new_zipfile_serialization=False)
        (root / "samples" / f"sample_{i:08d}.pt").write_bytes(buffer.getvalue())
    dataset = ImageEditDataset(root)
    assert torch.equal(dataset[2]["target_latent"], items[2]["target_latent"])
    assert torch.equal(dataset[-1]["prompt_embeddings"], items[2]["prompt_embeddings"])


def zip_bytes(entries: dict[str, bytes], comment: bytes = b"", compression: int = zipfile.ZIP_STORED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=compression) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
        archive.comment = comment
    return out.getvalue()


def central_total(data: bytes, tmp_path: Path) -> int | None:
    path = tmp_path / "payload.zip"
    path.write_bytes(data)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        entries = zip_entries(descriptor, len(data))
        return None if entries is None else sum(entry.unpacked_size for entry in entries)
    finally:
        os.close(descriptor)


def test_zip_sizes_read_from_the_central_directory_match_zipfile(tmp_path: Path) -> None:
    saved = io.BytesIO()
    torch.save(make_payload(3, sequence=40), saved)
    deflated = zip_bytes({"a": bytes(10_000), "b/c": b"x" * 300}, compression=zipfile.ZIP_DEFLATED)
    for data in (saved.getvalue(), deflated, zip_bytes({})):
        expected = sum(entry.file_size for entry in zipfile.ZipFile(io.BytesIO(data)).infolist())
        assert central_total(data, tmp_path) == expected
    # Layouts torch.save does not write are left to zipfile.
    assert central_total(zip_bytes({"a": b"1"}, comment=b"note"), tmp_path) is None
    assert central_total(saved.getvalue()[:-5], tmp_path) is None


def test_rows_are_split_between_the_two_readers_by_bytes() -> None:
    sizes = [10, 70, 20, 30, 40]
    mine, theirs = halves_by_bytes(range(len(sizes)), sizes)
    assert sorted(sum(sizes[row] for row in group) for group in (mine, theirs)) == [80, 90]
    assert sorted(mine + theirs) == list(range(len(sizes)))
