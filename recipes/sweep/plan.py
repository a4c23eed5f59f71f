"""A sweep's plan: the config read and checked, and every run it implies, before anything runs.

:func:`build_plan` reads a sweep config (its format: ``recipes/sweep/__init__.py`` and ``docs/recipes.md``) and hands
its values to :func:`plan_sweep`, which checks them and returns the plan; ``recipes.compare`` builds a
:class:`SweepPlan` of settings in code and calls :func:`plan_runs` the same way. The plan is a value: frozen
dataclasses, each step returning a new one. Every run's flags go through the recipes' own argument checks here.
What the run folders hold is not part of the plan: :func:`check_run_folders` reads each one (done, interrupted or
pending; a folder of another run is refused) and returns their statuses.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from recipes import modeling, qlora
from recipes.args import build_parser, given_flags, parse_values, public_settings
from recipes.config_files import check_config_values
from recipes.errors import RecipeError
from recipes.patch_flags import BASELINE, DEFAULT_SCORER, GATE_SETTINGS, patch_settings
from recipes.report import RESULTS_FILE
from recipes.tasks import get_task

SWEEP_KEYS = ("description", "base", "axes", "mode", "seeds", "baseline", "metric", "compare", "correction", "reduced")
# A config of several parts (``parts: {name: <a sweep config>, ...}``, run in order) has these keys only.
PARTS_KEYS = ("description", "parts")
MODES = ("ablation", "grid")
CORRECTIONS = ("none", "holm")  # how a family of comparisons is read: each alone, or Holm's step-down correction
GRIDS = ("full", "reduced")
RUN_RECORD = "sweep_run.json"  # in each run folder: what the sweep started there (settings, configuration, seed)
RUN_LOCK = "sweep_run.lock"  # in a run folder while a sweep process runs it: "<host> <pid>" (recipes.sweep.run)
BASE_CHANGES = "— (base)"  # the "flags" cell of an ablation's base point, which changes no flag
# Flags the sweep sets for every run itself, and flags a sweep cannot use (every run would push to one repository).
MANAGED_FLAGS = ("seed", "output_dir", "resume_from_checkpoint")
REFUSED_FLAGS = ("push_to_hub", "hub_model_id", "hub_token", "hub_private_repo")
# What a sweep (and recipes.compare) refuses in base and on its command line, and does not list in its --help.
NOT_ACCEPTED_FLAGS = (*REFUSED_FLAGS, "resume_from_checkpoint")
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


@dataclass(frozen=True)
class AxisValue:
    """One value of one axis: the flags it sets, and its label in run names, tables and plots."""

    axis: str
    label: str
    flags: dict[str, Any]


@dataclass(frozen=True)
class Run:
    """One seed of one configuration."""

    configuration: str
    seed: int
    output_dir: Path
    args: argparse.Namespace
    key: dict[str, Any]  # the settings a run already in output_dir must have been started with


# What a run folder holds, by (configuration, seed): "done", "interrupted" or "pending" (check_run_folders).
RunStatuses = dict[tuple[str, int], str]


@dataclass(frozen=True)
class Configuration:
    """A set of flags run over every seed: a point of the sweep, or a baseline."""

    name: str
    # "configuration" (patched), "baseline" (its unpatched pair) or "control" (an unpatched point of a sweep with
    # baselines: the base's baseline changed by its axis values, e.g. more steps or a wider model)
    kind: str
    choices: tuple[AxisValue, ...]  # the axis values that define it (none: the base point)
    flags: dict[str, Any]
    changes: str  # the flags it changes, for the tables: ``h=1, layers=0``; ``scorer=none`` for a baseline
    baseline: str | None = None  # the name of its paired baseline
    runs: tuple[Run, ...] = ()


def plural(count: int, noun: str) -> str:
    """``1 seed``, ``2 seeds``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def sweep_run_folder(root: Path, configuration: str, seed: int) -> Path:
    """Where a sweep's run goes: ``<root>/<configuration>/seed_<seed>``."""
    return root / configuration / f"seed_{seed}"


