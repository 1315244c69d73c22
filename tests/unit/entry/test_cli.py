"""The command line: every shipped config parses, and the quickstart fits, checkpoints and resumes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from support import ROOT

from image_edit_data.__main__ import COMMANDS, main
from image_edit_data.preprocess.cli import cache_parser

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_help_lists_every_command_and_every_cache_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.startswith("  ")]
    # What the dispatch accepts, and the subcommands the real `cache` parser accepts (from its usage line).
    commands = set(COMMANDS)
    subcommands = re.search(r"\{([^}]*)\}", cache_parser().format_usage())
    assert subcommands is not None and {"build", "convert", "pack"} <= set(subcommands[1].split(","))
    assert {"fit", "cache", "demo-cache", "bench"} <= commands
    assert commands <= {words[0] for words in lines}, out
    assert {f"cache {name}" for name in subcommands[1].split(",")} <= {" ".join(words[:2]) for words in lines}, out


def test_unknown_command_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_shipped_config_parses_against_the_real_cli(
    config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:  # --print_config prints the parsed config and exits
        main(["fit", "--config", str(config), "--print_config"])
    assert exited.value.code in (0, None), capsys.readouterr().err[-2000:]
    model_class = yaml.safe_load(config.read_text())["model"]["class_path"]
    assert f"class_path: {model_class}" in capsys.readouterr().out


def test_the_quickstart_writes_its_demo_caches_trains_checkpoints_and_resumes_from_its_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process (test_wheel.py runs the same command from the installed wheel, once, in a fresh venv)."""
    monkeypatch.chdir(tmp_path)  # the shipped config writes data/ and runs/ under the working directory
    small = [
        "--data.demo_samples", "64", "--data.batch_size", "8", "--data.num_workers", "0",
        "--model.init_args.hidden_dim", "32", "--model.init_args.depth", "1", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    assert main(["quickstart", *small, "--trainer.max_epochs", "1"]) == 0
    assert (tmp_path / "data" / "demo-train" / "metadata.json").is_file()
    last = tmp_path / "runs" / "quickstart" / "checkpoints" / "last.ckpt"
    first_steps = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    assert first_steps > 0
    assert main(["quickstart", *small, "--trainer.max_epochs", "2", "--ckpt_path", "last"]) == 0
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 2 * first_steps, "the second epoch ran after the first, from its checkpoint"
    assert checkpoint["state_dict"] and checkpoint["optimizer_states"]
