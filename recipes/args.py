"""The recipes' command line: Hugging Face example-script flag names, plus the patch's own flags.

A YAML or JSON file may stand in for the flags: ``--config file.yaml`` (or the file as the first argument,
as the Hugging Face scripts accept). Its keys are the flag names without dashes; flags given on the command
line override the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import typing
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from hf_neural_attn.scorers import SCORERS as SCORER_REGISTRY

GLUE_TASKS = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli")
TASKS = ("clm", *GLUE_TASKS, "image")
SCORERS = ("none", *SCORER_REGISTRY)
# Scorer options whose flag has another name: a bare --init would read as the model's own initialisation.
FLAG_FOR_OPTION = {"init": "scorer_init"}
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
TEXT_EXTENSIONS = {"txt": "text", "text": "text", "csv": "csv", "json": "json", "jsonl": "json"}
CONFIG_EXTENSIONS = (".yaml", ".yml", ".json")
# The split seed of --validation_split_percentage's held-out examples unless --validation_split_seed says otherwise:
# fixed, so that the training seed changes the training, not the evaluation set (recipes.tasks.base).
VALIDATION_SPLIT_SEED = 42
EMBEDDED_CORPUS = "pydoc_data"  # --dataset_name of the demo's text (recipes.tasks loads it)
# --gate_schedule: how the scorers' per-head gates alpha move during training (recipes.finetune.GateSchedule).
GATE_SCHEDULES = ("learned", "fixed", "warmup")
# The settings that make up the gate schedule; like the patch settings, a baseline run has none of them.
GATE_SETTINGS = ("gate_schedule", "gate_warmup_steps")


class RecipeError(ValueError):
    """A problem with the run's inputs, reported before any training starts."""


@dataclasses.dataclass(frozen=True)
class ScorerFlag:
    """One command-line flag for a scorer option, generated from the scorer configs' field declarations."""

    flag: str  # the flag's name without dashes (also its key in config files and in the run settings)
    option: str  # the option's name in the scorer config
    type: type
    choices: tuple | None
    help: str
    scorers: tuple[str, ...]  # the scorers that have this option


@functools.cache
def scorer_flags() -> dict[str, ScorerFlag]:
    """A flag for every option of every registered scorer, from each config's dataclass fields (help, choices,
    type). Options several scorers share are one flag; their help texts are joined when they differ."""
    declared: dict[str, list[tuple[str, dataclasses.Field, type]]] = {}
    for scorer, scorer_type in SCORER_REGISTRY.items():
        config_class = scorer_type.config_class
        hints = typing.get_type_hints(config_class)
        for item in config_class.option_fields():
            declared.setdefault(item.name, []).append((scorer, item, _value_type(hints[item.name])))
    flags = {}
    for option, declarations in declared.items():
        types = {value_type for _, _, value_type in declarations}
        if len(types) != 1:
            raise TypeError(f"Scorer option {option!r} is declared with different types {types}.")
        by_help: dict[str, list[tuple[str, Any]]] = {}
        for scorer, item, _ in declarations:
            by_help.setdefault(item.metadata.get("help", ""), []).append((scorer, item.default))
        helps = []
        for text, entries in by_help.items():
            defaults = {repr(default) for _, default in entries}
            if len(defaults) == 1:
                default = f"default {entries[0][1]}"
            else:
                default = ", ".join(f"{scorer}: default {value}" for scorer, value in entries)
            every = len(entries) == len(SCORER_REGISTRY)
            helps.append(("" if every else f"{', '.join(s for s, _ in entries)}: ") + f"{text} ({default})")
        choices = [item.metadata.get("choices") for _, item, _ in declarations]
        union = None
        if all(choices):
            union = tuple(dict.fromkeys(value for values in choices for value in values))
        flag = FLAG_FOR_OPTION.get(option, option)
        flags[flag] = ScorerFlag(
            flag=flag,
            option=option,
            type=types.pop(),
            choices=union,
            help=" | ".join(helps),
            scorers=tuple(scorer for scorer, _, _ in declarations),
        )
    return flags


def parse_bool(value: str) -> bool:
    """A true/false flag value (``--skip false``); argparse's ``type=bool`` would read any non-empty text as True."""
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _value_type(annotation) -> type:
    """``int`` for ``int | None``, ``str`` for ``str``."""
    values = [value for value in typing.get_args(annotation) if value is not type(None)] or [annotation]
    return values[0]


