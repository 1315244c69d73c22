"""The `cache build` options that say where raw examples come from, and the source (or sources) they open.

One of: a JSONL manifest, a local Hugging Face data set (columns mapped by hand or by a preset), a
musubi-tuner dataset config, an ai-toolkit job config, a SimpleTuner multidatabackend.json, or DiffSynth-Studio
metadata. A trainer's config with several data sets opens as several `ConfigDataset`s, built one cache each
(`--dataset-index` picks one).
"""

from __future__ import annotations

from typing import Literal

from jsonargparse import ArgumentParser, Namespace

from ..sources.base import EditSource
from ..sources.manifest import JsonlManifestSource
from ..sources.paired import ConfigDataset

ROUTES = ("manifest", "dataset", "musubi_config", "ai_toolkit_config", "simpletuner_config", "diffsynth_metadata")
CONFIG_ROUTES = ("musubi_config", "ai_toolkit_config", "simpletuner_config")
OPTION = {route: "--" + route.replace("_", "-") for route in ROUTES}


def add_source_arguments(parser: ArgumentParser) -> None:
    """Where raw examples come from: give exactly one of the first six options of this group."""
    group = parser.add_argument_group(
        "source (give one of --manifest, --dataset, --musubi-config, --ai-toolkit-config, --simpletuner-config, "
        "--diffsynth-metadata)"
    )
    group.add_argument(
        "--manifest", type=str | None, default=None, help="JSONL manifest (NeMo generic image-edit form)."
    )
    group.add_argument("--dataset", type=str | None, default=None, help="save_to_disk directory or parquet file(s).")
    group.add_argument(
        "--musubi-config",
        type=str | None,
        default=None,
        help="musubi-tuner dataset config (TOML or JSON): one cache per dataset.",
    )
    group.add_argument(
        "--ai-toolkit-config",
        type=str | None,
        default=None,
        help="ai-toolkit job config (YAML or JSON): one cache per dataset.",
    )
    group.add_argument(
        "--simpletuner-config",
        type=str | None,
        default=None,
        help="SimpleTuner multidatabackend.json: one cache per image dataset, its conditioning_data the contexts.",
    )
    group.add_argument(
        "--diffsynth-metadata", type=str | None, default=None, help="DiffSynth-Studio metadata (.csv, .json, .jsonl)."
    )
    group.add_argument(
        "--base-path",
        type=str | None,
        default=None,
        help="DiffSynth's --dataset_base_path, the files' root (default: the metadata file's directory).",
    )
    group.add_argument(
        "--context-key",
        type=str,
        default="edit_image",
        help="DiffSynth key of the context image(s): edit_image, kontext_images.",
    )
    group.add_argument(
        "--dataset-index",
        type=int | None,
        default=None,
        help="Build only this data set of a trainer's config (0-based).",
    )
    group.add_argument(
        "--conditioning-multidataset-sampling",
        type=Literal["combined", "random"] | None,
        default=None,
        help="SimpleTuner's option of that name: combined takes all of a dataset's conditioning_data as contexts.",
    )
    group.add_argument(
        "--controls-per-sample",
        type=int | None,
        default=None,
        help="Refuse a trainer-config or DiffSynth example with another number of controls (1 for FLUX.1 Kontext).",
    )
    group.add_argument(
        "--hf-preset",
        type=Literal["magicbrush", "instructpix2pix", "ultraedit", "omniedit"] | None,
        default=None,
        help="With --dataset: that set's column mapping (replaces the column options below).",
    )
    group.add_argument(
        "--split",
        type=str | None,
        default=None,
        help="Split to read: required when the data set holds several (parquet folders split by the hub's naming).",
    )
    group.add_argument("--target-column", type=str, default="target_img", help="Target image column.")
    group.add_argument(
        "--context-columns", type=list[str], default=["source_img"], help="Context columns, e.g. '[a,b]'."
    )
    group.add_argument("--prompt-column", type=str, default="instruction", help="Instruction column.")
    group.add_argument("--id-column", type=str | None, default=None, help="Unique id column (default: row number).")
    group.add_argument("--metadata-columns", type=list[str], default=[], help="Columns kept as manifest_metadata.")
    group.add_argument(
        "--condition-columns", type=list[str], default=[], help="Condition image columns for prompt encoders."
    )
    group.add_argument(
        "--mask-column", type=str | None, default=None, help="Edit-mask image column (white = edited), e.g. mask_img."
    )
    group.add_argument("--hf-cache-dir", type=str | None, default=None, help="Where datasets converts parquet files.")


