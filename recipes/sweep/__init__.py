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
  budget, so that each configuration is compared seed by seed (paired) with its baseline; an axis value that sets
  ``scorer: none`` is then a *control* (more steps, ``--widen_mlp``), paired with the base's baseline;
* ``compare``: more pairs, ``[{configuration: <run name>, against: <run name>}, ...]``; ``correction: holm`` reads
  every comparison (each configuration against its baseline, then these) as one family, Holm-corrected;
* ``description``: free text for ``SUMMARY.md``;
* ``reduced``: any of the above (except ``reduced``), used instead with ``--grid reduced``: ``base`` keys are
  merged into ``base``; ``axes`` replaces the listed axes' values (``null`` drops an axis), the others stay;
  ``seeds: N`` where the full grid lists seeds takes the first N of them.

Flags after ``--config`` on the command line override ``base`` for every run (giving a model or data source
replaces the config's: ``--model_name_or_path`` drops ``model_type``/``config_name``/``config_overrides``,
``--dataset_name``/``--train_file`` drop the config's data flags); a flag an axis sweeps cannot be given there.
The whole plan -- every run's flags, through the recipes' own argument checks, and every run folder already
there -- is checked before the first run starts.

Each run is ``recipes.training.run`` into ``<output_dir>/<run name>/seed_<s>/`` (run names: ``base``,
``<axis>=<label>``, in a grid ``<axis>=<label>__<axis>=<label>``; baselines ``baseline[__<axis>=<label>]``), with
``--checkpointing_steps`` (default: a quarter of ``--max_train_steps``), ``--checkpoints_total_limit 1`` and
``--resume_from_checkpoint latest``. Rerunning the same command skips finished runs (``all_results.json`` there,
its settings those of the plan), resumes an interrupted one from its newest checkpoint, and refuses a folder
whose recorded settings differ. At the end (or with ``--report_only``) it writes ``sweep.md``, ``sweep.csv``,
``sweep_summary.csv``, ``sweep_comparisons.csv``, ``sweep_history.csv``, ``sweep_<axis>.png`` and ``SUMMARY.md``
(see ``docs/recipes.md``).

``plan.py`` reads and checks the config and every run (:func:`~recipes.sweep.plan.build_plan`), ``run.py`` runs
what is not finished, ``report.py`` writes the report; :func:`main` is the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipes.args import build_parser, split_own_flags
from recipes.config_files import CONFIG_EXTENSIONS
from recipes.errors import RecipeError, refuse
from recipes.sweep.plan import GRIDS, NOT_ACCEPTED_FLAGS, build_plan, check_run_folders, config_parts, read_config
from recipes.sweep.report import SWEEP_TABLE, write_report
from recipes.sweep.run import is_main_process, run_sweep

PROG = "python -m recipes.sweep"
DESCRIPTION = (
    "Run a sweep of recipe runs from a config file (recipes/sweeps/*.yaml). The flags after the sweep's own are "
    "finetune's: given here, they override the config's base for every run."
)


def add_sweep_flags(parser: argparse.ArgumentParser) -> None:
    """The sweep's own flags (the rest are finetune's)."""
    group = parser.add_argument_group("the sweep")
    group.add_argument("--config", required=True, help="The sweep config (YAML or JSON).")
    group.add_argument("--grid", choices=GRIDS, default="full", help="full (as written) or reduced (its reduced:).")
    group.add_argument("--report_only", action="store_true", help="Write the report from the finished runs only.")
    group.add_argument("--dry_run", action="store_true", help="Print the plan and each run's status; run nothing.")


def build_sweep_parser() -> argparse.ArgumentParser:
    """The sweep's command line: its own flags, then finetune's (those it refuses not listed; its --config is the
    sweep's)."""
    return build_parser(
        prog=PROG, description=DESCRIPTION, own_flags=add_sweep_flags, hidden=NOT_ACCEPTED_FLAGS, config_flag=False
    )


def main(argv: list[str] | None = None) -> int:
    """The command line (``python -m recipes.sweep --help``); returns the exit code, 2 for bad input."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0].lower().endswith(CONFIG_EXTENSIONS):
        argv = ["--config", *argv]
    build_sweep_parser().parse_args(argv)  # --help; every flag's name, type and choice, errors in the sweep's name
    known, rest = split_own_flags(argv, PROG, add_sweep_flags)
    try:
        parts = [name for name, _ in config_parts(read_config(Path(known.config)), Path(known.config))]
        for index, part in enumerate(parts):
            try:
                plan = build_plan(known.config, known.grid, rest, part)
            except RecipeError as error:
                if not (known.dry_run and index):
                    raise
                # A later part may build on an earlier one's runs, which a dry run has not made.
                print(f"Part {part!r}: planned once the parts before it have run ({error}).")
                continue
            statuses = check_run_folders(plan)
            print(f"Sweep {plan.name} ({plan.grid} grid, {plan.mode}): {plan.status_line(statuses)}.")
            if known.dry_run:
                for run in plan.runs():
                    print(f"  {statuses[run.configuration, run.seed]:12s} {run.configuration} seed {run.seed}")
                continue
            if not known.report_only:
                run_sweep(plan, statuses)
            if is_main_process():
                written = write_report(plan)
                print((plan.root / SWEEP_TABLE).read_text())
                print("Wrote " + ", ".join(str(path) for path in written.values()))
    except RecipeError as error:
        return refuse("sweep", error)
    return 0
