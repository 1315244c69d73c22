"""A corpus of hostile and broken caches: each is refused with an error naming its file and field.

Every case builds its cache in `tmp_path`. Nothing in a cache may run code, open a file outside
the cache directory, hang the reader or make it allocate what the files do not hold.
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import struct
import sys
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.caches import make_payload, write_cache

from image_edit_data import CacheFormatError, ImageEditDataloaderConfig, ImageEditDataset, collate_image_edit
from image_edit_data.index.index import MAX_MANIFEST_BYTES
from image_edit_data.index.store import candidate_paths, serialize, store_key
from image_edit_data.payload.payload import to_safetensors
from image_edit_data.preprocess.cli import cache_main

SIGNATURE = {"target": [4, 8, 8], "contexts": [[4, 8, 8]]}
PT = "samples/sample_00000000.pt"
ST = "samples/sample_00000000.safetensors"
SHARD = "metadata_shard_0000.json"


def one_sample(root: Path, suffix: str = ".pt") -> Path:
    """A valid one-sample cache."""
    return write_cache(root, [make_payload(0)], suffix=suffix)


def write_shard(root: Path, records: Any, name: str = SHARD) -> None:
    (root / name).write_text(json.dumps(records))


def record(cache_file: str, **extra: Any) -> dict[str, Any]:
    return {"cache_file": cache_file, "compound_bucket_signature": SIGNATURE, **extra}


def load_first(root: Path) -> dict[str, Any]:
    return ImageEditDataset(root)[0]


def rezip(data: bytes, edit: Callable[[str, bytes], bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    """Rewrite every entry of a torch zip through `edit(name, content)`."""
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=compression) as target:
        for name in source.namelist():
            target.writestr(name, edit(name, source.read(name)))
    return out.getvalue()


def unicode_op(text: str) -> bytes:
    """The pickle opcode pushing `text` (BINUNICODE)."""
    encoded = text.encode()
    return b"X" + len(encoded).to_bytes(4, "little") + encoded


PLACEHOLDER = "PLACEHOLDER"


def payload_with(opcodes: bytes) -> bytes:
    """A torch.save payload whose `metadata["extra"]` is whatever `opcodes` push (spliced into data.pkl)."""
    payload = make_payload(0)
    payload["metadata"]["extra"] = PLACEHOLDER
    buffer = io.BytesIO()
    torch.save(payload, buffer)

    def splice(name: str, content: bytes) -> bytes:
        if not name.endswith("data.pkl"):
            return content
        assert content.count(unicode_op(PLACEHOLDER)) == 1
        return content.replace(unicode_op(PLACEHOLDER), opcodes)

    return rezip(buffer.getvalue(), splice)


def safetensors_bytes(header: dict[str, Any], body: bytes) -> bytes:
    """A safetensors file from a raw header, with our format marker unless the header sets its own."""
    header = {"__metadata__": {"image_edit_data.format": "1", "image_edit_data.metadata": "{}"}, **header}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + body


def f32(shape: list[int], offsets: tuple[int, int]) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": list(offsets)}


# --- payload bytes ---------------------------------------------------------------------------------


def valid_bytes(suffix: str) -> bytes:
    if suffix == ".safetensors":
        return to_safetensors(make_payload(0))
    buffer = io.BytesIO()
    torch.save(make_payload(0), buffer)
    return buffer.getvalue()


def corrupt_zip_end(data: bytes) -> bytes:
    end = data.rfind(b"PK\x05\x06")
    return data[:end] + b"XX\x05\x06" + data[end + 4 :]


def foreign_zip(_: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("notes/hello.txt", "not a torch archive")
    return buffer.getvalue()


def torch_list(_: bytes) -> bytes:
    buffer = io.BytesIO()
    torch.save([torch.zeros(4, 8, 8)], buffer)
    return buffer.getvalue()


def contexts_named(*names: str) -> Callable[[bytes], bytes]:
    def build(_: bytes) -> bytes:
        header = {name: f32([4, 8, 8], (1024 * i, 1024 * (i + 1))) for i, name in enumerate(names)}
        return safetensors_bytes(header, bytes(1024 * len(names)))

    return build


def metadata_json(text: str) -> Callable[[bytes], bytes]:
    def build(_: bytes) -> bytes:
        marker = {"image_edit_data.format": "1", "image_edit_data.metadata": text}
        return safetensors_bytes({"__metadata__": marker, "target_latent": f32([2], (0, 8))}, bytes(8))

    return build


NOT_TORCH = "payload: not a readable torch.save file"
NOT_SAFETENSORS = "payload: not a readable safetensors file"
BROKEN_BYTES = [
    ("pt-zero-bytes", ".pt", lambda d: b"", "file: is empty"),
    ("pt-truncated-half", ".pt", lambda d: d[: len(d) // 2], f"{NOT_TORCH} \\(damaged zip"),
    ("pt-four-bytes-of-junk", ".pt", lambda d: b"junk", f"{NOT_TORCH} \\(error: unpack requires"),
    ("pt-truncated-to-100-bytes", ".pt", lambda d: d[:100], NOT_TORCH),
    ("pt-wrong-local-zip-header", ".pt", lambda d: b"XX" + d[2:], NOT_TORCH),
    ("pt-wrong-end-of-zip-header", ".pt", corrupt_zip_end, NOT_TORCH),
    ("pt-zip-that-is-not-torch", ".pt", foreign_zip, rf"{NOT_TORCH} \(RuntimeError: Expected hasRecord\(\"version\"\)"),
    ("pt-list-not-dict", ".pt", torch_list, "payload: expected a dict of cache fields, got list"),
    ("st-zero-bytes", ".safetensors", lambda d: b"", "file: is empty"),
    ("st-truncated-half", ".safetensors", lambda d: d[: len(d) // 2], f"{NOT_SAFETENSORS}.*lies outside the"),
    (
        "st-shorter-than-header-length",
        ".safetensors",
        lambda d: d[:5],
        f"{NOT_SAFETENSORS}.*shorter than the 8-byte header length",
    ),
    (
        "st-header-length-2**63",
        ".safetensors",
        lambda d: struct.pack("<Q", 2**63) + d[8:],
        f"{NOT_SAFETENSORS}.*header length 9223372036854775808 exceeds",
    ),
    (
        "st-header-length-beyond-file",
        ".safetensors",
        lambda d: struct.pack("<Q", len(d) + 8) + d[8:],
        f"{NOT_SAFETENSORS}.*header length .* exceeds the",
    ),
    (
        "st-header-not-json",
        ".safetensors",
        lambda d: struct.pack("<Q", 4) + b"{nah",
        f"{NOT_SAFETENSORS}.*header is not JSON",
    ),
    (
        "st-offsets-outside-file",
        ".safetensors",
        lambda d: safetensors_bytes({"target_latent": f32([4, 8, 8], (0, 1024))}, bytes(16)),
        f"{NOT_SAFETENSORS}.*lies outside the 16-byte data section",
    ),
    (
        "st-unknown-dtype",
        ".safetensors",
        lambda d: safetensors_bytes({"target_latent": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
        f"{NOT_SAFETENSORS}.*unsupported dtype 'Q7'",
    ),
    (
        "st-gigantic-shape",
        ".safetensors",
        lambda d: safetensors_bytes({"target_latent": f32([16, 10**12, 10**12], (0, 8))}, bytes(8)),
        f"{NOT_SAFETENSORS}.*does not hold shape",
    ),
    (
        "st-gigantic-shape-with-matching-offsets",
        ".safetensors",
        lambda d: safetensors_bytes({"target_latent": f32([16, 10**6, 10**6], (0, 64 * 10**12))}, bytes(8)),
        f"{NOT_SAFETENSORS}.*lies outside the 8-byte data section",
    ),
    (
        "st-context-index-not-a-number",
        ".safetensors",
        contexts_named("context_latents.first"),
        r"context_latents: expected context_latents.<i> for i = 0..0, got \['context_latents.first'\]",
    ),
    (
        "st-context-index-spelled-twice",
        ".safetensors",
        contexts_named("context_latents.0", "context_latents.00"),
        r"context_latents: expected context_latents.<i> for i = 0..1",
    ),
    (
        "st-context-index-gap",
        ".safetensors",
        contexts_named("context_latents.0", "context_latents.2"),
        r"context_latents: expected context_latents.<i> for i = 0..1",
    ),
    (
        "st-metadata-nested-100k-deep",
        ".safetensors",
        metadata_json("[" * 100_000 + "]" * 100_000),
        "image_edit_data.metadata: invalid JSON: nesting is too deep",
    ),
    (
        "st-metadata-5000-digit-integer",
        ".safetensors",
        metadata_json("1" * 5000),
        "image_edit_data.metadata: invalid JSON: Exceeds the limit",
    ),
]


@pytest.mark.parametrize(
    ("suffix", "mutate", "message"), [case[1:] for case in BROKEN_BYTES], ids=[case[0] for case in BROKEN_BYTES]
)
def test_broken_payload_bytes_fail_that_sample_naming_the_file(
    tmp_path: Path, suffix: str, mutate: Callable[[bytes], bytes], message: str
) -> None:
    root = one_sample(tmp_path, suffix)
    relative = PT if suffix == ".pt" else ST
    (root / relative).write_bytes(mutate(valid_bytes(suffix)))
    dataset = ImageEditDataset(root)  # payload problems surface when the sample loads, not before
    with pytest.raises(CacheFormatError, match=f"^{relative}: {message}"):
        dataset[0]


def test_zip_bomb_payload_is_refused_before_inflating(tmp_path: Path) -> None:
    elements = 8 * 1024 * 1024  # 32 MiB of float32 zeros, deflated to ~33 KB; torch.load would inflate it
    buffer = io.BytesIO()
    torch.save({"target_latent": torch.zeros(4)}, buffer)

    def inflate(name: str, content: bytes) -> bytes:
        if name.endswith("data.pkl"):
            return content.replace(b"K\x04", b"J" + struct.pack("<i", elements))  # numel and size 4 -> 8Mi
        return bytes(4 * elements) if name.endswith("data/0") else content

    root = one_sample(tmp_path)
    (root / PT).write_bytes(rezip(buffer.getvalue(), inflate, zipfile.ZIP_DEFLATED))
    assert (root / PT).stat().st_size < 100_000
    with pytest.raises(
        CacheFormatError, match=rf"^{PT}: payload: zip entries unpack to 33554\d{{3}} bytes from a \d+-byte"
    ):
        load_first(root)


# --- payloads that try to run code -----------------------------------------------------------------

MARKER_MODULE = "hostile_cache_import_marker"


def leave_marker(path: str) -> None:
    """A function of an arbitrary module; a hostile pickle asks the loader to call it."""
    Path(path).touch()


def call_op(module: str, name: str, *args: str) -> bytes:
    """Opcodes calling `module.name(*args)` (GLOBAL, MARK, args, TUPLE, REDUCE)."""
    return b"c" + f"{module}\n{name}\n".encode() + b"(" + b"".join(map(unicode_op, args)) + b"tR"


# form -> (opcodes given the marker path, what the refusal names)
EXECUTION_FORMS: dict[str, tuple[Callable[[str], bytes], str]] = {
    "os.system": (lambda marker: call_op("os", "system", f"touch {marker}"), "GLOBAL os.system"),
    "builtins.eval": (
        lambda marker: call_op("builtins", "eval", f"open({marker!r}, 'w').close()"),
        "GLOBAL (builtins.)?eval",
    ),
    "builtins.exec-via-stack-global": (
        lambda marker: unicode_op("builtins") + unicode_op("exec") + b"\x93" + call_op("", "", marker)[3:],
        "Unsupported operand 147",  # STACK_GLOBAL is refused outright
    ),
    "subprocess.getoutput": (
        lambda marker: call_op("subprocess", "getoutput", f"touch {marker}"),
        "GLOBAL subprocess.getoutput",
    ),
    "arbitrary-module-function": (
        lambda marker: call_op(leave_marker.__module__, "leave_marker", marker),
        f"GLOBAL {leave_marker.__module__}.leave_marker",
    ),
    "module-that-runs-code-on-import": (
        lambda marker: call_op(MARKER_MODULE, "anything", marker),
        f"GLOBAL {MARKER_MODULE}.anything",
    ),
}


@pytest.mark.parametrize("container", ["raw-pickle", "torch-zip"])
@pytest.mark.parametrize("form", list(EXECUTION_FORMS))
def test_payload_pickles_that_would_run_code_are_refused_and_nothing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str, container: str
) -> None:
    marker = tmp_path / "marker"
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / f"{MARKER_MODULE}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(modules))
    monkeypatch.chdir(tmp_path)
    # Explicit weights_only=True must win even where the environment asks torch to load unsafely.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    build, refusal = EXECUTION_FORMS[form]
    opcodes = build(str(marker))
    root = one_sample(tmp_path / "cache")
    data = b"\x80\x02" + opcodes + b"." if container == "raw-pickle" else payload_with(opcodes)
    (root / PT).write_bytes(data)
    with pytest.raises(CacheFormatError, match=rf"^{PT}: payload: refused by the weights-only loader \(.*{refusal}"):
        load_first(root)
    assert not marker.exists()
    assert MARKER_MODULE not in sys.modules


# --- no file outside the cache is opened ---------------------------------------------------------

OPENED: list[str] | None = None  # a list only while `files_opened()` records


def record_opens(event: str, args: tuple[Any, ...]) -> None:
    """Record the real file each open reaches: with O_NOFOLLOW, a final symlink is not followed."""
    if OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        if flags & os.O_NOFOLLOW:
            OPENED.append(os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path)))
        else:
            OPENED.append(os.path.realpath(path))


sys.addaudithook(record_opens)  # audit hooks cannot be removed; this one records only inside files_opened()


@contextmanager
def files_opened() -> Iterator[list[str]]:
    """Every file opened (by open(), os.open() or pathlib) while the block runs, as a real path."""
    global OPENED
    OPENED = []
    try:
        yield OPENED
    finally:
        OPENED = None


def outside(paths: list[str], root: Path) -> list[str]:
    real_root = os.path.realpath(root)
    return [p for p in paths if os.path.commonpath([p, real_root]) != real_root]


@pytest.fixture(scope="module")
def warmed_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Load valid and broken caches once, so lazy imports do not count as opened files."""
    for suffix in (".pt", ".safetensors"):
        root = one_sample(tmp_path_factory.mktemp("warm"), suffix)
        load_first(root)
        (root / (PT if suffix == ".pt" else ST)).write_bytes(b"junk")
        with pytest.raises(ValueError):
            load_first(root)


