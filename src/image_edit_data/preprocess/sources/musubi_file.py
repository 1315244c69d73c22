"""musubi-tuner's dataset config file as musubi loads it (`dataset/config_utils.py`, `load_user_config`).

A `.toml` or `.json` file (the suffix decides, in any case; another suffix is refused, as musubi refuses
it). The keys musubi renamed are still read as its docs promise: in `[general]` and in each `[[datasets]]`
table, `flux_kontext_no_resize_control` and `qwen_image_edit_no_resize_control` become
`no_resize_control`, `qwen_image_edit_control_resolution` becomes `control_resolution`; an old key beside
its new one is dropped (musubi warns and ignores it). Renamed keys then meet musubi's schema like any
other, so in `[general]`, which takes neither new key, they are refused as musubi refuses them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tomllib

DEPRECATED = {
    "flux_kontext_no_resize_control": "no_resize_control",
    "qwen_image_edit_no_resize_control": "no_resize_control",
    "qwen_image_edit_control_resolution": "control_resolution",
}


def load(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The config as a dict with musubi's renames applied, and {new key: old key} for the keys renamed in [general]."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: musubi-tuner dataset config does not exist")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    elif suffix == ".toml":
        try:
            config = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{path}: not valid TOML ({error})") from None
    else:
        raise ValueError(f"{path}: musubi-tuner reads a dataset config from a .toml or .json file, not {suffix!r}")
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a table of [general] and [[datasets]], got {type(config).__name__}")
    general = config.get("general")
    renamed = _rename(general) if isinstance(general, dict) else {}
    datasets = config.get("datasets")
    for entry in datasets if isinstance(datasets, list) else []:
        if isinstance(entry, dict):
            _rename(entry)
    return config, renamed


def _rename(section: dict[str, Any]) -> dict[str, str]:
    """Rename the deprecated keys of one table in place; {new key: old key} for those renamed."""
    renamed = {}
    for old, new in DEPRECATED.items():
        if old in section:
            value = section.pop(old)
            if new not in section:
                section[new] = value
                renamed[new] = old
    return renamed
