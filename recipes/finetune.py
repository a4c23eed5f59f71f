#!/usr/bin/env python
"""Fine-tune a model with hf_neural_attn's attention patch, and evaluate it: causal LM (WikiText), GLUE, CIFAR.

Run from the repository root, as a module:

    accelerate launch -m recipes.finetune --model_name_or_path gpt2 --task clm --scorer qana --h 4
    accelerate launch -m recipes.finetune recipes/configs/qana_gpt2_sst2.yaml
    python -m recipes.finetune --help
    accelerate launch -m recipes.compare                     # the offline demo: baseline vs QANA, side by side
    python -m recipes.sweep --config recipes/sweeps/qana_ablations.yaml --grid reduced   # ablations over seeds

The flags follow the Hugging Face ``*_no_trainer.py`` example scripts; ``docs/recipes.md`` has the full guide.
A run writes to ``--output_dir``: the model (loadable with ``hf_neural_attn.from_pretrained``), its tokenizer or
image processor, ``all_results.json``, ``training_history.json``, a model card ``README.md`` and
``training_curves.png``; a patched run adds ``scorer_history.json``, ``scorer_history.png`` and
``attention_maps.png`` (see ``recipes/scorer_plots.py``); ``--checkpointing_steps`` adds resumable ``step_N`` /
``epoch_N`` checkpoints.
"""

from __future__ import annotations

import sys

from recipes.args import build_parser, parse_args
from recipes.errors import RecipeError, refuse
from recipes.training import run


def main(argv: list[str] | None = None) -> int:
    """Command-line entry. Without arguments it prints the usage (the offline demo is recipes/compare.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        build_parser().print_usage(sys.stderr)
        print(
            "finetune.py: give the run's flags or a config file (--help lists them); "
            "`accelerate launch -m recipes.compare` runs the offline demo.",
            file=sys.stderr,
        )
        return 2
    try:
        run(parse_args(argv))
    except RecipeError as error:
        return refuse("finetune.py", error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