def outside_payload(tmp_path: Path) -> Path:
    path = tmp_path / "secret.pt"
    torch.save(make_payload(0), path)  # a valid payload: reading it would succeed
    return path


def outside_shard(tmp_path: Path) -> Path:
    path = tmp_path / "secret_shard.json"
    path.write_text(json.dumps([record(PT)]))
    return path


def payload_dotdot(tmp_path: Path, root: Path) -> None:
    outside_payload(tmp_path)
    write_shard(root, [record("samples/../../secret.pt")])


def payload_absolute(tmp_path: Path, root: Path) -> None:
    write_shard(root, [record(str(outside_payload(tmp_path)))])


def payload_symlink(tmp_path: Path, root: Path) -> None:
    (root / PT).unlink()
    (root / PT).symlink_to(outside_payload(tmp_path))


def payload_symlink_to_etc_passwd(tmp_path: Path, root: Path) -> None:
    (root / PT).unlink()
    (root / PT).symlink_to("/etc/passwd")


def payload_directory_symlink(tmp_path: Path, root: Path) -> None:
    os.rename(root / "samples", tmp_path / "real_samples")
    (root / "samples").symlink_to(tmp_path / "real_samples")


def shard_dotdot(tmp_path: Path, root: Path) -> None:
    outside_shard(tmp_path)
    (root / "metadata.json").write_text(json.dumps({"shards": ["../secret_shard.json"]}))


