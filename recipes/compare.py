#!/usr/bin/env python
"""Baseline and patched, the way the papers report them: the same data, seed and budget, one table, one plot.

Run from the repository root, as a module:

    accelerate launch -m recipes.compare                     # the offline demo (recipes/configs/demo_offline.yaml)
    accelerate launch -m recipes.compare --model_name_or_path gpt2 --task clm --scorer qana --h 4 \\
        --max_train_steps 2000 --eval_steps 250 --output_dir outputs/compare-gpt2-qana

takes the flags of ``recipes.finetune`` and runs them as a sweep (``recipes.sweep``) of one configuration paired
with its baseline: once unpatched (``--scorer none``, patch flags dropped) into ``<output_dir>/baseline``, once as
given into ``<output_dir>/<scorer>``. Then it writes ``<output_dir>/comparison.md`` (the sweep's summary table:
primary metric, parameters added, the difference to the baseline and its verdict; then the patched run's scorer
history and attention maps), ``<output_dir>/comparison.png`` (the evaluation curves), the sweep's ``sweep.csv``
and ``sweep_summary.csv`` (every run's metrics), and prints the table. With one seed, a relative change of the
primary metric smaller than ``--no_difference_below`` percent (default 1.0) reads "no difference": below the
spread that seeds and summation order alone give (see ``docs/recipes.md``).

``--seeds N`` (N >= 2) repeats both runs with seeds ``seed, seed+1, ..., seed+N-1`` into
``<output_dir>/seed_<s>/baseline`` and ``<output_dir>/seed_<s>/<scorer>``; the table then shows the metric as mean
± standard deviation over the seeds and the paired difference patched − baseline (seed by seed) with its 95 %
confidence interval, called larger than the seed noise only when the interval excludes 0 (``recipes/stats.py``);
the plot shows the mean curves with min–max bands.

As in a sweep, every run checkpoints and the command can be run again into the same folder: runs that finished
with the same settings are skipped (not retrained), an interrupted one resumes from its newest checkpoint, and a
folder holding a run with other settings stops the comparison before anything runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from recipes.args import build_parser, parse_args, parse_values, public_settings, split_own_flags
from recipes.errors import RecipeError, refuse
from recipes.patch_flags import BASELINE, example_scorers
from recipes.report import (
    HISTORY_FILE,
    RESULTS_FILE,
    describe_patch,
    describe_training,
    plot_evaluation_curves,
    read_json,
    scorer_section,
)
from recipes.sweep.plan import (
    MANAGED_FLAGS,
    NOT_ACCEPTED_FLAGS,
    SweepPlan,
    baseline_flags,
    check_run_folders,
    describe_flags,
    plan_runs,
)
from recipes.sweep.report import markdown_table, summarize, sweep_notes, write_csvs
from recipes.sweep.run import is_main_process, run_sweep

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo_offline.yaml"
COMPARISON_TABLE = "comparison.md"
COMPARISON_PLOT = "comparison.png"
# A relative change (percent) of the primary metric below this reads "no difference" when there is one seed: about
# the seed noise of the offline demo's baseline (docs/recipes.md, "Comparing with the baseline", has the figures).
NO_DIFFERENCE_BELOW = 1.0


def run_flags(args: argparse.Namespace) -> dict[str, Any]:
    """A parsed run's settings as flags (``--config`` already applied, so without it)."""
    return {name: value for name, value in vars(args).items() if name != "config"}


def baseline_args(args: argparse.Namespace) -> argparse.Namespace:
    """The same run without the patch (the sweep's baseline): --scorer none, and every patch setting, the gate
    schedule, the scorer learning rate and --train_only_new_params back to their defaults."""
    return parse_values(baseline_flags(run_flags(args)), source="The baseline of the comparison")


def single_seed_folder(root: Path, configuration: str, seed: int) -> Path:
    """One seed: ``<output_dir>/baseline`` and ``<output_dir>/<scorer>``."""
    return root / configuration


def per_seed_folder(root: Path, configuration: str, seed: int) -> Path:
    """Several seeds: ``<output_dir>/seed_<s>/baseline`` and ``<output_dir>/seed_<s>/<scorer>``."""
    return root / f"seed_{seed}" / configuration


