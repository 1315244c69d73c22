"""Imports go one way: no module imports from a layer above its own (the order is CONTRIBUTING.md's)."""

from __future__ import annotations

import ast
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "src" / "image_edit_data"
# Bottom to top; a module may import from its own layer and those below it.
LAYERS: list[set[str]] = [
    {"errors", "_atomic", "_process", "_moved", "_retry"},
    {"contract"},
    {"index", "payload"},
    {"storage"},
    {"sampling"},
    {"batch"},
    {"workers"},
    {
        "dataset",
        "mixture_dataset",
        "dataloader_config",
        "__init__",
    },  # importing the package root gives the data path's public names
    {"preprocess"},
    {"lightning"},
    {"bench", "models"},
    {"__main__"},
]
LAYER_OF = {part: number for number, parts in enumerate(LAYERS) for part in parts}


def part_of(relative: tuple[str, ...]) -> str:
    """The top-level room of a module path inside the package: a subpackage, or a root module's name."""
    return relative[0] if len(relative) > 1 else relative[0].removesuffix(".py")


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node that runs, i.e. all but the bodies of `if TYPE_CHECKING:` (annotations only)."""
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for statement in node.body
        for child in ast.walk(statement)
    }
    return [node for node in ast.walk(tree) if id(node) not in skipped]


def imported_parts(path: Path, package_root: Path = PACKAGE) -> set[str]:
    """The rooms of the package that a module imports from, function-level imports included."""
    relative = path.relative_to(package_root).parts
    package = list(relative[:-1])
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = [*base, *(node.module.split(".") if node.module else [])]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "image_edit_data":
            target = node.module.split(".")[1:]  # type: ignore[union-attr]
        elif isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names if alias.name.split(".")[0] == "image_edit_data"]
            found |= {name[1] if len(name) > 1 else "__init__" for name in names}
            continue
        else:
            continue
        found.add(target[0] if target else "__init__")
    return found


def test_every_room_of_the_package_has_a_layer() -> None:
    rooms = {part_of(path.relative_to(PACKAGE).parts) for path in PACKAGE.rglob("*.py")}
    assert rooms - {"py.typed"} == set(LAYER_OF), "add new rooms to LAYERS here and to CONTRIBUTING.md"


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = part_of(path.relative_to(PACKAGE).parts)
        for theirs in imported_parts(path):
            if LAYER_OF[theirs] > LAYER_OF[mine]:
                upward.append(f"{path.relative_to(PACKAGE)} ({mine}) imports {theirs}")
    assert not upward, "imports that climb a layer:\n" + "\n".join(upward)


def test_the_check_sees_upward_imports_at_any_depth_but_not_annotation_only_ones(tmp_path: Path) -> None:
    module = tmp_path / "index" / "deep" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ...contract import paths\n"
        "if TYPE_CHECKING:\n"
        "    from ...bench import command\n"
        "def later():\n"
        "    from ...lightning.datamodule import ImageEditDataModule\n"
        "    import image_edit_data.preprocess.cli\n"
    )
    assert imported_parts(module, tmp_path) == {"contract", "lightning", "preprocess"}


def test_the_model_libraries_are_imported_only_by_the_models_and_the_encoders() -> None:
    allowed = {
        "peft": ("models",),
        "diffusers": ("models", "preprocess/encoders"),
        "transformers": ("preprocess",),
        "ray": ("preprocess/run/ray_engine.py",),
    }
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for node in runtime_nodes(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            for name in names:
                library = name.split(".")[0]
                if library in allowed and not relative.startswith(allowed[library]):
                    found.append(f"{relative} imports {name}")
    assert not found, "\n".join(found)