def shard_etc_passwd(tmp_path: Path, root: Path) -> None:
    (root / "metadata.json").write_text(json.dumps({"shards": ["/etc/passwd"]}))


def shard_dotdot_etc_passwd(tmp_path: Path, root: Path) -> None:
    (root / "metadata.json").write_text(json.dumps({"shards": ["../" * 40 + "etc/passwd"]}))


def shard_symlink(tmp_path: Path, root: Path) -> None:
    (root / "metadata_shard_0000.json").unlink()
    (root / "metadata_shard_0000.json").symlink_to(outside_shard(tmp_path))


def manifest_symlink(tmp_path: Path, root: Path) -> None:
    os.rename(root / "metadata.json", tmp_path / "secret_manifest.json")
    (root / "metadata.json").symlink_to(tmp_path / "secret_manifest.json")


def planted_stored_index(tmp_path: Path, root: Path) -> None:
    """A stored compact index shipped with the cache, whose path blob leads outside."""
    outside_payload(tmp_path)
    index = ImageEditDataset(root).index
    blob = b"../secret.pt"
    planted = replace(
        index,
        path_blob=np.frombuffer(blob, dtype=np.uint8),
        path_offsets=np.array([0, len(blob)], dtype=np.int64),
    )
    for path in candidate_paths(index.root, store_key(index.root)):
        if path.is_file():
            path.write_bytes(serialize(planted))