def open_sources(args: Namespace) -> EditSource | list[ConfigDataset]:
    """The source the options name, or the data sets of a trainer's config (one, with `--dataset-index`)."""
    given = [route for route in ROUTES if getattr(args, route) is not None]
    if len(given) != 1:
        named = ", ".join(OPTION[route] for route in given) or "none"
        raise ValueError(f"source: give exactly one of {', '.join(OPTION.values())}; got {named}")
    route = given[0]
    if args.hf_preset is not None and route != "dataset":
        raise ValueError(f"--hf-preset: maps the columns of a --dataset, not of {OPTION[route]}")
    if args.dataset_index is not None and route not in CONFIG_ROUTES:
        configs = ", ".join(OPTION[r] for r in CONFIG_ROUTES)
        raise ValueError(f"--dataset-index: picks a data set of {configs}, not {OPTION[route]}")
    if args.conditioning_multidataset_sampling is not None and route != "simpletuner_config":
        raise ValueError(f"--conditioning-multidataset-sampling: is for --simpletuner-config, not {OPTION[route]}")
    if args.controls_per_sample is not None and args.controls_per_sample < 1:
        raise ValueError(f"--controls-per-sample: expected a positive integer, got {args.controls_per_sample}")
    if route == "manifest":
        return JsonlManifestSource(args.manifest)
    if route == "dataset":
        return _hf_source(args)
    if route == "diffsynth_metadata":
        from ..sources.diffsynth import DiffSynthSource

        return DiffSynthSource(args.diffsynth_metadata, args.base_path, args.context_key, args.controls_per_sample)
    if route == "musubi_config":
        from ..sources.musubi import read_config

        datasets = read_config(args.musubi_config, args.controls_per_sample)
    elif route == "simpletuner_config":
        from ..sources.simpletuner import read_config as read_simpletuner

        sampling = args.conditioning_multidataset_sampling
        datasets = read_simpletuner(args.simpletuner_config, args.controls_per_sample, sampling)
    else:
        from ..sources.ai_toolkit import read_config as read_ai_toolkit

        datasets = read_ai_toolkit(args.ai_toolkit_config, args.controls_per_sample)
    if args.dataset_index is None:
        return datasets
    if not 0 <= args.dataset_index < len(datasets):
        raise ValueError(
            f"--dataset-index: expected 0 to {len(datasets) - 1} ({len(datasets)} data sets), got {args.dataset_index}"
        )
    return datasets[args.dataset_index].source


def _hf_source(args: Namespace) -> EditSource:
    """A local Hugging Face data set with the columns of `--hf-preset` or of the column options."""
    from ..sources.hf import HFDatasetSource

    if args.quiet:
        import datasets

        datasets.disable_progress_bars()
    if args.hf_preset is not None:
        from ..sources.hf_presets import preset_source

        return preset_source(args.hf_preset, args.dataset, split=args.split, hf_cache_dir=args.hf_cache_dir)
    return HFDatasetSource(
        args.dataset,
        target_column=args.target_column,
        context_columns=args.context_columns,
        prompt_column=args.prompt_column,
        id_column=args.id_column,
        split=args.split,
        metadata_columns=args.metadata_columns,
        hf_cache_dir=args.hf_cache_dir,
        condition_columns=args.condition_columns,
        mask_column=args.mask_column,
    )
