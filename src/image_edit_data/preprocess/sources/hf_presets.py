"""Named column mappings of public Hugging Face edit sets, as their data set cards name the columns.

- `magicbrush` (osunlp/MagicBrush): target `target_img`, context `source_img`, prompt `instruction`, mask
  `mask_img` (an RGBA masked image: edited where transparent), metadata `img_id`, `turn_index`.
- `instructpix2pix` (timbrooks/instructpix2pix-clip-filtered): target `edited_image`, context `original_image`,
  prompt `edit_prompt`, metadata `original_prompt`, `edited_prompt`.
- `ultraedit` (BleachNick/UltraEdit and its subsets): target `edited_image`, context `source_image`, prompt
  `edit_prompt` (the columns UltraEdit's own training script reads), mask `mask_image` where present (white =
  edited; an empty cell: edited everywhere), metadata `source_caption`, `target_caption`.
- `omniedit` (TIGER-Lab/OmniEdit-Filtered-1.2M): target `edited_img`, context `src_img`, prompt the first of
  `edited_prompt_list`, id `omni_edit_id`, metadata `task` and the scores.

The sample id is the row number, except OmniEdit's `omni_edit_id` (MagicBrush's `img_id` repeats over
an image's turns). A mask column a set has only in some versions (UltraEdit's region-based subsets) and
the metadata columns are used when present; the target, context and prompt columns must be there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .hf import HFDatasetSource
from .masks import MaskForm

PresetName = Literal["magicbrush", "instructpix2pix", "ultraedit", "omniedit"]


@dataclass(frozen=True)
class Preset:
    """The columns of one public edit set."""

    target: str
    context: str
    prompt: str
    metadata: tuple[str, ...]
    mask: str | None = None
    id_column: str | None = None
    prompt_item: int | None = None
    mask_form: MaskForm = "grey"


PRESETS: dict[str, Preset] = {
    "magicbrush": Preset(
        "target_img", "source_img", "instruction", ("img_id", "turn_index"), mask="mask_img", mask_form="magicbrush"
    ),
    "instructpix2pix": Preset("edited_image", "original_image", "edit_prompt", ("original_prompt", "edited_prompt")),
    "ultraedit": Preset(
        "edited_image",
        "source_image",
        "edit_prompt",
        ("source_caption", "target_caption"),
        mask="mask_image",
        mask_form="ultraedit",
    ),
    "omniedit": Preset(
        "edited_img",
        "src_img",
        "edited_prompt_list",
        ("task", "sc_score_1", "sc_score_2", "pq_score", "o_score"),
        id_column="omni_edit_id",
        prompt_item=0,
    ),
}
# Columns a preset reads when the set has them: MagicBrush's card has its mask, UltraEdit's free-form rows do not.
OPTIONAL_MASK = {"ultraedit"}


def preset_source(
    name: str, path: str | Path, split: str | None = None, hf_cache_dir: str | None = None
) -> HFDatasetSource:
    """A local copy of the set `name` (parquet files or a save_to_disk directory) read with its preset columns."""
    if name not in PRESETS:
        raise ValueError(f"hf preset: expected one of {sorted(PRESETS)}, got {name!r}")
    preset = PRESETS[name]
    optional = list(preset.metadata) + ([preset.mask] if preset.mask and name in OPTIONAL_MASK else [])
    return HFDatasetSource(
        path,
        target_column=preset.target,
        context_columns=[preset.context],
        prompt_column=preset.prompt,
        id_column=preset.id_column,
        split=split,
        metadata_columns=preset.metadata,
        hf_cache_dir=hf_cache_dir,
        mask_column=preset.mask,
        prompt_item=preset.prompt_item,
        optional_columns=optional,
        preset=name,
        mask_form=preset.mask_form,
    )