ESCAPES: list[tuple[Callable[[Path, Path], None], str]] = [
    (payload_dotdot, "open"),
    (payload_absolute, "open"),
    (payload_symlink, "load"),
    (payload_symlink_to_etc_passwd, "load"),
    (payload_directory_symlink, "open"),
    (shard_dotdot, "open"),
    (shard_etc_passwd, "open"),
    (shard_dotdot_etc_passwd, "open"),
    (shard_symlink, "open"),
    (planted_stored_index, "load"),
]


@pytest.mark.usefixtures("warmed_up")
@pytest.mark.parametrize(("escape", "step"), ESCAPES, ids=[e.__name__ for e, _ in ESCAPES])
def test_escapes_are_refused_without_opening_a_file_outside_the_cache(
    tmp_path: Path, escape: Callable[[Path, Path], None], step: str
) -> None:
    root = one_sample(tmp_path / "cache")
    escape(tmp_path, root)
    with files_opened() as opened, pytest.raises(CacheFormatError, match="outside cache directory"):
        dataset = ImageEditDataset(root)
        assert step == "load", "the index should have refused to open"
        dataset[0]
    assert opened, "the audit hook saw no file opened at all"
    assert outside(opened, root) == []


@pytest.mark.usefixtures("warmed_up")
@pytest.mark.parametrize("use_index_store", [True, False])
def test_manifest_symlink_leaving_the_cache_is_refused_unread(tmp_path: Path, use_index_store: bool) -> None:
    root = one_sample(tmp_path / "cache")
    manifest_symlink(tmp_path, root)
    message = "^metadata.json: file: .* outside cache directory"
    with files_opened() as opened, pytest.raises(CacheFormatError, match=message):
        ImageEditDataset(root, use_index_store=use_index_store)
    assert outside(opened, root) == []


# --- paths that are not files of the cache ---------------------------------------------------------


def make_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


PATH_CASES: list[tuple[str, Callable[[Path], None], str, str]] = [
    (
        "nul-byte-in-payload-path",
        lambda root: write_shard(root, [record("samples/a\x00.pt")]),
        "open",
        r"metadata_shard_0000.json: \[0\]\.cache_file: path 'samples/a\\x00.pt' contains a NUL byte",
    ),
    (
        "nul-byte-in-shard-path",
        lambda root: (root / "metadata.json").write_text(json.dumps({"shards": ["shard\x00.json"]})),
        "open",
        r"metadata.json: shards\[0\]: path 'shard\\x00.json' contains a NUL byte",
    ),
    (
        "lone-surrogate-in-payload-path",
        lambda root: write_shard(root, [record("samples/\ud800.pt")]),  # json.dumps writes it as \\ud800
        "open",
        r"\[0\]\.cache_file: path 'samples/\\ud800.pt' is not valid Unicode",
    ),
    (
        "payload-path-of-5000-characters",
        lambda root: write_shard(root, [record("a" * 5000)]),
        "open",
        r"\[0\]\.cache_file: path of 5000 characters is longer than the 4096 bytes",
    ),
    (
        "payload-is-the-cache-directory",
        lambda root: write_shard(root, [record("samples/..")]),
        "open",
        r"\[0\]\.cache_file: path 'samples/\.\.' is the cache directory itself",
    ),
    (
        "payload-is-a-directory",
        lambda root: write_shard(root, [record("samples")]),
        "load",
        "^samples: file: expected a regular file, got a directory",
    ),
    (
        "payload-is-a-fifo",
        lambda root: make_fifo(root / PT),
        "load",
        f"^{PT}: file: expected a regular file, got a pipe",
    ),
    (
        "payload-is-a-symlink-loop",
        lambda root: ((root / PT).unlink(), (root / PT).symlink_to(root / PT)),
        "load",
        f"^{PT}: file: cannot be read: Too many levels of symbolic links",
    ),
    (
        "shard-is-a-fifo",
        lambda root: make_fifo(root / "metadata_shard_0000.json"),
        "open",
        "^metadata_shard_0000.json: file: expected a regular file, got a pipe",
    ),
    (
        "manifest-is-a-fifo",
        lambda root: make_fifo(root / "metadata.json"),
        "open",
        "^metadata.json: file: expected a regular file, got a pipe",
    ),
    (
        "shard-is-a-directory",
        lambda root: (root / "metadata.json").write_text(json.dumps({"shards": ["samples"]})),
        "open",
        "^samples: file: expected a regular file, got a directory",
    ),
    (
        "shard-is-the-manifest",
        lambda root: (root / "metadata.json").write_text(json.dumps({"shards": ["metadata.json"]})),
        "open",
        r"^metadata.json: shards\[0\]: 'metadata.json' is the manifest itself",
    ),
    (
        "shard-is-the-manifest-spelled-otherwise",
        lambda root: (root / "metadata.json").write_text(
            json.dumps({"shards": ["metadata_shard_0000.json", f"{root}/samples/../metadata.json"]})
        ),
        "open",
        r"^metadata.json: shards\[1\]: '.*/samples/../metadata.json' is the manifest itself",
    ),
]


