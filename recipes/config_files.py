"""Config files: a YAML or JSON mapping of flag names to values that stands in for the command line.

``--config file.yaml`` (or the file as the first argument, as the Hugging Face scripts accept); its keys are the
flag names without dashes, and flags given on the command line override the file. The values are checked against
the parser's declarations (``parser.recipe_flags``, :func:`recipes.args.build_parser`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from recipes.errors import RecipeError

CONFIG_EXTENSIONS = (".yaml", ".yml", ".json")


def config_path(argv: list[str]) -> str | None:
    """``--config FILE`` anywhere, or a config file as the first argument (removed from ``argv``)."""
    if argv and not argv[0].startswith("-") and argv[0].lower().endswith(CONFIG_EXTENSIONS):
        return argv.pop(0)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=str, default=None)
    known, _ = pre.parse_known_args(argv)
    return known.config


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise RecipeError(f"Config file {path} does not exist.")
    text = Path(path).read_text()
    try:
        if path.lower().endswith(".json"):
            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
    except Exception as error:
        raise RecipeError(f"Could not parse config file {path}: {error}") from error
    if not isinstance(values, dict):
        raise RecipeError(
            f"Config file {path} must hold a mapping of flag names to values, got {type(values).__name__}."
        )
    return check_config_values(values, parser, f"Config file {path}")


def check_config_values(values: dict[str, Any], parser: argparse.ArgumentParser, source: str) -> dict[str, Any]:
    """Flag names as keys (dashes allowed): unknown ones are an error naming ``source``. Returns the values
    under their flag names, without ``config``."""
    known = set(parser.recipe_flags)
    values = {str(key).lstrip("-").replace("-", "_"): value for key, value in values.items()}
    unknown = sorted(set(values) - known - {"config"})
    if unknown:
        raise RecipeError(f"{source} has unknown key(s) {unknown}. Keys are flag names, e.g. learning_rate.")
    values.pop("config", None)
    for key, value in values.items():
        # argparse would convert a string default with the flag's type itself, and on failure print its usage and
        # exit: say which key of which file instead.
        kind = parser.recipe_flags[key].get("type") if key in parser.recipe_flags else None
        if kind in (int, float) and isinstance(value, str):
            try:
                kind(value)
            except ValueError:
                noun = "an integer" if kind is int else "a number"
                raise RecipeError(f"{source} {key} must be {noun}, got {value!r}.") from None
    return values