def comparison_plan(
    args: argparse.Namespace, no_difference_below: float = NO_DIFFERENCE_BELOW, seeds: int = 1
) -> SweepPlan:
    """The comparison as a sweep: ``args`` as its one configuration (named after the scorer), paired with its
    baseline, over ``seeds`` seeds from ``args.seed`` on; every run checked, nothing run."""
    if args.scorer == BASELINE:
        raise RecipeError(
            f"compare.py runs the baseline itself: give the patched run's flags (--scorer {example_scorers()})."
        )
    if args.push_to_hub:
        raise RecipeError("compare.py does not upload; push one run with recipes.finetune --push_to_hub.")
    if args.resume_from_checkpoint:
        raise RecipeError(
            "compare.py resumes its runs itself: drop --resume_from_checkpoint and run the same command again."
        )
    if seeds < 1:
        raise RecipeError(f"--seeds must be at least 1, got {seeds}.")
    flags = {name: value for name, value in run_flags(args).items() if name not in MANAGED_FLAGS}
    unpatched = baseline_args(args)
    plan = SweepPlan(
        name="the comparison",
        config_path=None,
        grid="full",
        mode="ablation",
        description="",
        seeds=tuple(args.seed + offset for offset in range(seeds)),
        baseline=True,
        root=Path(args.output_dir),
        axes={},
        base_flags=flags,
        command_line=(),
        base_name=args.scorer,
        base_changes=describe_flags({k: v for k, v in flags.items() if getattr(unpatched, k) != v}),
        run_folder=single_seed_folder if seeds == 1 else per_seed_folder,
        no_difference_below=no_difference_below,
    )
    return plan_runs(plan)


def compare(
    args: argparse.Namespace, no_difference_below: float = NO_DIFFERENCE_BELOW, seeds: int = 1
) -> list[dict[str, Any]]:
    """Run baseline and patched with ``args``, for ``seeds`` seeds from ``args.seed`` on (runs that finished before
    are skipped); write and print the comparison. Returns every run, seed by seed, baseline first: ``label``,
    ``seed``, ``output_dir``, ``action`` (skipped, started or resumed from a checkpoint), ``results`` (its
    all_results.json) and ``history`` (its training history)."""
    plan = comparison_plan(args, no_difference_below, seeds)
    statuses = check_run_folders(plan)
    if is_main_process():
        print(f"Comparison of baseline and {args.scorer}: {plan.status_line(statuses)}.")
    log = run_sweep(plan, statuses)
    if is_main_process():
        write_comparison(plan)
    return [
        {
            "label": entry["configuration"],
            "seed": entry["seed"],
            "output_dir": entry["output_dir"],
            "action": entry["action"],
            "results": read_json(Path(entry["output_dir"]) / RESULTS_FILE),
            "history": read_json(Path(entry["output_dir"]) / HISTORY_FILE),
        }
        for entry in log
    ]


def write_comparison(plan: SweepPlan) -> None:
    """comparison.md (the sweep's summary table with its notes, the curves, the patched run's scorer pictures),
    comparison.png (the evaluation curves; mean and min–max band over several seeds), sweep.csv and
    sweep_summary.csv of a finished comparison; prints the table."""
    summary = summarize(plan)
    baseline, patched = plan.configurations  # a sweep lists its baselines first
    first = summary.found[patched.name][plan.seeds[0]]
    several = len(plan.seeds) > 1
    task = first["task"]
    header = (
        f"# {task}: baseline vs {describe_patch(first['patch'])}{f', {len(plan.seeds)} seeds' if several else ''}\n\n"
        f"Same data and budget ({first['train_steps']} steps, total batch {first['total_train_batch_size']}) for "
        f"every run, seed{'s' if several else ''} {', '.join(map(str, plan.seeds))}; model {first['model_source']}."
        "\n\n"
    )
    header += how_trained(plan)
    table = markdown_table(plan, summary)
    notes = sweep_notes(plan)
    patched_dir = patched.runs[0].output_dir.resolve().relative_to(plan.root.resolve())
    pictures = scorer_section(first.get("plots"), prefix=f"{patched_dir.as_posix()}/")
    if pictures and several:
        pictures = pictures.replace("## What the new scorers do", f"## What the new scorers do (seed {plan.seeds[0]})")
    (plan.root / COMPARISON_TABLE).write_text(
        header + table + f"\n{notes}\n![evaluation curves]({COMPARISON_PLOT})\n" + pictures
    )
    histories = {
        configuration.name: [read_json(run.output_dir / HISTORY_FILE) for run in configuration.runs]
        for configuration in (baseline, patched)
    }
    title = f"{task}: evaluation {summary.metric}"
    plot_evaluation_curves(histories, summary.metric, plan.root / COMPARISON_PLOT, title)
    write_csvs(plan, summary)
    print("\n" + how_trained(plan) + table)
    print(notes)
    print(f"Wrote {plan.root / COMPARISON_TABLE}, {plan.root / COMPARISON_PLOT} and the sweep's CSV files")


