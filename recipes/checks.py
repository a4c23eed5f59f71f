"""The checks of a run's settings that need no model and no data: bad input fails here, before anything is loaded.

:func:`validate_args` runs them all on a parsed run (``recipes.args.parse_args`` and ``parse_values`` call it): the
types and choices of values from config files, the flags that go together, the numbers, the scorer's options and
the gate schedule. The checks of the data flags that depend on the task are the task's own
(``recipes.tasks.check_args``).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from hf_neural_attn.scorers import SCORERS as SCORER_REGISTRY
from recipes import qlora, tasks
from recipes.errors import RecipeError
from recipes.patch_flags import (
    BASELINE,
    describe_gated_scorers,
    parse_bool,
    scorer_flags,
    scorer_has_gates,
    scorer_options,
)

# Flags that count something: at least 1 (the first always has a value; the others may be unset).
COUNT_FLAGS = (
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "num_train_epochs",
    "logging_steps",
    "max_seq_length",
)
OPTIONAL_COUNT_FLAGS = (
    "max_train_steps",
    "eval_steps",
    "attention_map_tokens",
    "block_size",
    "stride",
    "train_stride",
    "max_train_samples",
    "max_eval_samples",
    "checkpoints_total_limit",
)
# Flags that take a rate or a factor: a finite number, at least 0 (--max_grad_norm 0 turns clipping off).
NON_NEGATIVE_FLAGS = ("learning_rate", "scorer_learning_rate", "min_learning_rate", "weight_decay", "max_grad_norm")


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every check that needs no model or data; ``parser`` is the one that parsed ``args`` (its ``recipe_flags``
    declare each flag's type and choices). Normalises ``layers``, ``attention_map_layer`` and
    ``checkpointing_steps`` on the way."""
    _check_types_and_choices(args, parser)
    args.layers = parse_layers(args.layers)
    check_harness_args(args)
    if args.push_to_hub and not args.hub_model_id:
        raise RecipeError("--push_to_hub needs --hub_model_id (the repository to upload to, e.g. user/model-name).")
    tasks.check_args(args)
    if (args.train_file or args.train_dir) and args.dataset_name:
        raise RecipeError("Give either --dataset_name or local data (--train_file / --train_dir), not both.")
    _check_model_source(args)
    _check_numbers(args)
    _check_rates(args)
    _check_training_state(args)
    _check_patch(args)
    _check_gate_schedule(args)
    qlora.check_args(args)


def _check_model_source(args: argparse.Namespace) -> None:
    """One source of the model: pretrained, or built from scratch from a config or a model type."""
    if args.model_name_or_path and (args.config_name or args.model_type):
        raise RecipeError("--model_name_or_path loads a pretrained model; drop --config_name/--model_type.")
    if args.config_name and args.model_type:
        raise RecipeError("Give --config_name or --model_type, not both.")
    if args.config_overrides and args.model_name_or_path:
        raise RecipeError("--config_overrides only applies to models built from scratch (--config_name/--model_type).")


def _check_numbers(args: argparse.Namespace) -> None:
    """Counts, sizes and percentages in their ranges."""
    for name in COUNT_FLAGS:
        if getattr(args, name) < 1:
            raise RecipeError(f"--{name} must be at least 1, got {getattr(args, name)}.")
    if args.attention_map_layer is not None:
        value = str(args.attention_map_layer).strip().lower()
        try:
            args.attention_map_layer = "none" if value == "none" else int(value)
        except ValueError as error:
            raise RecipeError(
                f"--attention_map_layer must be a layer index or 'none', got {args.attention_map_layer!r}."
            ) from error
    for name in OPTIONAL_COUNT_FLAGS:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise RecipeError(f"--{name} must be at least 1, got {value}.")
    for name in ("num_warmup_steps", "preprocessing_num_workers"):  # 0 workers: datasets' map in this process
        value = getattr(args, name)
        if value is not None and value < 0:
            raise RecipeError(f"--{name} must be >= 0, got {value}.")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise RecipeError(f"--{name} must be in [0, 1), got {getattr(args, name)}.")
    if args.block_size and args.stride and args.stride > args.block_size:
        raise RecipeError(
            f"--stride {args.stride} is larger than --block_size {args.block_size}: tokens would be skipped."
        )
    if args.validation_split_percentage is not None and not 0 < args.validation_split_percentage < 100:
        raise RecipeError("--validation_split_percentage must be between 1 and 99.")
    if args.validation_split_seed is not None and not 0 <= args.validation_split_seed < 2**32:
        raise RecipeError(f"--validation_split_seed must be in [0, 2**32), got {args.validation_split_seed}.")
    if not 0 <= args.seed < 2**32:  # numpy's generator takes no other seed
        raise RecipeError(f"--seed must be in [0, 2**32), got {args.seed}.")


