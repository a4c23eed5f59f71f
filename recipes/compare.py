#!/usr/bin/env python
"""Baseline and patched, the way the papers report them: the same data, seed and budget, one table, one plot.

    accelerate launch recipes/compare.py --model_name_or_path gpt2 --task clm --scorer qana --h 4 \\
        --max_train_steps 2000 --eval_steps 250 --output_dir outputs/compare-gpt2-qana

takes the flags of ``finetune.py`` and runs it twice: once unpatched (``--scorer none``, patch flags dropped)
into ``<output_dir>/baseline``, once as given into ``<output_dir>/<scorer>``. Then it writes
``<output_dir>/comparison.md`` (a markdown table: metrics, parameters added, change against the baseline, then the
patched run's scorer history and attention maps) and ``<output_dir>/comparison.png`` (both evaluation curves) and
prints the table.

With no arguments it runs the offline demo ``recipes/configs/demo_offline.yaml`` (also what
``finetune.py`` does with no arguments).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the sibling modules as the `recipes` package
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import copy
import logging
from typing import Any

from recipes import report
from recipes.args import RecipeError, parse_args
from recipes.tasks import get_task

logger = logging.getLogger("recipes")

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo_offline.yaml"
PATCH_FLAGS = ("h", "layers", "proj_dim", "mode", "depth", "activation", "scorer_init", "impl", "scorer_learning_rate")


def baseline_args(args: argparse.Namespace) -> argparse.Namespace:
    """The same run without the patch."""
    base = copy.deepcopy(args)
    base.scorer = "none"
    for name in PATCH_FLAGS:
        setattr(base, name, None)
    base.train_only_new_params = False
    return base


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run baseline and patched with ``args``; write and print the comparison. Returns both runs' results."""
    from recipes.finetune import run

    if args.scorer == "none":
        raise RecipeError(
            "compare.py runs the baseline itself: give the patched run's flags (--scorer qana or neural)."
        )
    if args.push_to_hub:
        raise RecipeError("compare.py does not upload; push one run with finetune.py --push_to_hub.")
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
    table = report.comparison_table(results, metrics, task.greater_is_better)
    from accelerate import PartialState

    if PartialState().is_main_process:
        header = (
            f"# {args.task}: baseline vs {report.describe_patch(results[1]['results']['patch'])}\n\n"
            f"Same data, seed ({args.seed}) and budget ({results[0]['results']['train_steps']} steps, total batch "
            f"{results[0]['results']['total_train_batch_size']}); model {results[0]['results']['model_source']}.\n\n"
        )
        patched_dir = Path(patched.output_dir).resolve().relative_to(root.resolve())
        pictures = report.scorer_section(results[1]["results"].get("plots"), prefix=f"{patched_dir.as_posix()}/")
        (root / report.COMPARISON_TABLE).write_text(
            header + table + f"\n![evaluation curves]({report.COMPARISON_PLOT})\n" + pictures
        )
        report.plot_comparison(
            results,
            task.primary_metric,
            root / report.COMPARISON_PLOT,
            f"{args.task}: evaluation {task.primary_metric}",
        )
        print("\n" + table)
        print(f"Wrote {root / report.COMPARISON_TABLE} and {root / report.COMPARISON_PLOT}")
    return results


def run_demo(extra: list[str] | None = None) -> list[dict[str, Any]]:
    """The offline demo: a small GPT-2-shaped model, ByT5's byte tokenizer, Python's own documentation."""
    args = parse_args(["--config", str(DEMO_CONFIG), *(extra or [])], output_dir_template="demo")
    return compare(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not argv:
            run_demo()
        else:
            compare(parse_args(argv, output_dir_template="compare-{task}-{scorer}"))
    except RecipeError as error:
        print(f"compare.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
