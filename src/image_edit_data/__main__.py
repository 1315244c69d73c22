"""The `image-edit-data` command: Lightning runs, cache tools and the demo cache."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import as_file, files


def _lightning(command: str, rest: list[str], from_shell: bool) -> int:
    from .lightning.cli import lightning_main

    # From the shell LightningCLI reads sys.argv itself; passing it again would only earn a warning.
    lightning_main(None if from_shell else [command, *rest])
    return 0


def _quickstart(command: str, rest: list[str], from_shell: bool) -> int:
    from .lightning.cli import lightning_main

    with as_file(files(__package__) / "configs" / "quickstart.yaml") as config, warnings.catch_warnings():
        # Our arguments differ from sys.argv's on purpose; Lightning warns of giving both.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        lightning_main(["fit", "--config", str(config), *rest])
    return 0


def _cache(command: str, rest: list[str], from_shell: bool) -> int:
    from .preprocess.cli import cache_main

    return cache_main(rest)


def _demo_cache(command: str, rest: list[str], from_shell: bool) -> int:
    from .preprocess.cli import demo_cache_main

    return demo_cache_main(rest)


def _bench(command: str, rest: list[str], from_shell: bool) -> int:
    from .bench.command import bench_main

    return bench_main(rest)


def _export_lora(command: str, rest: list[str], from_shell: bool) -> int:
    from .models.lora_export import export_lora_main

    return export_lora_main(rest)


@dataclass(frozen=True)
class Command:
    """One top-level command: what the usage shows after its name, its summary, and what runs it."""

    arguments: str
    summary: str
    run: Callable[[str, list[str], bool], int]


# The one list of commands: the dispatch and the usage both read it (`cache` lists its own subcommands).
COMMANDS: dict[str, Command] = {
    "quickstart": Command(
        "[FIT OPTIONS]", "the main job: the demo cache, then `fit` with the config shipped in the package", _quickstart
    ),
    "fit": Command("--config FILE", "train with LightningCLI (e.g. --config configs/quickstart.yaml)", _lightning),
    "validate": Command("--config FILE", "evaluate on the validation set with LightningCLI", _lightning),
    "test": Command("--config FILE", "evaluate on the test set with LightningCLI", _lightning),
    "cache": Command("SUBCOMMAND", "build, check and rewrite caches:", _cache),
    "demo-cache": Command("OUT_DIR", "write the procedural demo cache (no downloads, CPU only)", _demo_cache),
    "bench": Command("CACHE_DIR", "measure open time, index memory, samples/s and worker memory on your cache", _bench),
    "export-lora": Command("CKPT OUT_DIR", "write a LoRA run's adapter for diffusers' load_lora_weights", _export_lora),
}


def usage() -> str:
    """The top-level help: every command of `COMMANDS`, and every `cache` subcommand."""
    from .preprocess.cli import CACHE_COMMANDS

    lines = ["usage: image-edit-data COMMAND [options]", "", "commands:"]
    for name, command in COMMANDS.items():
        lines.append(f"  {f'{name} {command.arguments}':<28} {command.summary}")
        if name == "cache":
            lines += [f"    {f'cache {sub}':<26} {entry.help}" for sub, entry in CACHE_COMMANDS.items()]
    lines += ["", "Run `image-edit-data COMMAND --help` for the options of a command.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the command named by the first argument; return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"image-edit-data: unknown command {name!r}\n\n{usage()}")
        return 2
    return COMMANDS[name].run(name, rest, argv is None)


if __name__ == "__main__":
    sys.exit(main())