def _check_rates(args: argparse.Namespace) -> None:
    """Learning rates, weight decay and the clipping norm: finite and not negative (AdamW refuses a negative rate
    only once the model has loaded; a negative norm would flip every gradient), and a cosine that decays to at most
    where it starts."""
    for name in NON_NEGATIVE_FLAGS:
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise RecipeError(f"--{name} must be a finite number >= 0, got {value}.")
    if (args.min_learning_rate is None) != (args.lr_scheduler_type != "cosine_with_min_lr"):
        raise RecipeError(
            "--lr_scheduler_type cosine_with_min_lr needs --min_learning_rate (the rate it decays to), and "
            f"--min_learning_rate needs that scheduler (got {args.lr_scheduler_type})."
        )
    if args.min_learning_rate is not None and not args.min_learning_rate <= args.learning_rate:
        # The schedule scales every rate by a factor falling from 1 to min/learning_rate: above 1, it would rise.
        raise RecipeError(
            f"--min_learning_rate {args.min_learning_rate} is above --learning_rate {args.learning_rate}: the cosine "
            "decays from --learning_rate to --min_learning_rate, so give a smaller one (e.g. a tenth of it)."
        )
    if args.min_learning_rate is not None and args.learning_rate == 0:
        raise RecipeError("--lr_scheduler_type cosine_with_min_lr decays --learning_rate: it must be above 0.")


def _check_training_state(args: argparse.Namespace) -> None:
    """--checkpointing_steps and --resume_from_checkpoint."""
    if args.checkpointing_steps is not None:
        value = str(args.checkpointing_steps)
        if value != "epoch" and not (value.isdigit() and int(value) > 0):
            raise RecipeError(f"--checkpointing_steps must be a positive integer or 'epoch', got {value!r}.")
        args.checkpointing_steps = value
    resume = args.resume_from_checkpoint
    if resume and resume != "latest" and not os.path.isdir(resume):
        raise RecipeError(f"--resume_from_checkpoint {args.resume_from_checkpoint} is not a folder.")


def _check_patch(args: argparse.Namespace) -> None:
    """The baseline takes no patch options; a scorer's options must make its config."""
    given_options = {name for name in scorer_flags() if getattr(args, name) is not None}
    if args.scorer == BASELINE:
        # Run-time options (--impl) also suit an already patched checkpoint, as --train_only_new_params and
        # --scorer_learning_rate do; whether there is a patch is checked once the model is loaded
        # (modeling.build_model).
        given = sorted(name for name in given_options if not scorer_flags()[name].runtime)
        given += ["layers"] if args.layers is not None else []
        if given:
            raise RecipeError(f"--scorer none (the baseline) takes no patch options, got {given}.")
        return
    try:
        SCORER_REGISTRY[args.scorer].config_class.from_options(scorer_options(args))
    except ValueError as error:
        raise RecipeError(f"Invalid patch options for --scorer {args.scorer}: {error}") from error


