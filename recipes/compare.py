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
    """The same run without the patch: --scorer none, every patch setting and the scorer learning rate unset."""
    base = copy.deepcopy(args)
    for name in patch_settings():
        setattr(base, name, None)
    base.scorer = "none"
    base.scorer_learning_rate = None
    base.train_only_new_params = False
    return base


def compare(args: argparse.Namespace, no_difference_below: float = NO_DIFFERENCE_BELOW) -> list[dict[str, Any]]:
    """Run baseline and patched with ``args``; write and print the comparison. Returns both runs' results."""
    if args.scorer == "none":
        raise RecipeError(
            "compare.py runs the baseline itself: give the patched run's flags (--scorer qana or neural)."
        )
    if args.push_to_hub:
        raise RecipeError("compare.py does not upload; push one run with recipes.finetune --push_to_hub.")
    root = Path(args.output_dir)
    base = baseline_args(args)
    base.output_dir = str(root / "baseline")
    patched = copy.deepcopy(args)
    patched.output_dir = str(root / args.scorer)
    results = []
    for label, run_args in (("baseline", base), (args.scorer, patched)):
        outcome = run(run_args)
        results.append(
            {
                "label": label,
                "patch": report.describe_patch(outcome["patch"]),
                "results": outcome,
                "history": outcome["history"],
            }
        )

    task = get_task(args.task)
    metrics = task.metric_names()
    table = report.comparison_table(results, metrics, task.greater_is_better, no_difference_below)
    from accelerate import PartialState

    if PartialState().is_main_process:
        header = (
            f"# {args.task}: baseline vs {report.describe_patch(results[1]['results']['patch'])}\n\n"
            f"Same data, seed ({args.seed}) and budget ({results[0]['results']['train_steps']} steps, total batch "
            f"{results[0]['results']['total_train_batch_size']}); model {results[0]['results']['model_source']}.\n\n"
        )
        patched_dir = Path(patched.output_dir).resolve().relative_to(root.resolve())
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
    return results


def run_demo(extra: list[str] | None = None, no_difference_below: float = NO_DIFFERENCE_BELOW) -> list[dict[str, Any]]:
    """The offline demo: a small GPT-2-shaped model, ByT5's byte tokenizer, Python's own documentation."""
    args = parse_args(["--config", str(DEMO_CONFIG), *(extra or [])], output_dir_template="demo")
    return compare(args, no_difference_below)


def main(argv: list[str] | None = None) -> int:
    """No arguments: the offline demo. Otherwise finetune's flags, plus --no_difference_below."""
    argv = sys.argv[1:] if argv is None else list(argv)
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--no_difference_below", type=float, default=NO_DIFFERENCE_BELOW)
    known, argv = own.parse_known_args(argv)
    try:
        if known.no_difference_below < 0:
            raise RecipeError(f"--no_difference_below must be >= 0, got {known.no_difference_below}.")
        if not argv:
            run_demo(no_difference_below=known.no_difference_below)
        else:
            args = parse_args(argv, output_dir_template="compare-{task}-{scorer}")
            compare(args, known.no_difference_below)
    except RecipeError as error:
        print(f"compare.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
