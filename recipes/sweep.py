#!/usr/bin/env python
"""A sweep of recipe runs from one config file: ablations or a grid, over seeds, against the baseline, resumable.

Run from the repository root, as a module:

    python -m recipes.sweep --config recipes/sweeps/qana_ablations.yaml --grid reduced
    accelerate launch -m recipes.sweep --config recipes/sweeps/qana_ablations.yaml \\
        --model_name_or_path gpt2 --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1
    python -m recipes.sweep --config recipes/sweeps/qana_ablations.yaml --report_only   # tables and plots only
    python -m recipes.sweep --config recipes/sweeps/qana_ablations.yaml --dry_run       # the plan, nothing run

The config (YAML or JSON) holds

* ``base``: recipe flags every run shares, the keys of the recipe config files (``recipes/configs/*.yaml``);
  ``output_dir`` there is the sweep's folder (default ``outputs/sweep-<config name>[-reduced]``);
* ``axes``: axis name -> list of values. A value is a scalar for the flag of the axis's name (``h: [1, 2, 4]``;
  ``null`` leaves the flag unset), or a mapping of several flags with an optional ``label``
  (``layers_and_proj: [{layers: "0", proj_dim: 2, label: first}, ...]``);
* ``mode``: ``ablation`` (default; one axis at a time away from ``base``, the papers' style; the base point runs
  once, also where an axis value equals it) or ``grid`` (every combination of the axes);
* ``seeds``: N (seeds ``seed``, ``seed+1``, ... from base's ``--seed``, default 42) or a list of seeds;
* ``baseline``: true to also run, per seed, the unpatched model (``--scorer none``) with the same data and
  budget, so that each configuration is compared seed by seed (paired) with its baseline;
* ``description``: free text for ``SUMMARY.md``;
* ``reduced``: any of the above (except ``reduced``), used instead with ``--grid reduced``: ``base`` keys are
  merged into ``base``; ``axes`` replaces the listed axes' values (``null`` drops an axis), the others stay;
  ``seeds: N`` where the full grid lists seeds takes the first N of them.

Flags after ``--config`` on the command line override ``base`` for every run (giving a model or data source
replaces the config's: ``--model_name_or_path`` drops ``model_type``/``config_name``/``config_overrides``,
``--dataset_name``/``--train_file`` drop the config's data flags); a flag an axis sweeps cannot be given there.
The whole plan -- every run's flags, through the recipes' own argument checks, and every run folder already
there -- is checked before the first run starts.

Each run is ``recipes.finetune.run`` into ``<output_dir>/<run name>/seed_<s>/`` (run names: ``base``,
``<axis>=<label>``, in a grid ``<axis>=<label>__<axis>=<label>``; baselines ``baseline[__<axis>=<label>]``), with
``--checkpointing_steps`` (default: a quarter of ``--max_train_steps``), ``--checkpoints_total_limit 1`` and
``--resume_from_checkpoint latest``. Rerunning the same command skips finished runs (``all_results.json`` there,
its settings those of the plan), resumes an interrupted one from its newest checkpoint, and refuses a folder
whose recorded settings differ. At the end (or with ``--report_only``) it writes ``sweep.md``, ``sweep.csv``,
``sweep_summary.csv``, ``sweep_<axis>.png`` and ``SUMMARY.md`` (see ``docs/recipes.md``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import itertools
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recipes import checkpointing, finetune, report, stats
from recipes.args import (
    CONFIG_EXTENSIONS,
    GATE_SETTINGS,
    RecipeError,
    build_parser,
    check_config_values,
    given_flags,
    parse_values,
    patch_settings,
)
from recipes.tasks import get_task

logger = logging.getLogger("recipes")

SWEEP_KEYS = ("description", "base", "axes", "mode", "seeds", "baseline", "reduced")
MODES = ("ablation", "grid")
GRIDS = ("full", "reduced")
BASE_LABEL = "(base)"  # an ablation plot's point for the base configuration, where no value of the axis is it
RUN_RECORD = "sweep_run.json"  # in each run folder: what the sweep started there (settings, configuration, seed)
SWEEP_TABLE, SWEEP_CSV, SUMMARY_CSV, SUMMARY_FILE = "sweep.md", "sweep.csv", "sweep_summary.csv", "SUMMARY.md"
# Flags the sweep sets for every run itself, and flags a sweep cannot use (every run would push to one repository).
MANAGED_FLAGS = ("seed", "output_dir", "resume_from_checkpoint")
REFUSED_FLAGS = ("push_to_hub", "hub_model_id", "hub_token", "hub_private_repo")
# Settings that do not change a run's result: a finished run is the same run whatever they were.
IGNORED_SETTINGS = frozenset(
    {
        "output_dir",
        "config",
        "resume_from_checkpoint",
        "checkpointing_steps",
        "checkpoints_total_limit",
        "preprocessing_num_workers",
        "overwrite_cache",
        "with_tracking",
        "report_to",
        "push_to_hub",
        "hub_model_id",
        "hub_token",
        "hub_private_repo",
        "attention_map_layer",
        "attention_map_tokens",
    }
)
# A model or data source given on the command line replaces the config's (they exclude each other).
MODEL_SOURCE_FLAGS = ("model_name_or_path", "config_name", "model_type")
DATA_SOURCE_FLAGS = ("dataset_name", "train_file", "train_dir")
DATA_FLAGS = (*DATA_SOURCE_FLAGS, "dataset_config_name", "validation_file", "validation_dir", "eval_split")


# --------------------------------------------------------------------------------------------- the plan


@dataclass
class AxisValue:
    """One value of one axis: the flags it sets, and its label in run names, tables and plots."""

    axis: str
    label: str
    flags: dict[str, Any]


@dataclass
class Run:
    """One seed of one configuration."""

    configuration: str
    seed: int
    output_dir: Path
    args: argparse.Namespace
    key: dict[str, Any]  # the settings a run already in output_dir must have been started with
    status: str = "pending"  # pending, done, interrupted


@dataclass
class Configuration:
    """A set of flags run over every seed: a point of the sweep, or a baseline."""

    name: str
    kind: str  # "configuration" or "baseline"
    choices: tuple[AxisValue, ...]  # the axis values that define it (none: the base point)
    flags: dict[str, Any]
    baseline: str | None = None  # the name of its paired baseline
    runs: list[Run] = field(default_factory=list)

    def changed(self) -> str:
        """The flags its axis values set, ``h=1, layers=0``; ``scorer=none`` for a baseline."""
        if self.kind == "baseline":
            extra = ", ".join(f"{key}={format_label(value)}" for c in self.choices for key, value in c.flags.items())
            return "scorer=none" + (f", {extra}" if extra else "")
        if not self.choices:
            return "— (base)"
        return ", ".join(f"{key}={format_label(value)}" for c in self.choices for key, value in c.flags.items())


@dataclass
class SweepPlan:
    config_path: Path
    grid: str
    mode: str
    description: str
    seeds: list[int]
    baseline: bool
    root: Path
    axes: dict[str, list[AxisValue]]
    configurations: list[Configuration]  # baselines first
    cells: list[tuple[tuple[AxisValue, ...], str]]  # each planned point (axis values) -> its configuration's name
    base_flags: dict[str, Any]
    command_line: list[str]

    def by_name(self, name: str) -> Configuration:
        return next(c for c in self.configurations if c.name == name)

    def runs(self) -> list[Run]:
        """Every run, seed by seed (each seed's baselines first): after the first seed the sweep has a whole
        picture, however far it gets."""
        return [c.runs[index] for index in range(len(self.seeds)) for c in self.configurations]


def format_label(value: Any) -> str:
    """A flag value as it reads in run names and tables: ``null``, ``true``, ``0.001``, ``0,1``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(format_label(item) for item in value)
    return str(value)


def safe_name(name: str) -> str:
    """A run name usable as a folder name everywhere: other characters become '-'."""
    return re.sub(r"[^A-Za-z0-9._=,+-]", "-", name)


def read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RecipeError(f"Sweep config {path} does not exist.")
    try:
        if path.suffix.lower() == ".json":
            values = json.loads(path.read_text())
        else:
            import yaml

            values = yaml.safe_load(path.read_text())
    except Exception as error:  # any parse error is the config's fault: say which file
        raise RecipeError(f"Could not parse sweep config {path}: {error}") from error
    if not isinstance(values, dict):
        raise RecipeError(f"Sweep config {path} must be a mapping with base:, axes:, ...; got {type(values).__name__}.")
    unknown = sorted(set(values) - set(SWEEP_KEYS))
    if unknown:
        raise RecipeError(f"Sweep config {path} has unknown key(s) {unknown}; its keys are {list(SWEEP_KEYS)}.")
    return values


def select_grid(values: dict[str, Any], grid: str, path: Path) -> dict[str, Any]:
    """The config for ``--grid full`` (as written) or ``--grid reduced`` (its ``reduced:`` section applied)."""
    if grid not in GRIDS:
        raise RecipeError(f"--grid must be one of {list(GRIDS)}, got {grid!r}.")
    selected = {key: value for key, value in values.items() if key != "reduced"}
    if grid == "full":
        return selected
    reduced = values.get("reduced")
    if not isinstance(reduced, dict):
        raise RecipeError(f"--grid reduced: sweep config {path} has no reduced: section (a mapping).")
    unknown = sorted(set(reduced) - set(SWEEP_KEYS) | ({"reduced"} & set(reduced)))
    if unknown:
        raise RecipeError(f"Sweep config {path}: reduced: has unknown key(s) {unknown}.")
    for key, value in reduced.items():
        if key == "base":
            if not isinstance(value, dict):
                raise RecipeError(f"Sweep config {path}: reduced.base must be a mapping of flags.")
            selected["base"] = {**(values.get("base") or {}), **value}
        elif key == "axes":
            if not isinstance(value, dict):
                raise RecipeError(f"Sweep config {path}: reduced.axes must map axis names to lists (or null).")
            axes = dict(values.get("axes") or {})
            for axis, axis_values in value.items():
                if axis not in axes:
                    raise RecipeError(
                        f"Sweep config {path}: reduced.axes names {axis!r}, which axes: does not have ({sorted(axes)})."
                    )
                if axis_values is None:
                    del axes[axis]
                else:
                    axes[axis] = axis_values
            selected["axes"] = axes
        elif key == "seeds" and isinstance(values.get("seeds"), list) and type(value) is int and value >= 1:
            selected["seeds"] = values["seeds"][:value]  # a count of a list of seeds: its first ones
        else:
            selected[key] = value
    return selected


def parse_axes(axes: Any, recipe_flags: set[str], path: Path) -> dict[str, list[AxisValue]]:
    """Each axis's values as AxisValue: a scalar sets the axis's flag, a mapping sets its flags (+ ``label``)."""
    if axes is None:
        return {}
    if not isinstance(axes, dict):
        raise RecipeError(f"Sweep config {path}: axes must map axis names to lists of values.")
    parsed: dict[str, list[AxisValue]] = {}
    for axis, values in axes.items():
        where = f"sweep config {path}, axis {axis!r}"
        if not isinstance(values, list) or not values:
            raise RecipeError(f"In {where}: give a non-empty list of values, got {values!r}.")
        items = []
        for value in values:
            if isinstance(value, dict):
                flags = {str(k).lstrip("-").replace("-", "_"): v for k, v in value.items() if k != "label"}
                if not flags:
                    raise RecipeError(f"In {where}: the value {value!r} sets no flag.")
                label = value.get("label")
                label = (
                    format_label(label)
                    if label is not None
                    else ",".join(f"{k}={format_label(v)}" for k, v in flags.items())
                )
            elif isinstance(value, list):
                raise RecipeError(f"In {where}: a value is a scalar or a mapping of flags, got the list {value!r}.")
            else:
                if axis not in recipe_flags:
                    raise RecipeError(
                        f"In {where}: {axis!r} is not a recipe flag, so its values must be mappings of flags "
                        f"(e.g. {{layers: '0', proj_dim: 2, label: first}}), got {value!r}."
                    )
                flags, label = {axis: value}, format_label(value)
            unknown = sorted(set(flags) - recipe_flags)
            if unknown:
                raise RecipeError(f"In {where}: unknown flag(s) {unknown}; see python -m recipes.finetune --help.")
            managed = sorted(set(flags) & set(MANAGED_FLAGS + REFUSED_FLAGS))
            if managed:
                raise RecipeError(f"In {where}: {managed} cannot be swept (the sweep sets seed and folders itself).")
            items.append(AxisValue(axis, label, flags))
        labels = [item.label for item in items]
        if len(set(labels)) != len(labels):
            raise RecipeError(f"In {where}: two values have the same label ({labels}); give each a distinct label.")
        parsed[axis] = items
    return parsed


def merge_command_line(base: dict[str, Any], command_line: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the command line's flags on top; a model or data source there replaces the config's."""
    merged = dict(base)
    if any(flag in command_line for flag in MODEL_SOURCE_FLAGS):
        for flag in MODEL_SOURCE_FLAGS:
            merged.pop(flag, None)
        if "model_name_or_path" in command_line:
            merged.pop("config_overrides", None)
    if any(flag in command_line for flag in DATA_SOURCE_FLAGS):
        for flag in DATA_FLAGS:
            merged.pop(flag, None)
    merged.update(command_line)
    return merged


def comparable(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings that decide a run's result, as JSON would hold them."""
    kept = {key: value for key, value in settings.items() if key not in IGNORED_SETTINGS}
    return json.loads(json.dumps(kept, default=str))


def differences(saved: dict[str, Any], planned: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Settings that differ; a setting the saved run did not know counts as equal if the plan leaves it unset."""
    different = {}
    for key in sorted(set(saved) | set(planned)):
        if key not in saved and planned.get(key) is None:
            continue
        if saved.get(key) != planned.get(key):
            different[key] = (saved.get(key), planned.get(key))
    return different


def patch_only_flags() -> set[str]:
    """The flags a baseline drops (as ``recipes.compare.baseline_args`` does): the patch's and its training's."""
    return {*patch_settings(), *GATE_SETTINGS, "scorer_learning_rate", "train_only_new_params"}


def baseline_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """A configuration's baseline: the same flags unpatched, ``--scorer none``."""
    base = {key: value for key, value in flags.items() if key not in patch_only_flags()}
    base["scorer"] = "none"
    return base


def run_defaults(flags: dict[str, Any]) -> dict[str, Any]:
    """Checkpointing for sweep runs, so that a killed run resumes: every quarter of the budget, newest kept."""
    flags = dict(flags)
    if flags.get("checkpointing_steps") is None:
        steps = flags.get("max_train_steps")
        flags["checkpointing_steps"] = str(max(1, int(steps) // 4)) if steps else "epoch"
    flags.setdefault("checkpoints_total_limit", 1)
    return flags


def build_plan(config_path: str | os.PathLike, grid: str = "full", argv: list[str] | None = None) -> SweepPlan:
    """Read and check the sweep config and every run it implies; nothing is run or written."""
    path = Path(config_path)
    values = select_grid(read_config(path), grid, path)
    parser = build_parser()
    recipe_flags = set(parser.recipe_flags) - {"config"}
    mode = values.get("mode", "ablation")
    if mode not in MODES:
        raise RecipeError(f"Sweep config {path}: mode must be one of {list(MODES)}, got {mode!r}.")
    baseline = values.get("baseline", False)
    if not isinstance(baseline, bool):
        raise RecipeError(f"Sweep config {path}: baseline must be true or false, got {baseline!r}.")
    description = values.get("description") or ""
    if not isinstance(description, str):
        raise RecipeError(f"Sweep config {path}: description must be text.")
    base = values.get("base") or {}
    if not isinstance(base, dict):
        raise RecipeError(f"Sweep config {path}: base must be a mapping of recipe flags.")
    base = check_config_values(base, parser, f"Sweep config {path}, base:,")
    for flag in sorted(set(base) & set(REFUSED_FLAGS + ("resume_from_checkpoint",))):
        raise RecipeError(f"Sweep config {path}, base: {flag} cannot be set in a sweep (each run is managed by it).")
    axes = parse_axes(values.get("axes"), recipe_flags, path)

    command_line = given_flags(list(argv or []))
    for flag in sorted(set(command_line) & set(REFUSED_FLAGS + ("resume_from_checkpoint",))):
        raise RecipeError(f"--{flag} cannot be given to a sweep (it resumes its runs itself and does not upload).")
    swept = {flag: axis for axis, items in axes.items() for item in items for flag in item.flags}
    clashes = sorted(set(command_line) & set(swept))
    if clashes:
        raise RecipeError(
            f"The command line sets {['--' + flag for flag in clashes]}, which the sweep varies (axes "
            f"{sorted({swept[flag] for flag in clashes})}); drop them there or drop the axis."
        )
    shared = merge_command_line(base, command_line)
    root_value = shared.pop("output_dir", None)
    root = (
        Path(root_value)
        if root_value
        else Path("outputs") / f"sweep-{path.stem}{'-reduced' if grid == 'reduced' else ''}"
    )

    seeds_value = values.get("seeds", 1)
    first_seed = shared.pop("seed", 42)
    if isinstance(seeds_value, bool) or not isinstance(seeds_value, (int, list)):
        raise RecipeError(f"Sweep config {path}: seeds must be a count or a list of seeds, got {seeds_value!r}.")
    if isinstance(seeds_value, int):
        if seeds_value < 1:
            raise RecipeError(f"Sweep config {path}: seeds must be at least 1, got {seeds_value}.")
        if isinstance(first_seed, bool) or not isinstance(first_seed, int):
            raise RecipeError(f"Sweep config {path}: seed must be an integer, got {first_seed!r}.")
        seeds = [first_seed + offset for offset in range(seeds_value)]
    else:
        if "seed" in command_line:
            raise RecipeError(f"--seed: sweep config {path} lists its seeds ({seeds_value}); edit the list instead.")
        seeds = seeds_value
        if (
            not seeds
            or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds)
            or len(set(seeds)) != len(seeds)
        ):
            raise RecipeError(f"Sweep config {path}: seeds must be distinct integers, got {seeds!r}.")

    # The points of the sweep, each as the axis values that define it.
    if mode == "ablation":
        points: list[tuple[AxisValue, ...]] = [()]
        points += [(item,) for items in axes.values() for item in items]
    else:
        points = list(itertools.product(*axes.values())) if axes else [()]

    configurations: list[Configuration] = []
    baselines: list[Configuration] = []
    by_settings: dict[str, str] = {}
    cells: list[tuple[tuple[AxisValue, ...], str]] = []
    tasks = set()

    def settings_key(args: argparse.Namespace) -> str:
        settings = comparable(finetune.public_settings(args))
        settings.pop("seed", None)
        return json.dumps(settings, sort_keys=True)

    def parse(flags: dict[str, Any], name: str) -> argparse.Namespace:
        try:
            return parse_values({**run_defaults(flags), "seed": seeds[0]}, source=f"Run {name!r} of {path}")
        except RecipeError as error:
            raise RecipeError(f"Run {name!r} of sweep {path}: {error}") from error
        except SystemExit as error:  # argparse's own exit on a bad value
            raise RecipeError(f"Run {name!r} of sweep {path}: invalid flag values {flags}") from error

    for choices in points:
        if mode == "ablation":
            name = "base" if not choices else f"{choices[0].axis}={choices[0].label}"
        else:
            name = "__".join(f"{item.axis}={item.label}" for item in choices) or "base"
        name = safe_name(name)
        flags = dict(shared)
        for item in choices:
            flags.update(item.flags)
        args = parse(flags, name)
        key = settings_key(args)
        if key in by_settings:  # e.g. an ablation value equal to the base: the same run, run once
            cells.append((choices, by_settings[key]))
            continue
        if name in {c.name for c in configurations}:
            raise RecipeError(f"Sweep {path}: two different runs are both named {name!r}; give the values labels.")
        tasks.add(args.task)
        configuration = Configuration(name, "configuration", choices, flags)
        if baseline:
            if args.scorer == "none":
                raise RecipeError(
                    f"Sweep {path}: run {name!r} has --scorer none, a baseline itself; set baseline: false or give "
                    "it a scorer."
                )
            unpatched = baseline_flags(flags)
            base_key = settings_key(parse(unpatched, f"baseline of {name}"))
            existing = next((b for b in baselines if by_settings.get(base_key) == b.name), None)
            if existing is None:
                non_patch = tuple(item for item in choices if set(item.flags) - patch_only_flags())
                base_name = safe_name("__".join(["baseline", *(f"{i.axis}={i.label}" for i in non_patch)]))
                if base_name in {b.name for b in baselines}:
                    base_name = safe_name(f"baseline__{name}")
                existing = Configuration(base_name, "baseline", non_patch, unpatched)
                baselines.append(existing)
                by_settings[base_key] = base_name
            configuration.baseline = existing.name
        configurations.append(configuration)
        by_settings[key] = name
        cells.append((choices, name))
    if len(tasks) > 1:
        raise RecipeError(f"Sweep {path} mixes tasks {sorted(tasks)}; a sweep compares runs of one task.")

    plan = SweepPlan(
        config_path=path,
        grid=grid,
        mode=mode,
        description=description.strip(),
        seeds=seeds,
        baseline=baseline,
        root=root,
        axes=axes,
        configurations=[*baselines, *configurations],
        cells=cells,
        base_flags=shared,
        command_line=list(argv or []),
    )
    for configuration in plan.configurations:
        for seed in seeds:
            output_dir = root / configuration.name / f"seed_{seed}"
            flags = {
                **run_defaults(configuration.flags),
                "seed": seed,
                "output_dir": str(output_dir),
                "resume_from_checkpoint": "latest",
            }
            args = parse_values(flags, source=f"Run {configuration.name!r} (seed {seed}) of {path}")
            key = comparable(finetune.public_settings(args))
            configuration.runs.append(Run(configuration.name, seed, output_dir, args, key))
    return plan


def read_settings(path: Path) -> dict[str, Any] | None:
    """The ``settings`` recorded in a run's ``all_results.json`` or ``sweep_run.json``; None if it is missing or
    unreadable."""
    try:
        return json.loads(path.read_text()).get("settings", {})
    except (OSError, ValueError, AttributeError):
        return None


def check_run_folders(plan: SweepPlan) -> None:
    """Set each run's status from its folder: done, interrupted or pending; refuse folders of other runs."""
    problems = []
    for run in plan.runs():
        folder = run.output_dir
        results, record = folder / report.RESULTS_FILE, folder / RUN_RECORD
        saved = read_settings(results)  # None also for a file cut short by a kill while it was written
        status = "done"
        if saved is None and record.is_file():
            saved, status = read_settings(record) or {}, "interrupted"
        if saved is None:
            if folder.is_dir() and any(folder.iterdir()):
                problems.append(f"{folder} holds files but no {RUN_RECORD}: it was not started by this sweep.")
                continue
            status = "pending"
        else:
            different = differences(comparable(saved), run.key)
            if different:
                details = ", ".join(f"{key}: there {old!r}, planned {new!r}" for key, (old, new) in different.items())
                problems.append(f"{folder} holds a run with other settings ({details}).")
                continue
        run.status = status
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise RecipeError(
            f"The sweep's folder {plan.root} holds runs that do not belong to this plan:\n  {shown}\n"
            "Use another --output_dir (or move those folders away); the sweep does not mix runs of different "
            "settings."
        )


# ----------------------------------------------------------------------------------------------- running


def is_main_process() -> bool:
    """Under ``accelerate launch`` every process plans and runs; only the first writes the sweep's own files."""
    return os.environ.get("RANK", "0") == "0"


def run_sweep(plan: SweepPlan) -> list[dict[str, Any]]:
    """Run what is not finished, in order; returns what happened to each run (skipped, started, resumed)."""
    log = []
    runs = plan.runs()
    for index, run in enumerate(runs, 1):
        entry = {"configuration": run.configuration, "seed": run.seed, "output_dir": str(run.output_dir)}
        if run.status == "done":
            logger.info(
                "Sweep run %d/%d %s seed %d: finished before, skipped", index, len(runs), run.configuration, run.seed
            )
            log.append({**entry, "action": "skipped"})
            continue
        latest = checkpointing.find_latest(run.output_dir)
        action = f"resumed from {latest.name}" if latest is not None else "started"
        logger.info("Sweep run %d/%d %s seed %d: %s", index, len(runs), run.configuration, run.seed, action)
        if is_main_process():
            run.output_dir.mkdir(parents=True, exist_ok=True)
            report.write_json(
                run.output_dir / RUN_RECORD,
                {
                    "sweep": str(plan.config_path),
                    "grid": plan.grid,
                    "configuration": run.configuration,
                    "seed": run.seed,
                    "settings": run.key,
                },
            )
        started = time.time()
        finetune.run(copy.deepcopy(run.args))
        run.status = "done"
        log.append({**entry, "action": action, "wall_s": time.time() - started})
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
    return log


# ------------------------------------------------------------------------------------------------ report


def collect(plan: SweepPlan) -> dict[str, dict[int, dict[str, Any]]]:
    """The finished runs' ``all_results.json``: configuration name -> seed -> results."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for configuration in plan.configurations:
        found[configuration.name] = {}
        for run in configuration.runs:
            path = run.output_dir / report.RESULTS_FILE
            if path.is_file():
                found[configuration.name][run.seed] = json.loads(path.read_text())
    return found


@dataclass
class Row:
    """One configuration's aggregate over the seeds it finished."""

    configuration: Configuration
    values: dict[int, float]  # seed -> primary metric
    difference: stats.PairedDifference | None
    verdict: str
    params_added: int | None
    runtime: list[float]


def summarize(plan: SweepPlan, found: dict[str, dict[int, dict[str, Any]]], metric: str, greater: bool) -> list[Row]:
    rows = []
    for configuration in plan.configurations:
        results = found[configuration.name]
        values = {seed: float(r[metric]) for seed, r in results.items() if metric in r}
        difference, verdict = None, ""
        if configuration.baseline is not None:
            base = found[configuration.baseline]
            paired = [seed for seed in plan.seeds if seed in values and seed in base and metric in base[seed]]
            if paired:
                difference = stats.paired_difference(
                    [values[s] for s in paired], [float(base[s][metric]) for s in paired]
                )
                verdict = stats.verdict(difference, greater)
        first = next(iter(results.values()), None)
        params = first.get("parameters", {}).get("added_by_patch", 0) if first else None
        runtime = [float(r.get("train_runtime_s", 0.0)) for r in results.values()]
        rows.append(Row(configuration, values, difference, verdict, params, runtime))
    return rows


def markdown_table(plan: SweepPlan, rows: list[Row], metric: str) -> str:
    label = report.METRIC_LABELS.get(metric, metric)
    header = ["configuration", "flags", "params added", f"{label} (mean ± std)"]
    if plan.baseline:
        header += [f"Δ {label} vs baseline, paired (95 % CI)", "verdict"]
    header += ["seeds", "train time (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        values = [row.values[s] for s in plan.seeds if s in row.values]
        cells = [f"`{row.configuration.name}`", row.configuration.changed()]
        cells.append("—" if row.params_added is None else f"{row.params_added:,}")
        cells.append(stats.format_mean_std(values) if values else "not run")
        if plan.baseline:
            if row.configuration.kind == "baseline":
                cells += ["—", "—"]
            elif row.difference is None:
                cells += ["—", "no paired seeds yet"]
            else:
                cells += [stats.format_difference(row.difference), row.verdict]
        cells.append(f"{len(values)}/{len(plan.seeds)}")
        cells.append(stats.format_mean_std(row.runtime, digits=1) if row.runtime else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def axis_columns(plan: SweepPlan, configuration: Configuration) -> dict[str, str]:
    """The label of each axis for a configuration (empty where it stays at the base)."""
    chosen = {item.axis: item.label for item in configuration.choices}
    return {f"axis:{axis}": chosen.get(axis, "") for axis in plan.axes}


def write_csvs(plan: SweepPlan, found, rows: list[Row], metrics: list[str]) -> None:
    """sweep.csv: one row per run and seed; sweep_summary.csv: one row per configuration (columns in
    docs/recipes.md)."""
    fields = ["configuration", "kind", "baseline", "seed", "status", *[f"axis:{a}" for a in plan.axes], "flags"]
    fields += [*metrics, "params_added", "train_steps", "train_runtime_s", "output_dir"]
    with open(plan.root / SWEEP_CSV, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for configuration in plan.configurations:
            for run in configuration.runs:
                results = found[configuration.name].get(run.seed)
                row = {
                    "configuration": configuration.name,
                    "kind": configuration.kind,
                    "baseline": configuration.baseline or "",
                    "seed": run.seed,
                    "status": "done"
                    if results
                    else ("interrupted" if (run.output_dir / RUN_RECORD).is_file() else "pending"),
                    **axis_columns(plan, configuration),
                    "flags": configuration.changed(),
                    "output_dir": str(run.output_dir),
                }
                if results:
                    row.update({m: results.get(m, "") for m in metrics})
                    row.update(
                        params_added=results.get("parameters", {}).get("added_by_patch", 0),
                        train_steps=results.get("train_steps"),
                        train_runtime_s=results.get("train_runtime_s"),
                    )
                writer.writerow(row)
    summary_fields = ["configuration", "kind", "baseline", *[f"axis:{a}" for a in plan.axes], "flags", "seeds_done"]
    summary_fields += ["metric", "mean", "std", "baseline_mean", "diff_mean", "diff_std", "ci_low", "ci_high"]
    summary_fields += ["relative_diff_percent", "verdict", "params_added", "train_runtime_s_mean"]
    with open(plan.root / SUMMARY_CSV, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=summary_fields)
        writer.writeheader()
        for row in rows:
            values = list(row.values.values())
            difference = row.difference
            writer.writerow(
                {
                    "configuration": row.configuration.name,
                    "kind": row.configuration.kind,
                    "baseline": row.configuration.baseline or "",
                    **axis_columns(plan, row.configuration),
                    "flags": row.configuration.changed(),
                    "seeds_done": len(values),
                    "metric": metrics[0],
                    "mean": stats.mean(values) if values else "",
                    "std": stats.sample_std(values) if len(values) > 1 else "",
                    "baseline_mean": difference.baseline_mean if difference else "",
                    "diff_mean": difference.mean if difference else "",
                    "diff_std": difference.std if difference and difference.std is not None else "",
                    "ci_low": difference.ci_low if difference and difference.ci_low is not None else "",
                    "ci_high": difference.ci_high if difference and difference.ci_high is not None else "",
                    "relative_diff_percent": difference.relative
                    if difference and difference.relative is not None
                    else "",
                    "verdict": row.verdict,
                    "params_added": "" if row.params_added is None else row.params_added,
                    "train_runtime_s_mean": stats.mean(row.runtime) if row.runtime else "",
                }
            )


def axis_series(plan: SweepPlan, axis: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """The lines of an axis's plot: (legend, [(value label, configuration name), ...]). Ablation: one line over
    the axis's values; grid: one line per combination of the other axes."""
    series: dict[str, list[tuple[str, str]]] = {}
    for choices, name in plan.cells:
        mine = [item for item in choices if item.axis == axis]
        if not mine or (plan.mode == "ablation" and len(choices) != 1):
            continue
        others = ", ".join(f"{item.axis}={item.label}" for item in choices if item.axis != axis)
        series.setdefault(others, []).append((mine[0].label, name))
    order = {item.label: index for index, item in enumerate(plan.axes[axis])}
    lines = [(legend, sorted(points, key=lambda p: order[p[0]])) for legend, points in series.items()]
    if plan.mode == "ablation" and lines:
        base = next(name for choices, name in plan.cells if not choices)
        if base not in {name for _, name in lines[0][1]}:  # no value of this axis is the base: show it first
            lines[0][1].insert(0, (BASE_LABEL, base))
    return lines


def plot_axis(plan: SweepPlan, axis: str, rows: dict[str, Row], metric: str, path: Path) -> bool:
    """``sweep_<axis>.png``: the metric over the axis's values, mean ± std over seeds with each seed as a dot;
    the baseline as a band (mean ± std) where the whole axis shares one, else as grey points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = axis_series(plan, axis)
    labels = [item.label for item in plan.axes[axis]]
    if any(label == BASE_LABEL for _, points in series for label, _ in points):
        labels.insert(0, BASE_LABEL)
    if not any(rows[name].values for _, points in series for _, name in points):
        return False
    figure, axes = plt.subplots(figsize=(max(5.0, 1.2 * len(labels) + 2), 4.5))
    width = 0.25 / max(1, len(series))
    for index, (legend, points) in enumerate(series):
        offset = (index - (len(series) - 1) / 2) * width
        xs, means, spreads = [], [], []
        for label, name in points:
            values = list(rows[name].values.values())
            if not values:
                continue
            x = labels.index(label) + offset
            xs.append(x)
            means.append(stats.mean(values))
            spreads.append(stats.sample_std(values) or 0.0)
            axes.scatter([x] * len(values), values, s=12, alpha=0.4, color="black", zorder=3)
        if xs:
            axes.errorbar(xs, means, yerr=spreads, marker="o", capsize=4, label=legend or "mean ± std over seeds")
    baselines = {rows[name].configuration.baseline for _, points in series for _, name in points} - {None}
    if len(baselines) == 1:
        values = list(rows[baselines.pop()].values.values())
        if values:
            centre, spread = stats.mean(values), stats.sample_std(values) or 0.0
            axes.axhline(centre, color="grey", linestyle="--", label="baseline (mean ± std)")
            if spread:
                axes.axhspan(centre - spread, centre + spread, color="grey", alpha=0.2)
    elif baselines:
        for label, name in series[0][1]:
            base = rows[name].configuration.baseline
            values = list(rows[base].values.values()) if base else []
            if values:
                axes.errorbar(
                    [labels.index(label)],
                    [stats.mean(values)],
                    yerr=[stats.sample_std(values) or 0.0],
                    marker="s",
                    color="grey",
                    capsize=4,
                    label="baseline (mean ± std)" if label == series[0][1][0][0] else None,
                )
    axes.set_xticks(range(len(labels)), labels)
    axes.set(
        xlabel=axis,
        ylabel=report.METRIC_LABELS.get(metric, metric),
        title=f"{axis}: {report.METRIC_LABELS.get(metric, metric)}, {len(plan.seeds)} seed(s), {plan.grid} grid",
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def write_report(plan: SweepPlan) -> dict[str, Path]:
    """sweep.md, sweep.csv, sweep_summary.csv, sweep_<axis>.png and SUMMARY.md from the runs finished so far."""
    found = collect(plan)
    task = get_task(plan.configurations[-1].runs[0].args.task)
    metric, greater = task.primary_metric, task.greater_is_better
    metrics = task.metric_names() + (["eval_loss"] if task.kind == "clm" else [])
    rows = summarize(plan, found, metric, greater)
    plan.root.mkdir(parents=True, exist_ok=True)
    written = {}
    plots = []
    for axis in plan.axes:
        path = plan.root / f"sweep_{safe_name(axis)}.png"
        if plot_axis(plan, axis, {row.configuration.name: row for row in rows}, metric, path):
            plots.append((axis, path.name))
            written[f"plot:{axis}"] = path
    table = markdown_table(plan, rows, metric)
    done = sum(len(results) for results in found.values())
    total = len(plan.configurations) * len(plan.seeds)
    notes = sweep_notes(plan)
    pictures = "".join(f"![{axis}]({name})\n\n" for axis, name in plots)
    heading = f"# Sweep {plan.config_path.stem} ({plan.grid} grid)\n\n"
    summary_line = (
        f"{plan.mode.capitalize()} over {', '.join(plan.axes) or 'no axis'}; {len(plan.seeds)} seed(s) "
        f"({', '.join(map(str, plan.seeds))}); primary metric {report.METRIC_LABELS.get(metric, metric)} "
        f"({'higher' if greater else 'lower'} is better); {done}/{total} runs finished.\n\n"
    )
    (plan.root / SWEEP_TABLE).write_text(heading + summary_line + table + "\n" + notes + "\n" + pictures)
    written["table"] = plan.root / SWEEP_TABLE
    write_csvs(plan, found, rows, metrics)
    written["csv"], written["summary_csv"] = plan.root / SWEEP_CSV, plan.root / SUMMARY_CSV
    (plan.root / SUMMARY_FILE).write_text(summary_card(plan, found, rows, table, notes, pictures, metric, done, total))
    written["summary"] = plan.root / SUMMARY_FILE
    return written


def sweep_notes(plan: SweepPlan) -> str:
    if len(plan.seeds) < 2:
        spread = (
            "One seed gives no error bar: a difference of about the size of the seed noise (the offline demo's "
            "baseline spread 0.83 % over three seeds) cannot be told from it. Set seeds: 2 or more."
        )
    else:
        spread = f"± is the sample standard deviation over the {len(plan.seeds)} seeds. " + (
            "Δ is the configuration minus its baseline seed by seed (the same seed gives both the same data "
            f"order and initial weights), with a 95 % Student-t interval ({len(plan.seeds) - 1} degree"
            f"{'s' if len(plan.seeds) != 2 else ''} of freedom); it is called larger than the seed noise only when the interval excludes 0. With many "
            "configurations, about one in twenty intervals excludes 0 by chance."
            if plan.baseline
            else "No baseline was run (baseline: false), so there are no paired differences."
        )
    return f"{spread} Train time: the mean training time of one run, evaluations included.\n"


def summary_card(plan, found, rows, table, notes, pictures, metric, done, total) -> str:
    """SUMMARY.md, in the style of a model card: what was run on what, the table, and the caveats."""
    first = next((r for results in found.values() for r in results.values()), None)
    if first:
        data = first["data"]
        data_text = f"{data['dataset_name']}" + (f" ({data['dataset_config']})" if data.get("dataset_config") else "")
        data_text += f", evaluated on `{data.get('eval_split')}`; {first.get('train_samples')} training examples"
        if first.get("block_size"):
            data_text += f" of {first['block_size']} tokens"
        unpatched = first["parameters"]["total"] - first["parameters"].get("added_by_patch", 0)
        model_text = (
            f"{first['model_class']} from {first['model_source']}, "
            f"{'trained from scratch' if first.get('from_scratch') else 'fine-tuned'}; {unpatched:,} parameters "
            "without the patch (each configuration's additions are in the table)"
        )
        budget = (
            f"{first['train_steps']} optimizer steps of {first['total_train_batch_size']} examples per run "
            f"({first['num_processes']} process(es))"
        )
    else:
        data_text = model_text = budget = "no run has finished yet"
    runtime = sum(float(r.get("train_runtime_s", 0.0)) for results in found.values() for r in results.values())
    command = ["python -m recipes.sweep --config", str(plan.config_path)]
    command += (["--grid reduced"] if plan.grid == "reduced" else []) + plan.command_line
    axes_lines = "".join(
        f"  * `{axis}`: {', '.join(item.label for item in items)}\n" for axis, items in plan.axes.items()
    )
    base_rows = "".join(f"| {key} | {format_label(value)} |\n" for key, value in sorted(plan.base_flags.items()))
    how = "one axis at a time from the base configuration" if plan.mode == "ablation" else "every combination"
    count = sum(c.kind == "configuration" for c in plan.configurations)
    with_baseline = ", each with its unpatched baseline (`--scorer none`, same seeds)" if plan.baseline else ""
    if len(plan.seeds) < 2:
        noise = "one seed, so no error bars"
    else:
        noise = (
            f"{len(plan.seeds)} seeds; intervals from few seeds are wide, and a difference within the seed noise is "
            "no evidence either way"
        )
    return f"""# Sweep `{plan.config_path.stem}` ({plan.grid} grid)

{plan.description or "A sweep of recipe runs."}

## What was run

* mode: **{plan.mode}** ({how}): {count} configurations{with_baseline}
* axes:
{axes_lines.rstrip() or "  * none (the base configuration only)"}
* seeds: {", ".join(map(str, plan.seeds))}
* runs finished: {done} of {total}; their training time in total {runtime / 60:.1f} min

## Data

{data_text}.

## Model

{model_text}.

## Budget

{budget}. The flags every run shares (then each configuration's own, in the table):

| flag | value |
|---|---|
{base_rows}
## Results

{table}
{notes}
{pictures}## Caveats

* Small scale: {budget}, on small models. These runs check the pipeline and show the size of effects at this
  scale; they are not the papers' setups.
* Seed noise: {noise}.
* Unfinished runs are left out of the means (the seeds column says how many each has).

## Reproduce

```bash
{" ".join(command)}
```

Rerunning it skips the finished runs and resumes interrupted ones; `--report_only` rewrites this report.
"""


# --------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0].lower().endswith(CONFIG_EXTENSIONS):
        argv = ["--config", *argv]
    own = argparse.ArgumentParser(
        prog="python -m recipes.sweep",
        allow_abbrev=False,
        description="Run a sweep of recipe runs from a config file (recipes/sweeps/*.yaml); other flags are "
        "recipe flags that override the config's base for every run.",
    )
    own.add_argument("--config", required=True, help="The sweep config (YAML or JSON).")
    own.add_argument("--grid", choices=GRIDS, default="full", help="full (as written) or reduced (its reduced:).")
    own.add_argument("--report_only", action="store_true", help="Write the report from the finished runs only.")
    own.add_argument("--dry_run", action="store_true", help="Print the plan and each run's status; run nothing.")
    known, rest = own.parse_known_args(argv)
    try:
        plan = build_plan(known.config, known.grid, rest)
        check_run_folders(plan)
        runs = plan.runs()
        counts = {status: sum(run.status == status for run in runs) for status in ("done", "interrupted", "pending")}
        print(
            f"Sweep {plan.config_path} ({plan.grid} grid, {plan.mode}): {len(plan.configurations)} configurations x "
            f"{len(plan.seeds)} seeds = {len(runs)} runs in {plan.root}; {counts['done']} done, "
            f"{counts['interrupted']} interrupted, {counts['pending']} to run."
        )
        if known.dry_run:
            for run in runs:
                print(f"  {run.status:12s} {run.configuration} seed {run.seed}")
            return 0
        if not known.report_only:
            run_sweep(plan)
        if is_main_process():
            written = write_report(plan)
            print((plan.root / SWEEP_TABLE).read_text())
            print("Wrote " + ", ".join(str(path) for path in written.values()))
    except RecipeError as error:
        print(f"sweep.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