def _check_gate_schedule(args: argparse.Namespace) -> None:
    """--gate_schedule and --gate_warmup_steps fit together and the patch has gates to hold."""
    schedule, steps = args.gate_schedule, args.gate_warmup_steps
    if schedule == "warmup":
        if steps is None or steps < 1:
            raise RecipeError(
                f"--gate_schedule warmup needs --gate_warmup_steps N > 0 (the optimizer steps over which alpha "
                f"rises from 0 to 1), got {steps}."
            )
    elif steps is not None:
        raise RecipeError(f"--gate_warmup_steps is for --gate_schedule warmup only (got --gate_schedule {schedule}).")
    if schedule == "learned":
        return
    if args.scorer == BASELINE:
        raise RecipeError(
            f"--gate_schedule {schedule} holds the scorers' gates, and --scorer none (the baseline) has no scorer: "
            f"pass {describe_gated_scorers(as_flags=True)}."
        )
    if scorer_has_gates(args.scorer, scorer_options(args)) is False:
        raise RecipeError(
            f"--gate_schedule {schedule} holds the scorers' gates alpha, but --scorer {args.scorer} with these options "
            f"({scorer_options(args) or 'defaults'}) has none (only {describe_gated_scorers()}, do). "
            "Drop --gate_schedule or use a gated scorer."
        )


def _check_types_and_choices(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """argparse checks ``choices`` only on the command line; values from a config file are checked here."""
    for dest, declared in parser.recipe_flags.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if declared.get("action") == "store_true" or declared.get("type") is parse_bool:
            if not isinstance(value, bool):
                raise RecipeError(f"{dest} must be true or false, got {value!r}.")
            continue
        kind = declared.get("type")
        if kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RecipeError(f"{dest} must be a number, got {value!r}.")
            if kind is int and not float(value).is_integer():
                raise RecipeError(f"{dest} must be an integer, got {value!r}.")
            value = kind(value)
        elif kind is str and not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)  # e.g. checkpointing_steps: 500 in a YAML file
            elif dest != "layers":  # layers may be a list, parsed by parse_layers
                raise RecipeError(f"{dest} must be a string, got {value!r}.")
        setattr(args, dest, value)
        choices = declared.get("choices")
        if choices is not None and value not in choices:
            raise RecipeError(f"{dest}={value!r} is not one of {list(choices)}.")


def harness_tasks(args: argparse.Namespace) -> list[str]:
    """The lm-evaluation-harness tasks of ``--lm_eval_tasks`` (empty without it)."""
    return [name.strip() for name in (args.lm_eval_tasks or "").split(",") if name.strip()]


def check_harness_args(args: argparse.Namespace) -> None:
    """The --lm_eval_* flags: a causal LM, an existing task folder, a positive limit, the harness installed."""
    harness = harness_tasks(args)
    others = [flag for flag in ("lm_eval_include_path", "lm_eval_limit", "lm_eval_batch_size") if getattr(args, flag)]
    if not harness:
        if others:
            raise RecipeError(f"--{others[0]} applies to --lm_eval_tasks, which names no task.")
        return
    evaluable = tasks.harness_task_names()
    if args.task not in evaluable:
        raise RecipeError(
            f"--lm_eval_tasks evaluates causal language models (--task {'/'.join(evaluable)}); --task {args.task} "
            "has its own metrics."
        )
    if args.lm_eval_include_path and not os.path.isdir(args.lm_eval_include_path):
        raise RecipeError(f"--lm_eval_include_path {args.lm_eval_include_path} is not a folder of task definitions.")
    if args.lm_eval_limit is not None and args.lm_eval_limit <= 0:
        raise RecipeError(f"--lm_eval_limit must be positive, got {args.lm_eval_limit}.")
    if args.lm_eval_batch_size is not None and args.lm_eval_batch_size < 1:
        raise RecipeError(f"--lm_eval_batch_size must be at least 1, got {args.lm_eval_batch_size}.")
    from recipes.harness import import_harness

    try:
        import_harness()
    except ImportError as error:
        raise RecipeError(str(error)) from error


def parse_layers(value: Any) -> list[int] | None:
    """``None``/``"all"`` -> None (every layer); ``"0,2"``, ``0``, ``[0, 2]`` -> a list of indices."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "all")):
        return None
    if isinstance(value, bool):
        raise RecipeError(f"--layers must be 'all' or layer indices, got {value!r}.")
    if isinstance(value, int):
        return [value]
    items = value if isinstance(value, (list, tuple)) else str(value).replace(" ", "").split(",")
    try:
        return [int(item) for item in items]
    except (TypeError, ValueError) as error:
        raise RecipeError(
            f"--layers must be 'all' or comma-separated layer indices like 0,1; got {value!r}."
        ) from error
