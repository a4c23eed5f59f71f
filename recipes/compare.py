#!/usr/bin/env python
"""Baseline and patched, the way the papers report them: the same data, seed and budget, one table, one plot.

Run from the repository root, as a module:

    accelerate launch -m recipes.compare                     # the offline demo (recipes/configs/demo_offline.yaml)
    accelerate launch -m recipes.compare --model_name_or_path gpt2 --task clm --scorer qana --h 4 \\
        --max_train_steps 2000 --eval_steps 250 --output_dir outputs/compare-gpt2-qana

takes the flags of ``recipes.finetune`` and runs it twice: once unpatched (``--scorer none``, patch flags dropped)
into ``<output_dir>/baseline``, once as given into ``<output_dir>/<scorer>``. Then it writes
``<output_dir>/comparison.md`` (a markdown table: metrics, parameters added, change against the baseline, then the
patched run's scorer history and attention maps) and ``<output_dir>/comparison.png`` (both evaluation curves) and
prints the table. A relative change of the primary metric smaller than ``--no_difference_below`` percent (default
1.0) is reported as "no difference": below the spread that seeds and summation order alone give (see
``docs/recipes.md``).

``--seeds N`` (N >= 2) repeats both runs with seeds ``seed, seed+1, ..., seed+N-1`` into
``<output_dir>/seed_<s>/baseline`` and ``<output_dir>/seed_<s>/<scorer>``; the table then shows every metric as mean
± standard deviation over the seeds and the paired difference patched − baseline (seed by seed) with its 95 %
confidence interval, called larger than the seed noise only when the interval excludes 0 (``recipes/stats.py``);
the plot shows the mean curves with min–max bands.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path
from typing import Any

from recipes import report
from recipes.args import RecipeError, parse_args, patch_settings
from recipes.finetune import run
from recipes.tasks import get_task

logger = logging.getLogger("recipes")

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo_offline.yaml"
# A relative change (percent) of the primary metric below this is reported as no difference: the offline demo's
# baseline reached perplexities 0.83% apart with seeds 42, 43 and 44 (docs/recipes.md).
NO_DIFFERENCE_BELOW = 1.0


def baseline_args(args: argparse.Namespace) -> argparse.Namespace:
    """The same run without the patch: --scorer none, every patch setting, the gate schedule and the scorer learning
    rate unset."""
    base = copy.deepcopy(args)
    for name in patch_settings():
        setattr(base, name, None)
    base.scorer = "none"
    base.scorer_learning_rate = None
    base.train_only_new_params = False
    base.gate_schedule = "learned"
    base.gate_warmup_steps = None
    return base


def compare(
    args: argparse.Namespace, no_difference_below: float = NO_DIFFERENCE_BELOW, seeds: int = 1
) -> list[dict[str, Any]]:
    """Run baseline and patched with ``args``, for ``seeds`` seeds from ``args.seed`` on; write and print the
    comparison. Returns every run's results (``label``, ``seed``, ``patch``, ``results``, ``history``), seed by
    seed, baseline first."""
    if args.scorer == "none":
        raise RecipeError(
            "compare.py runs the baseline itself: give the patched run's flags (--scorer qana or neural)."
        )
    if args.push_to_hub:
        raise RecipeError("compare.py does not upload; push one run with recipes.finetune --push_to_hub.")
    if seeds < 1:
        raise RecipeError(f"--seeds must be at least 1, got {seeds}.")
    root = Path(args.output_dir)
    seed_list = [args.seed + offset for offset in range(seeds)]
    results = []
    for seed in seed_list:
        # One seed: <output_dir>/baseline and <output_dir>/<scorer>, as always; several: one folder per seed.
        folder = root if seeds == 1 else root / f"seed_{seed}"
        base = baseline_args(args)
        base.seed, base.output_dir = seed, str(folder / "baseline")
        patched = copy.deepcopy(args)
        patched.seed, patched.output_dir = seed, str(folder / args.scorer)
        for label, run_args in (("baseline", base), (args.scorer, patched)):
            outcome = run(run_args)
            results.append(
                {
                    "label": label,
                    "seed": seed,
                    "output_dir": run_args.output_dir,
                    "patch": report.describe_patch(outcome["patch"]),
                    "results": outcome,
                    "history": outcome["history"],
                }
            )

    from accelerate import PartialState

    if PartialState().is_main_process:
        if seeds == 1:
            write_single_seed(args, root, results, no_difference_below)
        else:
            write_seeds(args, root, results, seed_list)
    return results


def write_single_seed(
    args: argparse.Namespace, root: Path, results: list[dict[str, Any]], no_difference_below: float
) -> None:
    """comparison.md and comparison.png of one baseline and one patched run."""
    task = get_task(args.task)
    metrics = task.metric_names()
    table = report.comparison_table(results, metrics, task.greater_is_better, no_difference_below)
    header = (
        f"# {args.task}: baseline vs {report.describe_patch(results[1]['results']['patch'])}\n\n"
        f"Same data, seed ({args.seed}) and budget ({results[0]['results']['train_steps']} steps, total batch "
        f"{results[0]['results']['total_train_batch_size']}); model {results[0]['results']['model_source']}.\n\n"
    )
    patched_dir = Path(results[1]["output_dir"]).resolve().relative_to(root.resolve())
    pictures = report.scorer_section(results[1]["results"].get("plots"), prefix=f"{patched_dir.as_posix()}/")
    note = report.no_difference_note(no_difference_below)
    (root / report.COMPARISON_TABLE).write_text(
        header + table + f"\n{note}\n\n![evaluation curves]({report.COMPARISON_PLOT})\n" + pictures
    )
    report.plot_comparison(
        results,
        task.primary_metric,
        root / report.COMPARISON_PLOT,
        f"{args.task}: evaluation {task.primary_metric}",
    )
    print("\n" + table)
    print(note)
    print(f"Wrote {root / report.COMPARISON_TABLE} and {root / report.COMPARISON_PLOT}")


def write_seeds(args: argparse.Namespace, root: Path, results: list[dict[str, Any]], seeds: list[int]) -> None:
    """comparison.md (mean ± std over seeds, the paired difference with its confidence interval, one row per
    seed) and comparison.png (mean curves, min–max bands) of runs repeated over several seeds."""
    task = get_task(args.task)
    metrics = task.metric_names()
    groups = []
    for label in ("baseline", args.scorer):
        runs = [entry for entry in results if entry["label"] == label]
        groups.append(
            {
                "label": label,
                "patch": runs[0]["patch"],
                "runs": [entry["results"] for entry in runs],
                "histories": [entry["history"] for entry in runs],
            }
        )
    table = report.seeds_comparison_table(groups, metrics, task.greater_is_better)
    first = results[0]["results"]
    header = (
        f"# {args.task}: baseline vs {report.describe_patch(results[1]['results']['patch'])}, {len(seeds)} seeds\n\n"
        f"Same data and budget ({first['train_steps']} steps, total batch {first['total_train_batch_size']}) for "
        f"every run, seeds {', '.join(map(str, seeds))}; model {first['model_source']}.\n\n"
    )
    note = report.seeds_note(seeds)
    per_seed = report.per_seed_table(groups, seeds, task.primary_metric)
    patched_dir = Path(results[1]["output_dir"]).resolve().relative_to(root.resolve())
    pictures = report.scorer_section(results[1]["results"].get("plots"), prefix=f"{patched_dir.as_posix()}/")
    if pictures:
        pictures = pictures.replace("## What the new scorers do", f"## What the new scorers do (seed {seeds[0]})", 1)
    (root / report.COMPARISON_TABLE).write_text(
        header
        + table
        + f"\n{note}\n\n## Per seed\n\n{per_seed}\n![evaluation curves]({report.COMPARISON_PLOT})\n"
        + pictures
    )
    report.plot_comparison_seeds(
        groups, task.primary_metric, root / report.COMPARISON_PLOT, f"{args.task}: evaluation {task.primary_metric}"
    )
    print("\n" + table)
    print(note)
    print(f"Wrote {root / report.COMPARISON_TABLE} and {root / report.COMPARISON_PLOT}")


def run_demo(
    extra: list[str] | None = None, no_difference_below: float = NO_DIFFERENCE_BELOW, seeds: int = 1
) -> list[dict[str, Any]]:
    """The offline demo: a small GPT-2-shaped model, ByT5's byte tokenizer, Python's own documentation."""
    args = parse_args(["--config", str(DEMO_CONFIG), *(extra or [])], output_dir_template="demo")
    return compare(args, no_difference_below, seeds)


def main(argv: list[str] | None = None) -> int:
    """No arguments: the offline demo. Otherwise finetune's flags, plus --no_difference_below and --seeds."""
    argv = sys.argv[1:] if argv is None else list(argv)
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--no_difference_below", type=float, default=NO_DIFFERENCE_BELOW)
    own.add_argument("--seeds", type=int, default=1)
    known, argv = own.parse_known_args(argv)
    try:
        if known.no_difference_below < 0:
            raise RecipeError(f"--no_difference_below must be >= 0, got {known.no_difference_below}.")
        if known.seeds < 1:
            raise RecipeError(f"--seeds must be at least 1, got {known.seeds}.")
        if not argv:
            run_demo(no_difference_below=known.no_difference_below, seeds=known.seeds)
        else:
            args = parse_args(argv, output_dir_template="compare-{task}-{scorer}")
            compare(args, known.no_difference_below, known.seeds)
    except RecipeError as error:
        print(f"compare.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