@pytest.mark.parametrize(("edit", "step", "message"), [c[1:] for c in PATH_CASES], ids=[c[0] for c in PATH_CASES])
def test_paths_that_are_not_cache_files_are_refused(
    tmp_path: Path, edit: Callable[[Path], None], step: str, message: str
) -> None:
    root = one_sample(tmp_path)
    edit(root)
    with pytest.raises(CacheFormatError, match=message):
        dataset = ImageEditDataset(root)
        assert step == "load", "the index should have refused to open"
        dataset[0]


def test_a_payload_that_is_a_shard_is_refused_as_not_torch(tmp_path: Path) -> None:
    root = one_sample(tmp_path)
    write_shard(root, [record(PT), record("metadata_shard_0000.json")])
    with pytest.raises(CacheFormatError, match="^metadata_shard_0000.json: payload: "):
        ImageEditDataset(root)[1]


def test_missing_payloads_fail_only_their_own_sample(tmp_path: Path) -> None:
    root = write_cache(tmp_path, [make_payload(i) for i in range(3)])
    (root / "samples/sample_00000001.pt").unlink()
    write_shard(root, [record(PT), record("samples/sample_00000001.pt"), record("gone/sample_00000002.pt")])
    dataset = ImageEditDataset(root)
    assert len(dataset) == 3
    assert dataset[0]["metadata"]["original_ids"] == {"id": "s0"}
    with pytest.raises(CacheFormatError, match="^samples/sample_00000001.pt: file: cannot be read: No such file"):
        dataset[1]
    with pytest.raises(CacheFormatError, match="^gone/sample_00000002.pt: file: cannot be read: No such file"):
        dataset[2]


@pytest.mark.parametrize("use_index_store", [True, False])
def test_a_manifest_listing_a_missing_shard_names_it(tmp_path: Path, use_index_store: bool) -> None:
    root = one_sample(tmp_path)
    (root / "metadata.json").write_text(json.dumps({"shards": ["metadata_shard_0000.json", "shard_9.json"]}))
    with pytest.raises(CacheFormatError, match="^shard_9.json: file: does not exist"):
        ImageEditDataset(root, use_index_store=use_index_store)


# --- JSON that is broken, deep or huge -------------------------------------------------------------

JSON_CASES = [
    ("shard-latin-1", SHARD, '[{"cache_file": "caf\xe9.pt"}]'.encode("latin-1"), f"^{SHARD}: encoding: expected UTF-8"),
    ("shard-utf-16", SHARD, "[]".encode("utf-16"), f"^{SHARD}: encoding: expected UTF-8"),
    ("shard-utf-8-bom", SHARD, b"\xef\xbb\xbf[]", f"^{SHARD}: json: invalid JSON: Unexpected UTF-8 BOM"),
    ("manifest-100k-nested-lists", "metadata.json", b"[" * 100_000 + b"]" * 100_000, "^metadata.json: json: nesting"),
    (
        "manifest-100k-nested-objects",
        "metadata.json",
        b'{"shards": [], "a": ' * 100_000 + b"0" + b"}" * 100_000,
        "^metadata.json: json: nesting is too deep",
    ),
    ("shard-100k-nested-lists", SHARD, b"[" * 100_000 + b"]" * 100_000, f"^{SHARD}: json: nesting is too deep"),
    (
        "shard-100k-nested-objects-in-a-record",
        SHARD,
        b'[{"cache_file": "x.pt", "a": ' + b'{"a": ' * 100_000 + b"0" + b"}" * 100_001 + b"]",
        f"^{SHARD}: json: nesting is too deep",
    ),
    ("shard-5000-digit-integer", SHARD, b"[" + b"7" * 5000 + b"]", f"^{SHARD}: json: invalid JSON: Exceeds the limit"),
    ("shard-truncated", SHARD, b'[{"cache_file": "samp', f"^{SHARD}: json: invalid JSON: Unterminated string"),
]


