"""Claims about how a folder of parquet files is split: by the hub's naming, never read as one set when it holds two."""

from __future__ import annotations

from pathlib import Path

import pytest

from image_edit_data.preprocess.sources.hub_splits import choose_split, parquet_files, parquet_splits


def layout(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"")
    return root


def splits(root: Path) -> dict[str | None, list[str]]:
    return {
        k: [p.relative_to(root).as_posix() for p in v] for k, v in parquet_splits(root, parquet_files(root)).items()
    }


LAYOUTS = [
    # MagicBrush's repository: sharded names in data/ (the folder itself or the repository root given)
    (
        (
            "data/train-00000-of-00002-0a.parquet",
            "data/train-00001-of-00002-0b.parquet",
            "data/dev-00000-of-00001.parquet",
        ),
        {
            "train": ["data/train-00000-of-00002-0a.parquet", "data/train-00001-of-00002-0b.parquet"],
            "dev": ["data/dev-00000-of-00001.parquet"],
        },
    ),
    # UltraEdit's split names
    (
        ("data/FreeForm_0-00000-of-00002.parquet", "data/RegionBased_0-00000-of-00001.parquet"),
        {
            "FreeForm_0": ["data/FreeForm_0-00000-of-00002.parquet"],
            "RegionBased_0": ["data/RegionBased_0-00000-of-00001.parquet"],
        },
    ),
    (
        ("data/train/0.parquet", "data/my_split/1.parquet"),
        {"train": ["data/train/0.parquet"], "my_split": ["data/my_split/1.parquet"]},
    ),
    # the datasets library's keywords, grouped as it groups them
    (("train/a.parquet", "dev/b.parquet"), {"train": ["train/a.parquet"], "validation": ["dev/b.parquet"]}),
    (("train.parquet", "test.parquet"), {"train": ["train.parquet"], "test": ["test.parquet"]}),
    (
        ("shards/part-0.parquet", "part-1.parquet", ".cache/x.parquet"),
        {None: ["part-1.parquet", "shards/part-0.parquet"]},
    ),
]


@pytest.mark.parametrize(("names", "expected"), LAYOUTS)
def test_parquet_files_are_grouped_by_the_hubs_split_naming(
    tmp_path: Path, names: tuple[str, ...], expected: dict
) -> None:
    assert splits(layout(tmp_path, *names)) == expected


def test_the_data_folder_given_directly_keeps_its_split_names(tmp_path: Path) -> None:
    root = layout(tmp_path, "data/train-00000-of-00001.parquet", "data/dev-00000-of-00001.parquet")
    assert sorted(splits(root / "data"), key=str) == ["dev", "train"]
    root = layout(tmp_path / "b", "data/train/0.parquet", "data/dev/0.parquet")
    assert sorted(splits(root / "data"), key=str) == ["dev", "train"]


def test_a_file_without_a_split_name_beside_named_ones_or_named_twice_is_refused(tmp_path: Path) -> None:
    root = layout(tmp_path / "a", "data/train-00000-of-00001.parquet", "data/extra.parquet")
    with pytest.raises(ValueError, match=r"split by file names <split>-NNNNN-of-NNNNN, but \['data/extra.parquet'\]"):
        splits(root)
    root = layout(tmp_path / "b", "train_test.parquet")
    with pytest.raises(ValueError, match=r"named for more than one split .*\['test', 'train'\]"):
        splits(root)


def test_a_split_is_chosen_only_by_name_or_when_it_is_the_only_one() -> None:
    assert choose_split("d", ["train"], None) == "train"
    assert choose_split("d", [None], None) is None
    assert choose_split("d", ["dev", "train"], "dev") == "dev"
    with pytest.raises(ValueError, match=r"d: holds the splits \['dev', 'train'\]; choose one with --split"):
        choose_split("d", ["dev", "train"], None)
    with pytest.raises(ValueError, match=r"expected one of \['train', 'validation'\], got 'dev' \(the hub's naming"):
        choose_split("d", ["train", "validation"], "dev")
    assert choose_split("d", [None], "train") is None  # the datasets library's name for a set without split names
    with pytest.raises(ValueError, match=r"'dev' asked for, but the data set has no split names"):
        choose_split("d", [None], "dev")