FINETUNE_DESCRIPTION = (
    "Fine-tune (or train from scratch) a Transformers model with its attention scoring replaced by "
    "hf_neural_attn (QANA or Neural Attention), and evaluate it on WikiText, GLUE or CIFAR. "
    "The offline demo (baseline and patched side by side) is `accelerate launch -m recipes.compare`."
)


class _FlagRecorder:
    """Adds arguments to a parser or group and records what each flag was declared with, so that config-file
    values can be checked against the same declarations (no argparse internals). Flags in ``hidden`` are parsed
    but not listed in --help: the command refuses them with its own message."""

    def __init__(self, hidden: Collection[str] = ()) -> None:
        self.flags: dict[str, dict[str, Any]] = {}
        self.hidden = set(hidden)

    def adder(self, target):
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
    add = recorder.adder(parser)
    if config_flag:
        add("--config", type=str, default=None, help="A YAML or JSON file of flag values (keys = flag names).")

    group = parser.add_argument_group("task and model")
    add = recorder.adder(group)
    add("--task", type=str, default="clm", choices=TASKS, help="clm (causal LM), a GLUE task name, or image.")
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
    add("--cpu", action="store_true", help="Run on CPU even when an accelerator is present.")

    group = parser.add_argument_group("data")
    add = recorder.adder(group)
    add(
        "--dataset_name",
        type=str,
        default=None,
        help=f"Hub dataset (default: per task; see docs/recipes.md), or {EMBEDDED_CORPUS} for the demo's text (clm).",
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

    group = parser.add_argument_group("training")
    add = recorder.adder(group)
    add("--output_dir", type=str, default=None, help="Where to write the model, results, card and plot.")
    add("--per_device_train_batch_size", type=int, default=8)
    add("--per_device_eval_batch_size", type=int, default=8)
    add("--learning_rate", type=float, default=5e-5)
    add("--scorer_learning_rate", type=float, default=None, help="Learning rate of the new parameters.")
    add("--weight_decay", type=float, default=0.0)
    add("--num_train_epochs", type=int, default=3)
    add("--max_train_steps", type=int, default=None, help="Total optimizer steps; overrides --num_train_epochs.")
    add("--gradient_accumulation_steps", type=int, default=1)
    add("--lr_scheduler_type", type=str, default="linear", choices=SCHEDULERS)
    add("--num_warmup_steps", type=int, default=0)
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

    group = parser.add_argument_group("evaluation with lm-evaluation-harness (clm)")
    add = recorder.adder(group)
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

    group = parser.add_argument_group("attention patch (hf_neural_attn)")
    add = recorder.adder(group)
    add("--scorer", type=str, default="qana", choices=SCORERS, help="none = the unpatched baseline.")
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
            "The scorers' per-head gates alpha (qana; neural and additive in mode residual): learned (default) "
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
    return parser


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
    config_path = _config_path(argv)
    if config_path is not None:
        parser.set_defaults(**load_config_file(config_path, parser))
    args = parser.parse_args(argv)
    args.config = config_path
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


def _config_path(argv: list[str]) -> str | None:
    """``--config FILE`` anywhere, or a config file as the first argument (removed from ``argv``)."""
    if argv and not argv[0].startswith("-") and argv[0].lower().endswith(CONFIG_EXTENSIONS):
        return argv.pop(0)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=str, default=None)
    known, _ = pre.parse_known_args(argv)
    return known.config


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise RecipeError(f"Config file {path} does not exist.")
    text = Path(path).read_text()
    try:
        if path.lower().endswith(".json"):
            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
    except Exception as error:
        raise RecipeError(f"Could not parse config file {path}: {error}") from error
    if not isinstance(values, dict):
        raise RecipeError(
            f"Config file {path} must hold a mapping of flag names to values, got {type(values).__name__}."
        )
    return check_config_values(values, parser, f"Config file {path}")


