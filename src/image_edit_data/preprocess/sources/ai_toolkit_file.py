"""ai-toolkit's job config file as ai-toolkit loads it (ostris/ai-toolkit `toolkit/config.py`, `get_config`).

- The file is `.yaml`/`.yml` or `.json`/`.jsonc` (another suffix is refused, as ai-toolkit refuses it).
- Before parsing, every `${VAR}` in the text becomes the environment variable's value; an unset one is an
  error naming it, as in ai-toolkit.
- YAML is read with ai-toolkit's loader: a safe loader that also reads exponents without a dot (`1e-4`) as
  numbers.
- The job needs `job`, `config` and `config.name`; then every `[name]` in the config becomes `config.name`
  (ai-toolkit's `run.py --name` overrides that name; this route has no such option).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

ENV_PLACEHOLDER = re.compile(r"\$\{([^}]+)\}")
# ai-toolkit's float pattern: YAML 1.1's, plus exponents written without a dot.
FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class JobLoader(yaml.SafeLoader):
    """A safe loader with ai-toolkit's float resolver (added here, not to PyYAML's shared SafeLoader)."""


JobLoader.add_implicit_resolver("tag:yaml.org,2002:float", FLOAT, list("-+0123456789."))


def load(path: Path) -> dict[str, Any]:
    """The job config with `${VAR}` and `[name]` substituted, as ai-toolkit hands it to its job."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: ai-toolkit config does not exist")
    suffix = path.suffix
    if suffix not in (".yaml", ".yml", ".json", ".jsonc"):
        raise ValueError(
            f"{path}: ai-toolkit reads a job config from a .yaml, .yml, .json or .jsonc file, not {suffix!r}"
        )

    def environment(match: re.Match[str]) -> str:
        value = os.environ.get(match.group(1))
        if value is None:
            raise ValueError(f"{path}: ${{{match.group(1)}}}: environment variable {match.group(1)} is not set")
        return value

    text = ENV_PLACEHOLDER.sub(environment, path.read_text(encoding="utf-8"))
    try:
        job = (
            json.loads(text) if suffix in (".json", ".jsonc") else yaml.load(text, Loader=JobLoader)
        )  # JobLoader is a SafeLoader
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: not valid {'JSON' if suffix.startswith('.json') else 'YAML'} ({error})") from None
    if not isinstance(job, dict) or "job" not in job:
        raise ValueError(f"{path}: an ai-toolkit config needs a job key (e.g. job: extension)")
    config = job.get("config")
    if not isinstance(config, dict):
        raise ValueError(f"{path}: an ai-toolkit config needs a config section")
    name = config.get("name")
    if not isinstance(name, str):
        raise ValueError(f"{path}: config.name: ai-toolkit needs a name (it replaces [name]), got {name!r}")
    try:
        dumped = json.dumps(job)
    except TypeError as error:  # ai-toolkit substitutes through JSON too, and fails the same way
        raise ValueError(f"{path}: a value ai-toolkit cannot pass through JSON for [name] ({error})") from None
    try:
        substituted: dict[str, Any] = json.loads(dumped.replace("[name]", name))
    except json.JSONDecodeError:
        raise ValueError(
            f"{path}: config.name {name!r} cannot stand in for [name] (ai-toolkit would fail too)"
        ) from None
    return substituted