@pytest.mark.parametrize(("name", "content", "message"), [c[1:] for c in JSON_CASES], ids=[c[0] for c in JSON_CASES])
def test_broken_json_is_refused_naming_the_file(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    root = one_sample(tmp_path)
    (root / name).write_bytes(content)
    with pytest.raises(CacheFormatError, match=message):
        ImageEditDataset(root)


def test_a_manifest_over_16_mib_is_refused_unparsed(tmp_path: Path) -> None:
    root = one_sample(tmp_path)
    manifest = {"shards": [SHARD], "padding": "x" * MAX_MANIFEST_BYTES}
    (root / "metadata.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheFormatError, match=r"^metadata.json: file: is 16777\d+ bytes, more than the 16777216"):
        ImageEditDataset(root)


def test_a_shard_holding_a_50_mb_string_opens_and_keeps_only_the_compact_index(tmp_path: Path) -> None:
    root = one_sample(tmp_path)
    write_shard(root, [record(PT, original_id="x" * 50_000_000)])
    dataset = ImageEditDataset(root)
    assert dataset.index.nbytes < 1000  # the record's other fields are not kept
    assert dataset[0]["metadata"]["original_ids"] == {"id": "s0"}


def test_a_50_mb_payload_path_is_refused_with_a_short_message(tmp_path: Path) -> None:
    root = one_sample(tmp_path)
    write_shard(root, [record("samples/" + "a" * 50_000_000 + ".pt")])
    with pytest.raises(CacheFormatError, match=r"\[0\]\.cache_file: path of 50000011 characters is longer") as error:
        ImageEditDataset(root)
    assert len(str(error.value)) < 200


# --- index records -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([1], r"\[0\]: expected a record object, got int"),
        ([record(PT), "samples/a.pt"], r"\[1\]: expected a record object, got str"),
        ([None], r"\[0\]: expected a record object, got NoneType"),
        ([[PT, SIGNATURE]], r"\[0\]: expected a record object, got list"),
    ],
    ids=["int", "string", "null", "list"],
)
def test_records_that_are_not_objects_are_refused(tmp_path: Path, records: list[Any], message: str) -> None:
    root = one_sample(tmp_path)
    write_shard(root, records)
    with pytest.raises(CacheFormatError, match=f"^{SHARD}: {message}"):
        ImageEditDataset(root)


def test_a_shard_listed_twice_in_the_manifest_is_refused(tmp_path: Path) -> None:
    root = one_sample(tmp_path)
    (root / "metadata.json").write_text(json.dumps({"shards": [SHARD, f"./samples/../{SHARD}"]}))
    with pytest.raises(
        CacheFormatError, match=r"^metadata.json: shards\[1\]: .* is listed twice \(first at shards\[0\]\)"
    ):
        ImageEditDataset(root)


def test_one_payload_listed_in_two_shards_under_two_spellings_is_refused(tmp_path: Path) -> None:
    root = one_sample(tmp_path)
    write_shard(root, [record(f"{root}/samples/./sample_00000000.pt")], "metadata_shard_0001.json")
    (root / "metadata.json").write_text(json.dumps({"shards": [SHARD, "metadata_shard_0001.json"]}))
    message = rf"^metadata_shard_0001.json: \[0\]\.cache_file: '{PT}' is listed twice \(first at {SHARD}\[0\]\)"
    with pytest.raises(CacheFormatError, match=message):
        ImageEditDataset(root)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"text_token_length": 2**32}, r"\[0\]\.text_token_length: expected a non-negative integer below 2\*\*31"),
        (
            {"compound_bucket_signature": {"target": [4, 8, 2**63], "contexts": [[4, 8, 8]]}},
            r"\[0\]\.compound_bucket_signature\.target: expected positive integer dimensions below 2\*\*63",
        ),
        (
            {"compound_bucket_signature": {"target": [4, 8, 10**400], "contexts": [[4, 8, 8]]}},
            r"\[0\]\.compound_bucket_signature\.target: .* got \[4, 8, 1000",
        ),
    ],
    ids=["token-count-beyond-int32", "dimension-2**63", "dimension-10**400"],
)
def test_numbers_no_index_can_hold_are_refused(tmp_path: Path, extra: dict[str, Any], message: str) -> None:
    root = one_sample(tmp_path)
    write_shard(root, [{**record(PT), **extra}])
    with pytest.raises(CacheFormatError, match=f"^{SHARD}: {message}") as error:
        ImageEditDataset(root)
    assert len(str(error.value)) < 1100


def test_gigantic_index_shapes_open_and_fail_the_sample_without_allocating(tmp_path: Path) -> None:
    root = one_sample(tmp_path)
    giant = {"target": [16, 10**12, 10**12], "contexts": [[16, 10**12, 10**12]]}
    write_shard(root, [{**record(PT), "compound_bucket_signature": giant}])
    tracemalloc.start()
    try:
        dataset = ImageEditDataset(root)
        assert dataset.get_bucket_info()["buckets"] == {
            "target=16x1000000000000x1000000000000/contexts=[16x1000000000000x1000000000000]": 1
        }
        shapes = r"tensor shapes .* do not match metadata shard signature target=16x10+x10+"
        with pytest.raises(CacheFormatError, match=f"^{PT}: compound_bucket_signature: {shapes}"):
            dataset[0]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20


# --- tensors that are not what they claim --------------------------------------------------------


def expanded_payload(height: int, width: int) -> dict[str, Any]:
    """A payload whose 16 x height x width target is a zero-stride view of one stored float."""
    payload = make_payload(0)
    payload["target_latent"] = torch.zeros(1).expand(16, height, width)
    payload["metadata"]["target_spatial_shape"] = [height, width]
    payload["metadata"]["compound_bucket_signature"]["target"] = [16, height, width]
    return payload


def with_target(tensor: torch.Tensor) -> dict[str, Any]:
    payload = make_payload(0)
    payload["target_latent"] = tensor
    return payload


TENSOR_CASES = [
    (
        "zero-stride-view-claiming-16x4096x4096",
        lambda: expanded_payload(4096, 4096),
        r"target_latent: shape \[16, 4096, 4096\] needs 1073741824 bytes but the stored data holds 4",
    ),
    (
        "meta-device-target",
        lambda: with_target(torch.empty(4, 8, 8, device="meta")),
        "target_latent: expected a dense CPU",
    ),
    ("sparse-target", lambda: with_target(torch.zeros(4, 8, 8).to_sparse()), "target_latent: expected a dense CPU"),
    (
        "sparse-prompt-embeddings",
        lambda: {**make_payload(0), "prompt_embeddings": torch.zeros(5, 6).to_sparse()},
        "prompt_embeddings: expected a dense CPU",
    ),
    (
        "expanded-conditioning-tensor",
        lambda: make_payload(0, conditioning={"grid": torch.zeros(1, 1).expand(1000, 1000)}),
        r"conditioning_tensors.grid: shape \[1000, 1000\] needs",
    ),
]