def check_config_values(values: dict[str, Any], parser: argparse.ArgumentParser, source: str) -> dict[str, Any]:
    """Flag names as keys (dashes allowed): unknown ones are an error naming ``source``. Returns the values
    under their flag names, without ``config``."""
    known = set(parser.recipe_flags)
    values = {str(key).lstrip("-").replace("-", "_"): value for key, value in values.items()}
    unknown = sorted(set(values) - known - {"config"})
    if unknown:
        raise RecipeError(f"{source} has unknown key(s) {unknown}. Keys are flag names, e.g. learning_rate.")
    values.pop("config", None)
    for key, value in values.items():
        # argparse would convert a string default with the flag's type itself, and on failure print its usage and
        # exit: say which key of which file instead.
        kind = parser.recipe_flags[key].get("type") if key in parser.recipe_flags else None
        if kind in (int, float) and isinstance(value, str):
            try:
                kind(value)
            except ValueError:
                noun = "an integer" if kind is int else "a number"
                raise RecipeError(f"{source} {key} must be {noun}, got {value!r}.") from None
    return values


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> None:
    """Every check that needs no model or data: bad input fails here, before anything is loaded."""
    parser = parser or build_parser()
    _check_types_and_choices(args, parser)
    args.layers = parse_layers(args.layers)

    check_harness_args(args)
    if args.push_to_hub and not args.hub_model_id:
        raise RecipeError("--push_to_hub needs --hub_model_id (the repository to upload to, e.g. user/model-name).")

    is_glue, is_image = args.task in GLUE_TASKS, args.task == "image"
    if is_image and (args.train_file or args.validation_file):
        raise RecipeError("--task image reads images from --train_dir/--validation_dir (or --dataset_name), not files.")
    if not is_image and (args.train_dir or args.validation_dir):
        raise RecipeError(f"--train_dir/--validation_dir are for --task image; --task {args.task} reads --train_file.")
    if args.validation_mismatched_file and args.task != "mnli":
        raise RecipeError("--validation_mismatched_file is for --task mnli only.")
    for name in ("train_file", "validation_file", "validation_mismatched_file"):
        path = getattr(args, name)
        if path is None:
            continue
        if not os.path.isfile(path):
            raise RecipeError(f"--{name} {path} does not exist.")
        extension = path.rsplit(".", 1)[-1].lower()
        if extension not in TEXT_EXTENSIONS:
            raise RecipeError(f"--{name} {path}: unsupported file type .{extension}; use .txt, .csv, .json or .jsonl.")
        if is_glue and TEXT_EXTENSIONS[extension] == "text":
            raise RecipeError(f"--{name} {path}: GLUE tasks need labelled .csv or .json files, not plain text.")
    extensions = {TEXT_EXTENSIONS[p.rsplit(".", 1)[-1].lower()] for p in (args.train_file, args.validation_file) if p}
    if len(extensions) > 1:
        raise RecipeError("--train_file and --validation_file must be of the same type (both text, csv or json).")
    if args.validation_file and not args.train_file:
        raise RecipeError("--validation_file needs --train_file too.")
    for name in ("train_dir", "validation_dir"):
        path = getattr(args, name)
        if path is not None and not os.path.isdir(path):
            raise RecipeError(f"--{name} {path} is not a folder.")
    if args.validation_dir and not args.train_dir:
        raise RecipeError("--validation_dir needs --train_dir too.")
    local_data = args.train_file or args.train_dir
    if args.eval_split and (local_data or is_glue):
        raise RecipeError(
            "--eval_split picks a split of a Hub dataset for clm or image; GLUE evaluates on its validation split(s), "
            "and local data on --validation_file / --validation_dir."
        )
    if local_data and args.dataset_name:
        raise RecipeError("Give either --dataset_name or local data (--train_file / --train_dir), not both.")
    if args.dataset_name == EMBEDDED_CORPUS and (args.task != "clm" or args.dataset_config_name or args.eval_split):
        raise RecipeError(
            f"--dataset_name {EMBEDDED_CORPUS} (the demo's text, shipped with Python) is for --task clm, without "
            "--dataset_config_name or --eval_split."
        )

    if args.model_name_or_path and (args.config_name or args.model_type):
        raise RecipeError("--model_name_or_path loads a pretrained model; drop --config_name/--model_type.")
    if args.config_name and args.model_type:
        raise RecipeError("Give --config_name or --model_type, not both.")
    if args.config_overrides and args.model_name_or_path:
        raise RecipeError("--config_overrides only applies to models built from scratch (--config_name/--model_type).")

    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "num_train_epochs",
        "logging_steps",
    ):
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
    for name in (
        "max_train_steps",
        "eval_steps",
        "attention_map_tokens",
        "block_size",
        "stride",
        "max_train_samples",
        "max_eval_samples",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise RecipeError(f"--{name} must be at least 1, got {value}.")
    if args.num_warmup_steps < 0:
        raise RecipeError(f"--num_warmup_steps must be >= 0, got {args.num_warmup_steps}.")
    if args.block_size and args.stride and args.stride > args.block_size:
        raise RecipeError(
            f"--stride {args.stride} is larger than --block_size {args.block_size}: tokens would be skipped."
        )
    if args.validation_split_percentage is not None and not 0 < args.validation_split_percentage < 100:
        raise RecipeError("--validation_split_percentage must be between 1 and 99.")
    if args.validation_split_seed is not None and not 0 <= args.validation_split_seed < 2**32:
        raise RecipeError(f"--validation_split_seed must be in [0, 2**32), got {args.validation_split_seed}.")
    if args.checkpointing_steps is not None:
        value = str(args.checkpointing_steps)
        if value != "epoch" and not (value.isdigit() and int(value) > 0):
            raise RecipeError(f"--checkpointing_steps must be a positive integer or 'epoch', got {value!r}.")
        args.checkpointing_steps = value
    resume = args.resume_from_checkpoint
    if resume and resume != "latest" and not os.path.isdir(resume):
        raise RecipeError(f"--resume_from_checkpoint {args.resume_from_checkpoint} is not a folder.")

    given_options = {name for name in scorer_flags() if getattr(args, name) is not None}
    if args.scorer == "none":
        given = sorted(given_options) + (["layers"] if args.layers is not None else [])
        if given:
            raise RecipeError(f"--scorer none (the baseline) takes no patch options, got {given}.")
        # --train_only_new_params and --scorer_learning_rate also suit --scorer none with an already patched
        # checkpoint; whether there is a patch is checked once the model is loaded (modeling.build_model).
    else:
        try:
            SCORER_REGISTRY[args.scorer].config_class.from_options(scorer_options(args))
        except ValueError as error:
            raise RecipeError(f"Invalid patch options for --scorer {args.scorer}: {error}") from error
    _check_gate_schedule(args)


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
    if args.scorer == "none":
        raise RecipeError(
            f"--gate_schedule {schedule} holds the scorers' gates, and --scorer none (the baseline) has no scorer: "
            "pass --scorer qana, or neural/additive with --mode residual."
        )
    if scorer_has_gates(args.scorer, scorer_options(args)) is False:
        raise RecipeError(
            f"--gate_schedule {schedule} holds the scorers' gates alpha, but --scorer {args.scorer} with these options "
            f"({scorer_options(args) or 'defaults'}) has none (only qana, and neural/additive in mode residual, do). "
            "Drop --gate_schedule or use a gated scorer."
        )


def scorer_has_gates(scorer: str, options: dict[str, Any]) -> bool | None:
    """Whether a scorer with these options has gates alpha (``ScorerConfig.has_gates``); None when the options do
    not make a config (``validate_args`` reports those)."""
    try:
        with warnings.catch_warnings():  # validate_args has already shown the options' warnings once
            warnings.simplefilter("ignore")
            return SCORER_REGISTRY[scorer].config_class.from_options(dict(options)).has_gates
    except (ValueError, TypeError):
        return None


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
    tasks = harness_tasks(args)
    others = [flag for flag in ("lm_eval_include_path", "lm_eval_limit", "lm_eval_batch_size") if getattr(args, flag)]
    if not tasks:
        if others:
            raise RecipeError(f"--{others[0]} applies to --lm_eval_tasks, which names no task.")
        return
    if args.task != "clm":
        raise RecipeError(
            f"--lm_eval_tasks evaluates causal language models (--task clm); --task {args.task} has its own metrics."
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


def scorer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options for ``hf_neural_attn.patch_model`` that were given (the rest keep the library's defaults)."""
    return {
        spec.option: getattr(args, flag) for flag, spec in scorer_flags().items() if getattr(args, flag) is not None
    }


def patch_settings() -> tuple[str, ...]:
    """The run settings that shape the patch: the scorer, its layers and every scorer option's flag."""
    return ("scorer", "layers", *scorer_flags())