@dataclass(frozen=True)
class SweepPlan:
    """What the sweep runs: its settings (from a config, or from ``recipes.compare``), and in the plan
    :func:`plan_runs` returns for them, its configurations (baselines first) and their runs."""

    name: str  # in headings and run records: the config's stem, or the comparison's name
    config_path: Path | None  # None for a plan built in code (recipes.compare)
    grid: str
    mode: str
    description: str
    seeds: tuple[int, ...]
    baseline: bool
    root: Path
    axes: dict[str, tuple[AxisValue, ...]]
    base_flags: dict[str, Any]
    command_line: tuple[str, ...]
    base_name: str = "base"  # the run name of the base point (no axis value)
    base_changes: str = BASE_CHANGES  # the base point's "flags" cell
    run_folder: Callable[[Path, str, int], Path] = sweep_run_folder
    # One seed gives no error bar; with this percentage a smaller relative change reads "no difference"
    # (recipes.compare's --no_difference_below), without it the verdict says there is no error bar.
    no_difference_below: float | None = None
    # The metric the tables and plots report (default: the task's primary metric), e.g. eval_loss.
    metric: str | None = None
    # Comparisons beyond each configuration against its baseline: (configuration, against) by run name.
    compare: tuple[tuple[str, str], ...] = ()
    correction: str = "none"  # CORRECTIONS: "holm" reads every comparison of the table as one family
    configurations: tuple[Configuration, ...] = ()
    cells: tuple[tuple[tuple[AxisValue, ...], str], ...] = ()  # each point -> its configuration

    @property
    def source(self) -> str:
        """The plan in error messages: ``sweep <config>``, or its name."""
        return f"sweep {self.config_path}" if self.config_path is not None else self.name

    def by_name(self, name: str) -> Configuration:
        return next(c for c in self.configurations if c.name == name)

    def comparisons(self) -> list[tuple[str, str]]:
        """Every comparison the report makes, (configuration, against) by name: each configuration and control
        against its baseline, in the plan's order, then the config's ``compare`` pairs."""
        paired = [(c.name, c.baseline) for c in self.configurations if c.baseline is not None]
        return [*paired, *self.compare]

    def runs(self) -> list[Run]:
        """Every run, seed by seed (each seed's baselines first): after the first seed the sweep has a whole
        picture, however far it gets."""
        return [c.runs[index] for index in range(len(self.seeds)) for c in self.configurations]

    def status_line(self, statuses: RunStatuses) -> str:
        """``3 configurations x 2 seeds = 6 runs in <root>; 2 done, 1 interrupted, 3 to run``, ``statuses`` as
        :func:`check_run_folders` found them."""
        runs = self.runs()
        found = [statuses[run.configuration, run.seed] for run in runs]
        count = {status: found.count(status) for status in ("done", "interrupted", "pending")}
        return (
            f"{plural(len(self.configurations), 'configuration')} x {plural(len(self.seeds), 'seed')} = "
            f"{plural(len(runs), 'run')} in {self.root}; {count['done']} done, {count['interrupted']} interrupted, "
            f"{count['pending']} to run"
        )


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
    check_keys(values, path)
    return values


def check_keys(values: dict[str, Any], where: Path | str) -> None:
    """A sweep config's keys: a sweep's (:data:`SWEEP_KEYS`), or a config of parts' (:data:`PARTS_KEYS`)."""
    allowed = PARTS_KEYS if "parts" in values else SWEEP_KEYS
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise RecipeError(f"Sweep config {where} has unknown key(s) {unknown}; its keys are {list(allowed)}.")


def config_parts(values: dict[str, Any], path: Path) -> list[tuple[str, dict[str, Any]]]:
    """A config's sweeps in the order they run: ``[(part name, its config)]``; one unnamed part where the config
    has no ``parts:``. A later part may use an earlier part's runs (e.g. fine-tune its trained baseline), so each
    part is planned only once the parts before it have run."""
    if "parts" not in values:
        return [("", values)]
    parts = values["parts"]
    if not isinstance(parts, dict) or not parts:
        raise RecipeError(f"Sweep config {path}: parts must map part names to sweep configs.")
    for name, part in parts.items():
        if not isinstance(part, dict):
            raise RecipeError(f"Sweep config {path}: part {name!r} must be a sweep config (base:, axes:, ...).")
        check_keys(part, f"{path}, part {name!r},")
        if "parts" in part:
            raise RecipeError(f"Sweep config {path}: part {name!r} cannot have parts of its own.")
        if safe_name(str(name)) != str(name):
            raise RecipeError(f"Sweep config {path}: part name {name!r} must be usable as a folder name.")
    return [(str(name), part) for name, part in parts.items()]


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