def how_trained(plan: SweepPlan) -> str:
    """What each run of the comparison trained, on which base's weights: a list in Markdown."""
    lines = [
        f"* `{configuration.name}` trained {describe_training(public_settings(configuration.runs[0].args))}.\n"
        for configuration in plan.configurations
    ]
    return "".join(lines) + "\n"


def run_demo(
    extra: list[str] | None = None, no_difference_below: float = NO_DIFFERENCE_BELOW, seeds: int = 1
) -> list[dict[str, Any]]:
    """The offline demo: a small GPT-2-shaped model, ByT5's byte tokenizer, Python's own documentation."""
    args = parse_args(["--config", str(DEMO_CONFIG), *(extra or [])], output_dir_template="demo")
    return compare(args, no_difference_below, seeds)


PROG = "compare.py"
DESCRIPTION = (
    "Run the unpatched baseline and the patched model with the same data, seed and budget, and write one table "
    "and one plot (comparison.md, comparison.png). With no arguments: the offline demo. The flags after the "
    "comparison's own are finetune's, for the patched run (the baseline drops the patch flags)."
)


def add_comparison_flags(parser: argparse.ArgumentParser) -> None:
    """compare.py's own flags (the rest are finetune's)."""
    group = parser.add_argument_group("the comparison")
    group.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="Run baseline and patched for seeds --seed, --seed+1, ... (N of them); with N >= 2 the table shows "
        "mean ± std and the paired difference with its 95%% interval.",
    )
    group.add_argument(
        "--no_difference_below",
        type=float,
        default=NO_DIFFERENCE_BELOW,
        help="With one seed: a relative change of the primary metric below this many percent reads "
        f"'no difference' (default {NO_DIFFERENCE_BELOW}).",
    )


def build_compare_parser() -> argparse.ArgumentParser:
    """compare.py's command line: its own flags, then finetune's (those it refuses not listed)."""
    return build_parser(prog=PROG, description=DESCRIPTION, own_flags=add_comparison_flags, hidden=NOT_ACCEPTED_FLAGS)


def main(argv: list[str] | None = None) -> int:
    """No arguments: the offline demo. Otherwise finetune's flags, plus --no_difference_below and --seeds."""
    argv = sys.argv[1:] if argv is None else list(argv)
    known, rest = split_own_flags(argv, PROG, add_comparison_flags)
    try:
        if known.no_difference_below < 0:
            raise RecipeError(f"--no_difference_below must be >= 0, got {known.no_difference_below}.")
        if known.seeds < 1:
            raise RecipeError(f"--seeds must be at least 1, got {known.seeds}.")
        if not rest:
            run_demo(no_difference_below=known.no_difference_below, seeds=known.seeds)
        else:
            args = parse_args(argv, output_dir_template="compare-{task}-{scorer}", parser=build_compare_parser())
            for name in vars(known):  # the comparison's own flags are not run settings
                delattr(args, name)
            compare(args, known.no_difference_below, known.seeds)
    except RecipeError as error:
        return refuse("compare.py", error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
