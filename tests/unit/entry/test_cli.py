"""The command line: every shipped config parses, and the quickstart fits, checkpoints and resumes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import ROOT

from image_edit_data.__main__ import COMMANDS, main
from image_edit_data.preprocess.cli import cache_parser

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # One math thread: the other test worker has the other core (two threads each would thrash).
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "image_edit_data", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=600, env=env)


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