def parse_axes(axes: Any, recipe_flags: set[str], path: Path) -> dict[str, tuple[AxisValue, ...]]:
    """Each axis's values as AxisValue: a scalar sets the axis's flag, a mapping sets its flags (+ ``label``)."""
    if axes is None:
        return {}
    if not isinstance(axes, dict):
        raise RecipeError(f"Sweep config {path}: axes must map axis names to lists of values.")
    parsed: dict[str, tuple[AxisValue, ...]] = {}
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
        parsed[axis] = tuple(items)
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


@functools.cache
def flag_defaults() -> dict[str, Any]:
    """Every recipe flag's default (built once: the parser is generated from the scorer configs)."""
    parser = build_parser()
    return {name: parser.get_default(name) for name in parser.recipe_flags}


def differences(saved: dict[str, Any], planned: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Settings that differ. A setting the saved run did not know (a flag added since) counts as equal if the plan
    leaves it unset or at the flag's default, which is what that run trained with."""
    defaults = flag_defaults()
    different = {}
    for key in sorted(set(saved) | set(planned)):
        if key not in saved and planned.get(key) in (None, defaults.get(key)):
            continue
        if saved.get(key) != planned.get(key):
            different[key] = (saved.get(key), planned.get(key))
    return different


def patch_only_flags() -> set[str]:
    """The flags a baseline drops: the patch's and its training's."""
    return {*patch_settings(), *GATE_SETTINGS, "scorer_learning_rate", "train_only_new_params"}


def baseline_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """A configuration's baseline: the same flags unpatched, ``--scorer none``; a configuration whose baseline would
    train nothing (scorers alone on a quantized base) is a RecipeError."""
    qlora.check_baseline(flags)
    base = {key: value for key, value in flags.items() if key not in patch_only_flags()}
    base["scorer"] = BASELINE
    return base


def run_defaults(flags: dict[str, Any]) -> dict[str, Any]:
    """Checkpointing for sweep runs, so that a killed run resumes: every quarter of the budget, newest kept."""
    flags = dict(flags)
    if flags.get("checkpointing_steps") is None:
        steps = flags.get("max_train_steps")
        if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
            flags["checkpointing_steps"] = str(max(1, steps // 4))
        elif steps is None:
            flags["checkpointing_steps"] = "epoch"
        # Any other value is malformed: parsing the run's flags reports it.
    if flags.get("checkpoints_total_limit") is None:
        flags["checkpoints_total_limit"] = 1
    return flags


def describe_flags(flags: dict[str, Any]) -> str:
    """``h=1, layers=0``: flags as the tables show them."""
    return ", ".join(f"{key}={format_label(value)}" for key, value in flags.items())


def parse_seeds(seeds_value: Any, first_seed: Any, seed_on_command_line: bool, path: Path) -> tuple[int, ...]:
    """The plan's seeds: ``seeds: N`` counts up from base's (or the command line's) ``seed``; a list is taken as it
    is (the command line's ``--seed`` is refused then)."""
    if isinstance(seeds_value, bool) or not isinstance(seeds_value, (int, list)):
        raise RecipeError(f"Sweep config {path}: seeds must be a count or a list of seeds, got {seeds_value!r}.")
    if isinstance(seeds_value, int):
        if seeds_value < 1:
            raise RecipeError(f"Sweep config {path}: seeds must be at least 1, got {seeds_value}.")
        if isinstance(first_seed, bool) or not isinstance(first_seed, int):
            raise RecipeError(f"Sweep config {path}: seed must be an integer, got {first_seed!r}.")
        seeds = [first_seed + offset for offset in range(seeds_value)]
    else:
        if seed_on_command_line:
            raise RecipeError(f"--seed: sweep config {path} lists its seeds ({seeds_value}); edit the list instead.")
        seeds = seeds_value
        if (
            not seeds
            or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds)
            or len(set(seeds)) != len(seeds)
        ):
            raise RecipeError(f"Sweep config {path}: seeds must be distinct integers, got {seeds!r}.")
    return tuple(seeds)


def build_plan(
    config_path: str | os.PathLike, grid: str = "full", argv: list[str] | None = None, part: str = ""
) -> SweepPlan:
    """Read the sweep config at ``config_path`` and plan it (:func:`plan_sweep`); nothing is run or written."""
    path = Path(config_path)
    return plan_sweep(read_config(path), path, grid, argv, part)


def plan_sweep(
    values: dict[str, Any], path: Path, grid: str = "full", argv: list[str] | None = None, part: str = ""
) -> SweepPlan:
    """The plan of the sweep config ``values`` (read from ``path``; of a config of parts, the part named ``part``)
    on the ``grid`` with the command line ``argv``: every key checked and every run it implies, as a value. Reads
    no run folder and writes nothing."""
    parts = dict(config_parts(values, path))
    if part not in parts:
        raise RecipeError(f"Sweep config {path} has no part {part!r}; its parts are {list(parts)}.")
    values = select_grid(parts[part], grid, path)
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
    for flag in sorted(set(base) & set(NOT_ACCEPTED_FLAGS)):
        raise RecipeError(f"Sweep config {path}, base: {flag} cannot be set in a sweep (each run is managed by it).")
    axes = parse_axes(values.get("axes"), recipe_flags, path)

    command_line = given_flags(list(argv or []))
    for flag in sorted(set(command_line) & set(NOT_ACCEPTED_FLAGS)):
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
    if part and "output_dir" in command_line:
        raise RecipeError(
            f"--output_dir: sweep config {path} has parts, each with its own output_dir (a later part may read an "
            "earlier one's runs there); edit them in the config."
        )
    root = (
        Path(root_value)
        if root_value
        else Path("outputs") / f"sweep-{path.stem}{'-reduced' if grid == 'reduced' else ''}" / part
    )
    metric, correction = parse_reading(values, path)
    seeds = parse_seeds(values.get("seeds", 1), shared.pop("seed", 42), "seed" in command_line, path)

    plan = SweepPlan(
        name=f"{path.stem}/{part}" if part else path.stem,
        config_path=path,
        grid=grid,
        mode=mode,
        description=description.strip(),
        seeds=seeds,
        baseline=baseline,
        root=root,
        axes=axes,
        base_flags=shared,
        command_line=tuple(argv or []),
        metric=metric,
        correction=correction,
    )
    plan = plan_runs(plan)
    plan = replace(plan, compare=parse_compare(values.get("compare"), plan, path))
    columns = get_task(plan.configurations[-1].runs[0].args.task).metric_columns()
    if metric is not None and metric not in columns:
        raise RecipeError(f"Sweep config {path}: metric {metric!r} is not one the task reports ({columns}).")
    return plan


def parse_reading(values: dict[str, Any], path: Path) -> tuple[str | None, str]:
    """How the report reads the runs: its ``metric`` (None: the task's primary one) and ``correction``."""
    metric = values.get("metric")
    if metric is not None and not isinstance(metric, str):
        raise RecipeError(f"Sweep config {path}: metric must be a metric's name, e.g. eval_loss.")
    correction = values.get("correction", "none")
    if correction not in CORRECTIONS:
        raise RecipeError(f"Sweep config {path}: correction must be one of {list(CORRECTIONS)}, got {correction!r}.")
    return metric, correction


def parse_compare(pairs: Any, plan: SweepPlan, path: Path) -> tuple[tuple[str, str], ...]:
    """The config's ``compare:`` list, ``[{configuration: <run name>, against: <run name>}, ...]``, checked against
    the plan's configurations (each configuration is already compared with its baseline)."""
    if pairs is None:
        return ()
    names = [c.name for c in plan.configurations]
    if not isinstance(pairs, list):
        raise RecipeError(f"Sweep config {path}: compare must be a list of {{configuration: ..., against: ...}}.")
    compare = []
    for pair in pairs:
        if not isinstance(pair, dict) or set(pair) != {"configuration", "against"}:
            raise RecipeError(
                f"Sweep config {path}: each compare entry is {{configuration: <run name>, against: <run name>}}, "
                f"got {pair!r}."
            )
        for name in pair.values():
            if name not in names:
                raise RecipeError(f"Sweep config {path}, compare: no run is named {name!r}; the runs are {names}.")
        if pair["configuration"] == pair["against"]:
            raise RecipeError(f"Sweep config {path}, compare: {pair['configuration']!r} is compared with itself.")
        compare.append((pair["configuration"], pair["against"]))
    if len(set(compare)) != len(compare) or set(compare) & set(plan.comparisons()):
        raise RecipeError(f"Sweep config {path}, compare: a comparison is listed twice (or is a baseline pair).")
    return tuple(compare)


def plan_runs(plan: SweepPlan) -> SweepPlan:
    """``plan`` (its settings) with its configurations (one per point of the sweep, an ablation's base point once;
    with ``baseline``, the unpatched runs they are paired with) and each one's run per seed, every run's flags
    parsed and checked: a new plan, ``plan`` unchanged."""
    if plan.mode == "ablation":  # the points of the sweep, each as the axis values that define it
        points: list[tuple[AxisValue, ...]] = [()]
        points += [(item,) for items in plan.axes.values() for item in items]
    else:
        points = list(itertools.product(*plan.axes.values())) if plan.axes else [()]

    configurations: list[Configuration] = []
    baselines: list[Configuration] = []
    by_settings: dict[str, str] = {}  # a run's settings -> the configuration that runs them
    cells: list[tuple[tuple[AxisValue, ...], str]] = []
    task_names = set()
    for choices in points:
        name = point_name(plan, choices)
        flags = dict(plan.base_flags)
        for item in choices:
            flags.update(item.flags)
        control = plan.baseline and bool(choices) and flags.get("scorer", DEFAULT_SCORER) == BASELINE
        if control:  # unpatched: the patch's flags of base do not apply (as for a baseline)
            flags = baseline_flags(flags)
        args = parse_run(plan, flags, name)
        key = settings_key(args)
        if key in by_settings:  # e.g. an ablation value equal to the base: the same run, run once
            cells.append((choices, by_settings[key]))
            continue
        if name in {c.name for c in configurations}:
            raise RecipeError(f"In {plan.source}, two different runs are both named {name!r}; give the values labels.")
        task_names.add(args.task)
        try:  # the patch against the model, on a skeleton: a refusal comes before any run trains
            modeling.check_patch(args)
        except RecipeError as error:
            raise RecipeError(f"Run {name!r} of {plan.source}: {error}") from error
        changes = describe_flags({k: v for c in choices for k, v in c.flags.items()}) or plan.base_changes
        configuration = Configuration(name, "control" if control else "configuration", choices, flags, changes)
        if plan.baseline:
            if args.scorer == BASELINE and not control:
                raise RecipeError(
                    f"In {plan.source}, run {name!r} has --scorer none, a baseline itself; set baseline: false or "
                    "give it a scorer."
                )
            # A control is paired with the base's baseline (what its axis values change is what it measures).
            paired = Configuration(plan.base_name, "configuration", (), dict(plan.base_flags), "") if control else None
            baseline = paired_baseline(plan, paired or configuration, baselines, by_settings)
            configuration = replace(configuration, baseline=baseline)
        configurations.append(configuration)
        by_settings[key] = name
        cells.append((choices, name))
    if len(task_names) > 1:
        raise RecipeError(
            f"In {plan.source}, the runs mix tasks {sorted(task_names)}; a sweep compares runs of one task."
        )
    return with_seed_runs(replace(plan, configurations=(*baselines, *configurations), cells=tuple(cells)))


def point_name(plan: SweepPlan, choices: tuple[AxisValue, ...]) -> str:
    """A point's run name: ``base`` (the plan's base name), ``<axis>=<label>``, in a grid joined by ``__``."""
    if not choices:
        name = plan.base_name
    elif plan.mode == "ablation":
        name = f"{choices[0].axis}={choices[0].label}"
    else:
        name = "__".join(f"{item.axis}={item.label}" for item in choices)
    return safe_name(name)


def settings_key(args: argparse.Namespace) -> str:
    """What makes two runs the same run, whatever their seed: their comparable settings, as text."""
    settings = comparable(public_settings(args))
    settings.pop("seed", None)
    return json.dumps(settings, sort_keys=True)


def parse_run(plan: SweepPlan, flags: dict[str, Any], name: str) -> argparse.Namespace:
    """A run's flags parsed and checked as the recipe checks them (at the plan's first seed); errors name the run."""
    values = {**run_defaults(flags), "seed": plan.seeds[0]}
    try:
        return parse_values(values, source=f"Run {name!r} of {plan.source}")
    except RecipeError as error:
        raise RecipeError(f"Run {name!r} of {plan.source}: {error}") from error
    except SystemExit as error:  # argparse's own exit on a bad value
        raise RecipeError(f"Run {name!r} of {plan.source}: invalid flag values {flags}") from error


def paired_baseline(
    plan: SweepPlan, configuration: Configuration, baselines: list[Configuration], by_settings: dict[str, str]
) -> str:
    """The name of ``configuration``'s baseline: the same flags unpatched, shared with the configurations whose
    baseline has the same settings, else added to ``baselines`` (named after the axis values it keeps)."""
    try:
        unpatched = baseline_flags(configuration.flags)
    except RecipeError as error:
        raise RecipeError(f"Run {configuration.name!r} of {plan.source}: {error}") from error
    base_key = settings_key(parse_run(plan, unpatched, f"baseline of {configuration.name}"))
    existing = next((b for b in baselines if by_settings.get(base_key) == b.name), None)
    if existing is not None:
        return existing.name
    non_patch = tuple(item for item in configuration.choices if set(item.flags) - patch_only_flags())
    base_name = safe_name("__".join(["baseline", *(f"{i.axis}={i.label}" for i in non_patch)]))
    if base_name in {b.name for b in baselines}:
        base_name = safe_name(f"baseline__{configuration.name}")
    extra = describe_flags({k: v for c in non_patch for k, v in c.flags.items()})
    changes = "scorer=none" + (f", {extra}" if extra else "")
    baselines.append(Configuration(base_name, "baseline", non_patch, unpatched, changes))
    by_settings[base_key] = base_name
    return base_name


def with_seed_runs(plan: SweepPlan) -> SweepPlan:
    """``plan`` with each configuration's run per seed, in its folder, resuming from its newest checkpoint."""
    return replace(plan, configurations=tuple(replace(c, runs=seed_runs(plan, c)) for c in plan.configurations))


def seed_runs(plan: SweepPlan, configuration: Configuration) -> tuple[Run, ...]:
    """``configuration``'s run per seed of ``plan``."""
    runs = []
    for seed in plan.seeds:
        output_dir = plan.run_folder(plan.root, configuration.name, seed)
        flags = {
            **run_defaults(configuration.flags),
            "seed": seed,
            "output_dir": str(output_dir),
            "resume_from_checkpoint": "latest",
        }
        args = parse_values(flags, source=f"Run {configuration.name!r} (seed {seed}) of {plan.source}")
        runs.append(Run(configuration.name, seed, output_dir, args, comparable(public_settings(args))))
    return tuple(runs)


def read_settings(path: Path) -> dict[str, Any] | None:
    """The ``settings`` recorded in a run's ``all_results.json`` or ``sweep_run.json``; None if it is missing or
    unreadable."""
    try:
        return json.loads(path.read_text()).get("settings", {})
    except (OSError, ValueError, AttributeError):
        return None


def check_run_folders(plan: SweepPlan) -> RunStatuses:
    """Each run's status from its folder, by (configuration, seed): done, interrupted or pending; refuses folders of
    other runs."""
    problems, statuses = [], {}
    for run in plan.runs():
        folder = run.output_dir
        results, record = folder / RESULTS_FILE, folder / RUN_RECORD
        saved = read_settings(results)  # None also for a file cut short by a kill while it was written
        status = "done"
        if saved is None and record.is_file():
            saved, status = read_settings(record) or {}, "interrupted"
        if saved is None:
            if folder.is_dir() and any(path.name != RUN_LOCK for path in folder.iterdir()):
                problems.append(f"{folder} holds files but no {RUN_RECORD}: {plan.source} did not start it.")
                continue
            status = "pending"
        else:
            different = differences(comparable(saved), run.key)
            if different:
                details = ", ".join(f"{key}: there {old!r}, planned {new!r}" for key, (old, new) in different.items())
                problems.append(f"{folder} holds a run with other settings ({details}).")
                continue
        statuses[run.configuration, run.seed] = status
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise RecipeError(
            f"The folder {plan.root} holds runs that do not belong to {plan.source}:\n  {shown}\n"
            "Use another --output_dir (or move those folders away): runs of different settings are not mixed."
        )
    return statuses
