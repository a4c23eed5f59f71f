"""The patch as the recipes' command line sees it, read from the library's scorer registry and nothing else.

``--scorer`` takes a registered scorer's name (or ``none``, the baseline); every option a scorer config declares is a
flag (:func:`scorer_flags`); which scorers have gates, and with which options, is asked of the configs
(``ScorerConfig.has_gates``). No scorer is named here: a scorer added to ``hf_neural_attn.scorers.SCORERS`` is a
recipe scorer with its flags, and the messages list it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
import warnings
from typing import Any

from hf_neural_attn.scorers import SCORERS as SCORER_REGISTRY

BASELINE = "none"  # --scorer none: the unpatched baseline
SCORERS = (BASELINE, *SCORER_REGISTRY)
DEFAULT_SCORER = next(iter(SCORER_REGISTRY))  # the first registered scorer
# Scorer options whose flag has another name: a bare --init would read as the model's own initialisation.
FLAG_FOR_OPTION = {"init": "scorer_init"}
# --gate_schedule: how the scorers' per-head gates alpha move during training (recipes.optimization.GateSchedule).
GATE_SCHEDULES = ("learned", "fixed", "warmup")
# The settings that make up the gate schedule; like the patch settings, a baseline run has none of them.
GATE_SETTINGS = ("gate_schedule", "gate_warmup_steps")


@dataclasses.dataclass(frozen=True)
class ScorerFlag:
    """One command-line flag for a scorer option, generated from the scorer configs' field declarations."""

    flag: str  # the flag's name without dashes (also its key in config files and in the run settings)
    option: str  # the option's name in the scorer config
    type: type
    choices: tuple | None
    help: str
    scorers: tuple[str, ...]  # the scorers that have this option
    # A setting of how the model runs, not part of the model (``impl``): not saved with it, and also taken by a
    # patched checkpoint loaded with --scorer none.
    runtime: bool = False


@functools.cache
def scorer_flags() -> dict[str, ScorerFlag]:
    """A flag for every option of every registered scorer, from each config's dataclass fields (help, choices,
    type). Options several scorers share are one flag; their help texts are joined when they differ."""
    declared: dict[str, list[tuple[str, dataclasses.Field, type]]] = {}
    for scorer, scorer_type in SCORER_REGISTRY.items():
        config_class = scorer_type.config_class
        hints = typing.get_type_hints(config_class)
        for item in config_class.option_fields():
            declared.setdefault(item.name, []).append((scorer, item, _value_type(hints[item.name])))
    flags = {}
    for option, declarations in declared.items():
        types = {value_type for _, _, value_type in declarations}
        if len(types) != 1:
            raise TypeError(f"Scorer option {option!r} is declared with different types {types}.")
        choices = [item.metadata.get("choices") for _, item, _ in declarations]
        union = None
        if all(choices):
            union = tuple(dict.fromkeys(value for values in choices for value in values))
        flag = FLAG_FOR_OPTION.get(option, option)
        flags[flag] = ScorerFlag(
            flag=flag,
            option=option,
            type=types.pop(),
            choices=union,
            help=_joined_help(declarations),
            scorers=tuple(scorer for scorer, _, _ in declarations),
            runtime=any(item.metadata.get("runtime") for _, item, _ in declarations),
        )
    return flags


def _joined_help(declarations: list[tuple[str, dataclasses.Field, type]]) -> str:
    """One option's help over the scorers that declare it: each distinct text once, with its defaults, prefixed by
    its scorers unless every scorer shares it."""
    by_help: dict[str, list[tuple[str, Any]]] = {}
    for scorer, item, _ in declarations:
        by_help.setdefault(item.metadata.get("help", ""), []).append((scorer, item.default))
    helps = []
    for text, entries in by_help.items():
        defaults = {repr(default) for _, default in entries}
        if len(defaults) == 1:
            default = f"default {entries[0][1]}"
        else:
            default = ", ".join(f"{scorer}: default {value}" for scorer, value in entries)
        every = len(entries) == len(SCORER_REGISTRY)
        helps.append(("" if every else f"{', '.join(s for s, _ in entries)}: ") + f"{text} ({default})")
    return " | ".join(helps)


