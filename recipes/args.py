"""The recipes' command line: Hugging Face example-script flag names, plus the patch's own flags.

:func:`build_parser` declares the flags; :func:`parse_args` parses a command line (and a config file,
``recipes.config_files``), checks it (``recipes.checks``) and fills in the defaults that depend on the task;
:func:`parse_values` does the same for settings given as a mapping (a sweep's runs). The scorer flags are generated
from the scorer configs (``recipes.patch_flags``), the ``--task`` choices from the task registry (``recipes.tasks``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Collection
from typing import Any

from recipes import qlora, tasks
from recipes.checks import validate_args
from recipes.config_files import check_config_values, config_path, load_config_file
from recipes.patch_flags import (
    DEFAULT_SCORER,
    GATE_SCHEDULES,
    SCORERS,
    describe_gated_scorers,
    parse_bool,
    scorer_flags,
)
from recipes.tasks.base import VALIDATION_SPLIT_SEED
from recipes.tasks.clm import EMBEDDED_CORPUS
from recipes.tasks.shakespeare import CORPUS_NAME

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)
# Flags never written into a run's recorded settings (all_results.json, the trackers, the logs).
SECRET_SETTINGS = ("hub_token",)

FINETUNE_DESCRIPTION = (
    "Fine-tune (or train from scratch) a Transformers model with its attention scoring replaced by "
    "hf_neural_attn (QANA or Neural Attention), and evaluate it on WikiText, GLUE or CIFAR. "
    "The offline demo (baseline and patched side by side) is `accelerate launch -m recipes.compare`."
)
AddFlag = Callable[..., Any]


class _FlagRecorder:
    """Adds arguments to a parser or group and records what each flag was declared with, so that config-file
    values can be checked against the same declarations (no argparse internals). Flags in ``hidden`` are parsed
    but not listed in --help: the command refuses them with its own message."""

    def __init__(self, hidden: Collection[str] = ()) -> None:
        self.flags: dict[str, dict[str, Any]] = {}
        self.hidden = set(hidden)

    def adder(self, target) -> AddFlag:
        def add(name: str, **kwargs):
            self.flags[name.lstrip("-")] = kwargs
            if name.lstrip("-") in self.hidden:
                kwargs = {**kwargs, "help": argparse.SUPPRESS}
            return target.add_argument(name, **kwargs)

        return add


def build_parser(
    prog: str = "finetune.py",
    description: str = FINETUNE_DESCRIPTION,
    own_flags: Callable[[argparse.ArgumentParser], None] | None = None,
    hidden: Collection[str] = (),
    config_flag: bool = True,
) -> argparse.ArgumentParser:
    """The recipes' argument parser; ``parser.recipe_flags`` maps each flag (no dashes) to its declaration.

    ``recipes.compare`` and ``recipes.sweep`` pass finetune's flags on to their runs and parse them with this parser
    under their own ``prog`` (so that errors name them), with ``own_flags`` adding their own flags (listed first in
    --help, not in ``recipe_flags``), the finetune flags they refuse ``hidden`` from --help, and for the sweep, whose
    ``--config`` is the sweep's, without finetune's ``--config`` (``config_flag=False``)."""
    recorder = _FlagRecorder(hidden)
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False, description=description)
    parser.recipe_flags = recorder.flags
    if own_flags is not None:
        own_flags(parser)
    if config_flag:
        add = recorder.adder(parser)
        add("--config", type=str, default=None, help="A YAML or JSON file of flag values (keys = flag names).")
    harness_title = f"evaluation with lm-evaluation-harness ({'/'.join(tasks.harness_task_names())})"
    groups = (
        ("task and model", (_task_and_model_flags,)),
        ("data", (_data_flags,)),
        ("training", (_training_flags, _output_flags)),
        (harness_title, (_harness_flags,)),
        ("attention patch (hf_neural_attn)", (_patch_flags,)),
        ("quantized base and LoRA (QLoRA)", (qlora.declare_flags,)),
    )
    for title, declare in groups:
        add = recorder.adder(parser.add_argument_group(title))
        for flags in declare:
            flags(add)
    return parser


def _task_and_model_flags(add: AddFlag) -> None:
    """The task, and where the model comes from."""
    add("--task", type=str, default=tasks.DEFAULT_TASK, choices=tuple(tasks.TASKS), help=f"{tasks.describe_tasks()}.")
    add("--model_name_or_path", type=str, default=None, help="Pretrained model (Hub id or local folder).")
    add("--config_name", type=str, default=None, help="Config (Hub id or folder) to build a model from scratch.")
    add(
        "--model_type",
        type=str,
        default=None,
        help="Model type to build from scratch with its default config (e.g. gpt2, llama, vit).",
    )
    add(
        "--config_overrides",
        type=str,
        default=None,
        help='Override config values of a from-scratch model, e.g. "n_layer=8,n_head=8,n_embd=512".',
    )
    add("--tokenizer_name", type=str, default=None, help="Tokenizer, if not the model's.")
    add("--image_processor_name", type=str, default=None, help="Image processor, if not the model's.")
    add(
        "--ignore_mismatched_sizes",
        action="store_true",
        help="Re-initialise a pretrained head whose shape does not fit the task (e.g. a different label count).",
    )
    add(
        "--widen_mlp",
        type=int,
        default=0,
        help="A capacity control: widen every layer's MLP of the pretrained model by this many hidden units, "
        "function-preserving (new output weights zero), e.g. as many parameters as a patch adds (GPT-2, Llama, Mistral, "
        "Qwen2).",
    )
    add("--cpu", action="store_true", help="Run on CPU even when an accelerator is present.")


def _data_flags(add: AddFlag) -> None:
    """Where the data comes from, and how it is split, cut and preprocessed."""
    add(
        "--dataset_name",
        type=str,
        default=None,
        help=f"Hub dataset (default: per task; see docs/recipes.md), or, for clm, {EMBEDDED_CORPUS} (the demo's text) "
        f"or {CORPUS_NAME} (nanoGPT's shakespeare_char: characters, its split).",
    )
    add("--dataset_config_name", type=str, default=None, help="Dataset config, e.g. wikitext-103-raw-v1.")
    add(
        "--eval_split",
        type=str,
        default=None,
        help="clm and image, Hub datasets: the split to evaluate on (default: validation, else test), e.g. test.",
    )
    add("--train_file", type=str, default=None, help="Training data: a .txt, .csv or .json(l) file.")
    add("--validation_file", type=str, default=None, help="Evaluation data: a .txt, .csv or .json(l) file.")
    add("--validation_mismatched_file", type=str, default=None, help="MNLI only: the mismatched evaluation file.")
    add("--train_dir", type=str, default=None, help="Image task: a folder of class subfolders of images.")
    add("--validation_dir", type=str, default=None, help="Image task: evaluation folder of class subfolders.")
    add("--text_column_name", type=str, default=None, help="clm: the text column (default: text, or the first).")
    add("--sentence1_key", type=str, default=None, help="GLUE: first text column (default: the task's).")
    add("--sentence2_key", type=str, default=None, help="GLUE: second text column (default: the task's).")
    add("--label_column_name", type=str, default=None, help="Label column (default: label).")
    add("--image_column_name", type=str, default=None, help="Image column (default: the dataset's image column).")
    add(
        "--validation_split_percentage",
        type=int,
        default=None,
        help="Percent of the training data held out when there is no validation split (clm 5, GLUE 10, image 15).",
    )
    add(
        "--validation_split_seed",
        type=int,
        default=None,
        help=f"The seed that picks the held-out examples (default {VALIDATION_SPLIT_SEED}, whatever --seed is: runs "
        "with different seeds evaluate on the same examples).",
    )
    add("--max_train_samples", type=int, default=None, help="Truncate the training set (debugging, quick runs).")
    add("--max_eval_samples", type=int, default=None, help="Truncate the evaluation set(s).")
    add("--block_size", type=int, default=None, help="clm: training sequence length and evaluation window.")
    add(
        "--train_stride",
        type=int,
        default=None,
        help="clm training: windows of --block_size start every N tokens of the text (default: --block_size, "
        "non-overlapping blocks, run_clm's way; 1: every offset, nanoGPT's random windows).",
    )
    add("--max_seq_length", type=int, default=128, help="GLUE: maximum tokens per example (truncation).")
    add("--pad_to_max_length", action="store_true", help="GLUE: pad every example to --max_seq_length.")
    add(
        "--stride",
        type=int,
        default=None,
        help="clm evaluation: window stride (default: --block_size, i.e. non-overlapping windows).",
    )
    add(
        "--perplexity_protocol",
        type=str,
        default="sliding",
        choices=("sliding", "full_window"),
        help=(
            "sliding: every token scored once, with up to block_size tokens of context (the standard protocol). "
            "full_window: the Neural Attention authors' protocol, overlapping full windows at --stride, every "
            "prediction of each window scored, perplexity = exp(mean window loss)."
        ),
    )
    add("--preprocessing_num_workers", type=int, default=None, help="Processes for dataset.map.")
    add("--overwrite_cache", action="store_true", help="Do not reuse cached preprocessed datasets.")


def _training_flags(add: AddFlag) -> None:
    """The optimisation: batch sizes, learning rates, steps, schedules; evaluation and checkpoints."""
    add("--output_dir", type=str, default=None, help="Where to write the model, results, card and plot.")
    add("--per_device_train_batch_size", type=int, default=8)
    add("--per_device_eval_batch_size", type=int, default=8)
    add("--learning_rate", type=float, default=5e-5)
    add("--scorer_learning_rate", type=float, default=None, help="Learning rate of the new parameters.")
    add("--weight_decay", type=float, default=0.0)
    add("--adam_beta1", type=float, default=0.9, help="AdamW's beta1.")
    add("--adam_beta2", type=float, default=0.999, help="AdamW's beta2 (nanoGPT's small models use 0.99).")
    add("--num_train_epochs", type=int, default=3)
    add("--max_train_steps", type=int, default=None, help="Total optimizer steps; overrides --num_train_epochs.")
    add("--gradient_accumulation_steps", type=int, default=1)
    add("--lr_scheduler_type", type=str, default="linear", choices=SCHEDULERS)
    add("--num_warmup_steps", type=int, default=0)
    add(
        "--min_learning_rate",
        type=float,
        default=None,
        help="cosine_with_min_lr (and only it, which needs it): the learning rate the cosine decays to, at most "
        "--learning_rate (--scorer_learning_rate decays by the same factor).",
    )
    add("--max_grad_norm", type=float, default=1.0, help="Gradient clipping (0 disables).")
    add(
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute activations in the backward pass (less memory, ~1/3 more compute); non-reentrant.",
    )
    add("--seed", type=int, default=42)
    add("--logging_steps", type=int, default=10, help="Log the training loss every N steps.")
    add(
        "--eval_steps",
        type=int,
        default=None,
        help="Evaluate every N steps (default: at the end of each epoch and of training).",
    )
    add(
        "--eval_at_start",
        action="store_true",
        help="Also evaluate before the first step (a patched model starts where the unpatched one does).",
    )
    add(
        "--checkpointing_steps",
        type=str,
        default=None,
        help="Save the full training state every N steps, or 'epoch' after each epoch.",
    )
    add("--checkpoints_total_limit", type=int, default=None, help="Keep only the newest N checkpoints.")
    add(
        "--resume_from_checkpoint",
        type=str,
        default=None,
        help="A checkpoint folder, or 'latest' for the newest complete one in --output_dir.",
    )


def _output_flags(add: AddFlag) -> None:
    """What a run writes besides the model: attention maps, trackers, the Hub upload."""
    add(
        "--attention_map_layer",
        type=str,
        default=None,
        help=(
            "Patched runs draw attention_maps.png after training: this attention layer's heads, patched beside "
            "unpatched (default: the first patched layer; 'none' draws no maps)."
        ),
    )
    add(
        "--attention_map_tokens",
        type=int,
        default=32,
        help="Text tasks: the attention maps and the scorer history's probe read this many tokens of the first "
        "evaluation example.",
    )
    add("--with_tracking", action="store_true", help="Log to experiment trackers (TensorBoard by default).")
    add("--report_to", type=str, default="tensorboard", help="Tracker(s) for --with_tracking, e.g. tensorboard.")
    add("--push_to_hub", action="store_true", help="Upload the output folder to the Hub at the end.")
    add("--hub_model_id", type=str, default=None, help="Hub repository, e.g. user/gpt2-qana-wikitext2.")
    add("--hub_token", type=str, default=None, help="Hub token (default: the logged-in one).")
    add("--hub_private_repo", action="store_true", help="Create the Hub repository as private.")


def _harness_flags(add: AddFlag) -> None:
    """lm-evaluation-harness on the trained model."""
    add(
        "--lm_eval_tasks",
        type=str,
        default=None,
        help="Comma-separated lm-evaluation-harness tasks run on the trained model at the end, e.g. "
        "wikitext,hellaswag (the harness downloads their data); results go into all_results.json (lm_eval) and the "
        "model card.",
    )
    add(
        "--lm_eval_include_path",
        type=str,
        default=None,
        help="A folder of extra harness task definitions (YAML), e.g. a task over a local file for offline runs.",
    )
    add(
        "--lm_eval_limit",
        type=float,
        default=None,
        help="Harness: evaluate only this many documents per task (a fraction of them if below 1).",
    )
    add(
        "--lm_eval_batch_size",
        type=int,
        default=None,
        help="Harness batch size (default: --per_device_eval_batch_size).",
    )


def _patch_flags(add: AddFlag) -> None:
    """The attention patch: the scorer, its layers, one flag per scorer option, the gate schedule."""
    add("--scorer", type=str, default=DEFAULT_SCORER, choices=SCORERS, help="none = the unpatched baseline.")
    add("--layers", type=str, default=None, help='Layers to patch: "all" (default), or indices like "0" or "0,1".')
    # One flag per scorer option, generated from the scorer configs (hf_neural_attn.scorers.*Config fields).
    for spec in scorer_flags().values():
        kind = parse_bool if spec.type is bool else spec.type
        add(f"--{spec.flag}", type=kind, default=None, choices=spec.choices, help=spec.help)
    add(
        "--train_only_new_params",
        action="store_true",
        help="Freeze the pretrained weights; train the scorers (and a newly initialised task head) only.",
    )
    add(
        "--gate_schedule",
        type=str,
        default="learned",
        choices=GATE_SCHEDULES,
        help=(
            f"The scorers' per-head gates alpha ({describe_gated_scorers()}): learned (default) "
            "trains them like any parameter; fixed holds them at their initial value for the whole run; warmup "
            "holds them at min(1, step / --gate_warmup_steps) for that many optimizer steps, then trains them "
            "from 1 (QANA paper, section 4)."
        ),
    )
    add(
        "--gate_warmup_steps",
        type=int,
        default=None,
        help="--gate_schedule warmup: the optimizer steps over which alpha rises from 0 to 1.",
    )


def split_own_flags(
    argv: list[str], prog: str, own_flags: Callable[[argparse.ArgumentParser], None]
) -> tuple[argparse.Namespace, list[str]]:
    """A command's own flags (``own_flags`` adds them, as for :func:`build_parser`) taken out of ``argv``: their
    values, and the rest of ``argv`` (finetune's flags)."""
    own = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    own_flags(own)
    return own.parse_known_args(argv)


def parse_args(
    argv: list[str] | None = None,
    output_dir_template: str = "{task}-{scorer}",
    parser: argparse.ArgumentParser | None = None,
) -> argparse.Namespace:
    """Parse flags (and a config file), check them, and fill in defaults that depend on the task.

    Without --output_dir, the run writes to ``outputs/<output_dir_template>`` (formatted with the flags). ``parser``:
    :func:`build_parser`'s (default: finetune's).
    """
    parser = parser or build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    path = config_path(argv)
    if path is not None:
        parser.set_defaults(**load_config_file(path, parser))
    args = parser.parse_args(argv)
    args.config = path
    validate_args(args, parser)
    if args.output_dir is None:
        args.output_dir = os.path.join("outputs", output_dir_template.format(**vars(args)))
    return args


def parse_values(
    values: dict[str, Any], source: str = "the settings", output_dir_template: str = "{task}-{scorer}"
) -> argparse.Namespace:
    """Like :func:`parse_args` with ``values`` as the config file and no command line: the same key, type, choice
    and consistency checks (``recipes.sweep`` parses every run of a sweep this way before starting any).
    ``source`` names where the values came from, for the error messages."""
    parser = build_parser()
    parser.set_defaults(**check_config_values(dict(values), parser, source))
    args = parser.parse_args([])
    args.config = None
    validate_args(args, parser)
    if args.output_dir is None:
        args.output_dir = os.path.join("outputs", output_dir_template.format(**vars(args)))
    return args


_NOT_GIVEN = object()


def given_flags(argv: list[str]) -> dict[str, Any]:
    """The recipe flags given in ``argv`` and their values (typed by the parser), without the defaults of the
    flags that were not given. Bad flags exit with argparse's usage message, as on any recipe command line."""
    parser = build_parser()
    parser.set_defaults(**{name: _NOT_GIVEN for name in parser.recipe_flags})
    namespace = parser.parse_args(list(argv))
    return {name: value for name, value in vars(namespace).items() if value is not _NOT_GIVEN}


def public_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as recorded (all_results.json, the logs, a sweep's comparison of runs): every flag's value
    but the secret ones (:data:`SECRET_SETTINGS`)."""
    return {key: value for key, value in vars(args).items() if key not in SECRET_SETTINGS}