@pytest.mark.parametrize(("build", "message"), [c[1:] for c in TENSOR_CASES], ids=[c[0] for c in TENSOR_CASES])
def test_tensors_without_their_own_dense_data_are_refused(
    tmp_path: Path, build: Callable[[], dict[str, Any]], message: str
) -> None:
    root = write_cache(tmp_path, [build()])
    with pytest.raises(CacheFormatError, match=f"^{PT}: {message}"):
        load_first(root)


def test_a_100k_deep_pickled_metadata_value_is_refused_before_anything_recurses(tmp_path: Path) -> None:
    depth = 100_000
    root = one_sample(tmp_path)
    (root / PT).write_bytes(payload_with(b"]" * depth + b"a" * (depth - 1)))  # lists appended into lists
    with pytest.raises(CacheFormatError, match=f"^{PT}: metadata: nests deeper than 32 levels"):
        load_first(root)


def test_a_billion_laughs_metadata_value_is_refused(tmp_path: Path) -> None:
    # Level i + 1 is a list holding level i twice, by memo reference: 2**20 values from 400 bytes of pickle.
    def memo(op: bytes, slot: int) -> bytes:  # LONG_BINPUT / LONG_BINGET, far above torch's own memo slots
        return op + struct.pack("<I", 10**6 + slot)

    levels = b"".join(b"](" + memo(b"j", i) + memo(b"j", i) + b"e" + memo(b"r", i + 1) for i in range(20))
    root = one_sample(tmp_path)
    (root / PT).write_bytes(payload_with(b"](]" + memo(b"r", 0) + levels + b"e"))  # a list of all the levels
    with pytest.raises(CacheFormatError, match=f"^{PT}: metadata: holds more than 100000 values"):
        load_first(root)


def nested(depth: int, leaf: object = 1) -> object:
    """`depth` levels of containers (a dict, then lists) around `leaf`: `bounded` counts the outer value as level 1."""
    value = leaf
    for _ in range(depth - 2):
        value = [value]
    return {"k": value}


def nested_tuple(depth: int) -> tuple[object, ...]:
    """`depth` levels of tuples around 1 (hashable, so it can be a dict key)."""
    value: tuple[object, ...] = (1,)
    for _ in range(depth - 1):
        value = ("a", value)
    return value


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (nested(32), None),
        (nested(33), "nests deeper than 32 levels"),
        ({nested_tuple(31): 1}, "nests deeper than 32 levels"),  # nesting inside a tuple key counts
        ({nested_tuple(30): 1}, None),
        ({frozenset({1, 2}): [1] * 10}, None),
        ({"k": [0] * 99_997}, None),  # 1 + 2 + 99,997 = 100,000 values counted
        ({"k": [0] * 99_998}, "holds more than 100000 values"),
        ({"k": [0] * 99_997, 7: 1}, "holds more than 100000 values"),
        ({"k": {(i, i) for i in range(50_000)}}, "holds more than 100000 values"),  # tuples in a set
        (nested(40, leaf=[]), "nests deeper than 32 levels"),
    ],
)
def test_metadata_bounds_count_every_container_kind(value: object, problem: str | None) -> None:
    from image_edit_data.contract.validate import bounded

    if problem is None:
        bounded(value, "f.safetensors", "metadata")
        return
    with pytest.raises(CacheFormatError, match=f"^f.safetensors: metadata: {problem}$"):
        bounded(value, "f.safetensors", "metadata")