def _value_type(annotation) -> type:
    """``int`` for ``int | None``, ``str`` for ``str``."""
    values = [value for value in typing.get_args(annotation) if value is not type(None)] or [annotation]
    return values[0]


def parse_bool(value: str) -> bool:
    """A true/false flag value (``--skip false``); argparse's ``type=bool`` would read any non-empty text as True."""
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def scorer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options for ``hf_neural_attn.patch_model`` that were given (the rest keep the library's defaults)."""
    return {
        spec.option: getattr(args, flag) for flag, spec in scorer_flags().items() if getattr(args, flag) is not None
    }


def runtime_options(args: argparse.Namespace) -> dict[str, Any]:
    """The run-time options that were given (``impl``): for ``hf_neural_attn.from_pretrained`` on a patched
    checkpoint, whose record does not save them."""
    given = scorer_options(args)
    return {
        spec.option: given[spec.option] for spec in scorer_flags().values() if spec.runtime and spec.option in given
    }


def patch_settings() -> tuple[str, ...]:
    """The run settings that shape the patch: the scorer, its layers and every scorer option's flag."""
    return ("scorer", "layers", *scorer_flags())


def scorer_has_gates(scorer: str, options: dict[str, Any]) -> bool | None:
    """Whether a scorer with these options has gates alpha (``ScorerConfig.has_gates``); None when the options do
    not make a config (``recipes.checks.validate_args`` reports those)."""
    try:
        with warnings.catch_warnings():  # validate_args has already shown the options' warnings once
            warnings.simplefilter("ignore")
            return SCORER_REGISTRY[scorer].config_class.from_options(dict(options)).has_gates
    except (ValueError, TypeError):
        return None


@functools.cache
def gated_scorers() -> dict[str, dict[str, Any]]:
    """Scorer -> the option values its gates need (empty where every config of it has gates), for every registered
    scorer that can have gates: each config is asked, at its defaults and at each declared choice of an option."""
    gated = {}
    for scorer, scorer_type in SCORER_REGISTRY.items():
        fields = scorer_type.config_class.option_fields()
        by_default = scorer_has_gates(scorer, {})
        changes = {
            (item.name, choice): scorer_has_gates(scorer, {item.name: choice})
            for item in fields
            for choice in item.metadata.get("choices") or ()
        }
        if by_default:
            # The default value of each option that has a choice taking the gates away.
            defaults = {item.name: item.default for item in fields}
            gated[scorer] = {option: defaults[option] for (option, _), gates in changes.items() if gates is False}
        elif any(changes.values()):
            gated[scorer] = dict(next(key for key, gates in changes.items() if gates))
    return gated


def describe_gated_scorers(as_flags: bool = False) -> str:
    """The gated scorers in words, scorers that need the same options grouped: ``qana, and neural/additive in mode
    residual``, or as flags ``--scorer qana, or neural/additive with --mode residual``."""
    groups: dict[tuple, list[str]] = {}
    for scorer, needs in gated_scorers().items():
        groups.setdefault(tuple(needs.items()), []).append(scorer)
    parts = []
    for needs, scorers in groups.items():
        if not needs:
            condition = ""
        elif as_flags:
            condition = " with " + " ".join(f"--{FLAG_FOR_OPTION.get(o, o)} {value}" for o, value in needs)
        else:
            condition = " in " + ", ".join(f"{option} {value}" for option, value in needs)
        parts.append("/".join(scorers) + condition)
    return "--scorer " + ", or ".join(parts) if as_flags else ", and ".join(parts)


def example_scorers() -> str:
    """Two registered scorers, for a message asking for a patch: ``qana or neural``."""
    return " or ".join(tuple(SCORER_REGISTRY)[:2])
