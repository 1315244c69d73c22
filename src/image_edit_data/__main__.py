"""The `image-edit-data` command: Lightning runs, cache tools and the demo cache."""

from __future__ import annotations

import sys

USAGE = """usage: image-edit-data COMMAND [options]

commands:
  fit | validate | test   train or evaluate with LightningCLI (--config configs/quickstart.yaml)
  cache build|validate|inspect   build a cache from raw image-edit data, check it, or show its buckets
  demo-cache OUT_DIR      write the procedural demo cache (no downloads, CPU only)
  bench CACHE_DIR         measure open time, index memory, samples/s and worker memory on your cache

Run `image-edit-data COMMAND --help` for the options of a command.
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the command named by the first argument; return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in ("fit", "validate", "test"):
        from .lightning.cli import lightning_main

        # From the shell LightningCLI reads sys.argv itself; passing it again would only earn a warning.
        lightning_main(None if argv is None else [command, *rest])
        return 0
    if command == "cache":
        from .cache.cli import cache_main

        return cache_main(rest)
    if command == "demo-cache":
        from .cache.cli import demo_cache_main

        return demo_cache_main(rest)
    if command == "bench":
        from .bench.command import bench_main

        return bench_main(rest)
    sys.stderr.write(f"image-edit-data: unknown command {command!r}\n\n{USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