@contextmanager
def address_space_cap(headroom: int) -> Iterator[None]:
    """Cap this process's address space at its current size plus `headroom`; the soft limit is restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    pages = int(Path("/proc/self/statm").read_text().split()[0])
    cap = pages * os.sysconf("SC_PAGE_SIZE") + headroom
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm to cap RLIMIT_AS")
def test_gigantic_declarations_fail_clearly_within_512_mib_of_address_space(tmp_path: Path) -> None:
    giant_index = one_sample(tmp_path / "giant_index")
    giant = {"target": [16, 10**12, 10**12], "contexts": [[4, 8, 8]]}
    write_shard(giant_index, [{**record(PT), "compound_bucket_signature": giant}])
    big_index = one_sample(tmp_path / "big_index")  # 4 GiB if anything allocated from the index
    write_shard(big_index, [{**record(PT), "compound_bucket_signature": {**giant, "target": [16, 8192, 8192]}}])
    giant_header = one_sample(tmp_path / "giant_header", ".safetensors")
    header = {"target_latent": f32([16, 10**6, 10**6], (0, 64 * 10**12))}
    (giant_header / ST).write_bytes(safetensors_bytes(header, bytes(8)))
    expanded = write_cache(tmp_path / "expanded", [expanded_payload(8192, 8192)])  # 8 GiB once stacked
    load_first(one_sample(tmp_path / "warm"))  # lazy imports happen before the cap
    messages = []
    with address_space_cap(512 * 2**20):
        for root in (giant_index, big_index, giant_header, expanded):
            dataset = ImageEditDataset(root)
            with pytest.raises(CacheFormatError) as error:
                collate_image_edit([dataset[0], dataset[0]])
            messages.append(str(error.value))
    index_says = f"{PT}: compound_bucket_signature: tensor shapes .* do not match metadata shard signature"
    assert re.match(f"{index_says} target=16x1000000000000x", messages[0]), messages[0]
    assert re.match(f"{index_says} target=16x8192x8192/", messages[1]), messages[1]
    assert messages[2].startswith(f"{ST}: payload: not a readable safetensors file")
    assert messages[3].startswith(f"{PT}: target_latent: shape [16, 8192, 8192] needs 4294967296 bytes")


# --- values the reader accepts but other tools must catch ------------------------------------------


def test_nan_and_inf_latents_load_and_cache_validate_check_finite_reports_them(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    payloads = [make_payload(i) for i in range(3)]
    for payload in payloads:
        payload["target_latent"] = payload["target_latent"].to(torch.bfloat16)
        payload["context_latents"] = [c.to(torch.bfloat16) for c in payload["context_latents"]]
    payloads[1]["target_latent"][0, 0, :2] = float("nan")
    payloads[2]["context_latents"][0][1, 2, 3] = float("-inf")
    payloads[2]["prompt_embeddings"][0, 0] = float("inf")
    root = write_cache(tmp_path, payloads, suffix=".safetensors")
    dataset = ImageEditDataset(root)
    assert torch.isnan(dataset[1]["target_latent"]).sum() == 2  # the reader accepts non-finite values
    assert cache_main(["validate", str(root)]) == 0
    capsys.readouterr()
    assert cache_main(["validate", str(root), "--check-finite"]) == 1
    out = capsys.readouterr().out
    assert "2 of 3 samples are bad" in out
    assert "samples/sample_00000001.safetensors: target_latent: contains 2 NaN and 0 Inf values" in out
    assert "samples/sample_00000002.safetensors: context_latents[0]: contains 0 NaN and 1 Inf values" in out
    assert "samples/sample_00000002.safetensors: prompt_embeddings: contains 0 NaN and 1 Inf values" in out
    assert "sample_00000000" not in out


def test_one_bucket_holding_bf16_and_fp32_latents_loads_but_does_not_collate(tmp_path: Path) -> None:
    payloads = [make_payload(0), make_payload(1)]
    payloads[0]["target_latent"] = payloads[0]["target_latent"].to(torch.bfloat16)
    root = write_cache(tmp_path, payloads)
    dataset = ImageEditDataset(root)
    assert len(dataset.signatures) == 1
    samples = [dataset[0], dataset[1]]
    assert [s["target_latent"].dtype for s in samples] == [torch.bfloat16, torch.float32]
    message = r"target_latent shape/dtype of sample 1 is \[4, 8, 8\] float32, sample 0 has \[4, 8, 8\] bfloat16$"
    with pytest.raises(ValueError, match=message):
        collate_image_edit(samples)
    build = ImageEditDataloaderConfig(cache_dir=str(root), num_workers=0, shuffle=False).build(
        dp_rank=0, dp_world_size=1, batch_size=2
    )
    with pytest.raises(ValueError, match="target_latent shape/dtype of sample 1"):
        next(iter(build.dataloader))


# --- empty caches: a valid dataset of no samples; no loader over it ---------------------------------

EMPTY = [
    ("manifest-without-shards", lambda root: (root / "metadata.json").write_text('{"shards": []}')),
    ("shards-without-records", lambda root: write_shard(root, [])),
]


@pytest.mark.parametrize("empty", [e[1] for e in EMPTY], ids=[e[0] for e in EMPTY])
def test_an_empty_cache_is_an_empty_dataset(tmp_path: Path, empty: Callable[[Path], None]) -> None:
    root = one_sample(tmp_path)
    empty(root)
    dataset = ImageEditDataset(root)
    assert len(dataset) == 0
    assert dataset.get_bucket_info() == {"total_buckets": 0, "buckets": {}}
    with pytest.raises(IndexError, match="sample index 0 is out of range for a cache of 0 samples"):
        dataset[0]


@pytest.mark.parametrize("empty", [e[1] for e in EMPTY], ids=[e[0] for e in EMPTY])
def test_a_loader_over_an_empty_cache_says_the_cache_is_empty(tmp_path: Path, empty: Callable[[Path], None]) -> None:
    root = one_sample(tmp_path)
    empty(root)
    with pytest.raises(ValueError, match="no samples"):
        ImageEditDataloaderConfig(cache_dir=str(root), num_workers=0).build(dp_rank=0, dp_world_size=1, batch_size=2)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda a: a.__setitem__("bucket_ids", a["bucket_ids"] + 99), "bucket ids out of range"),
        (lambda a: a.__setitem__("path_offsets", a["path_offsets"][::-1].copy()), "path offsets"),
        (lambda a: a.__setitem__("text_tokens", a["text_tokens"][:1]), "array shapes disagree"),
    ],
)
def test_a_planted_inconsistent_stored_index_is_ignored(
    tmp_path: Path, damage: Callable[[dict[str, np.ndarray]], None], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = write_cache(tmp_path, [make_payload(i) for i in range(3)])
    ImageEditDataset(root)
    (stored,) = (root / ".image_edit_data").glob("index-*.npz")
    with np.load(stored) as original:
        arrays = {name: original[name] for name in original.files}
    damage(arrays)
    np.savez(stored, **arrays)
    with caplog.at_level("WARNING"):
        dataset = ImageEditDataset(root)
    assert reason in caplog.text
    assert [dataset[i]["metadata"]["original_ids"]["id"] for i in range(3)] == ["s0", "s1", "s2"]
