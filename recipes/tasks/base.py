"""What every task shares: the Task interface, where the data came from, and the loading and checking helpers.

A task lives in its own module (``clm.py``, ``glue.py``, ``image.py``; the text tasks share ``text.py``) and is
found by name in the registry of ``recipes/tasks/__init__.py``. A Task owns everything the rest of the recipes would
otherwise have to branch on its name for: its data flags' checks, its data and metrics, its model head, its
preprocessor (tokenizer or image processor), how it fits the model's config, its Hub names and its lines in the
model card.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from recipes.errors import RecipeError

logger = logging.getLogger(__name__)

# The offline `evaluate` modules (GLUE, accuracy) of recipes/metrics/.
METRICS_DIR = Path(__file__).resolve().parent.parent / "metrics"
# The split seed of --validation_split_percentage's held-out examples unless --validation_split_seed says otherwise:
# fixed, so that the training seed changes the training, not the evaluation set.
VALIDATION_SPLIT_SEED = 42
# --eval_split's refusal: where it does not apply (local data, and tasks that always evaluate on their own splits).
EVAL_SPLIT_USE = (
    "--eval_split picks a split of a Hub dataset for clm or image; GLUE evaluates on its validation split(s), "
    "and local data on --validation_file / --validation_dir."
)


@dataclass
class DataInfo:
    """Where the data came from, for logs, all_results.json and the model card."""

    dataset_name: str  # Hub id, "local files", or the embedded corpus
    dataset_config: str | None = None
    eval_split: str = "validation"
    hub_dataset: bool = False
    files: list[str] = field(default_factory=list)


@dataclass
class TaskData:
    train_dataset: Any
    eval_datasets: dict[str, Any]  # name -> dataset; the first is the main evaluation set
    train_collate: Callable
    eval_collate: Callable
    info: DataInfo


class Task:
    """One task: its data flags, data, preprocessing, model head, evaluation and Hub names.

    A subclass sets the class attributes and implements the methods that raise NotImplementedError; the rest have
    defaults. ``recipes.tasks.TASKS`` maps each ``--task`` name to its class (one class may serve several names, as
    the nine GLUE tasks share one).
    """

    name: str
    kind: str  # the task's family: a tag on the model card, "task_kind" in all_results.json
    primary_metric: str
    greater_is_better: bool = True
    pipeline_tag: str  # the Hub's task type: the card's pipeline_tag and its model-index task type
    hub_task_name: str  # the Hub's name of that task type, for the model-index
    # The model head: the name of a model-type -> class mapping of transformers.models.auto.modeling_auto, and the
    # head in words and what to use instead, for the message refusing a model without that head.
    head_mapping: str
    head_description: str
    head_hint: str
    # The preprocessor as the model card's "How to load" loads it: its Auto class and its variable name.
    preprocessor_class: str = "AutoTokenizer"
    preprocessor_noun: str = "tokenizer"
    # Dataset names this task builds itself, without the Hub, and how they may be used (the message that refuses
    # them elsewhere): recipes.tasks.check_args refuses them for every other task.
    embedded_datasets: ClassVar[dict[str, str]] = {}
    # Whether --lm_eval_tasks can evaluate the trained model with lm-evaluation-harness (a causal language model).
    harness_evaluates: bool = False

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def describe_names(cls, names: list[str]) -> str:
        """The ``--task`` names this class serves, in words, for the message listing the known tasks."""
        return ", ".join(names)

    @property
    def dataset_label(self) -> str:
        """The task in a few words, for the model card's title."""
        return self.hub_task_name

    # 0. The command line (before anything is loaded).
    def check_args(self, args: argparse.Namespace) -> None:
        """Refuse the data flags this task does not read, or reads otherwise, before anything is loaded
        (``recipes.checks`` runs the checks that hold for every task). A subclass adds its own and calls this."""
        if args.eval_split and (args.train_file or args.train_dir):
            raise RecipeError(EVAL_SPLIT_USE)

    def hub_data(self, args: argparse.Namespace) -> list[str]:
        """The Hub datasets this run would download, named for the offline message (local data: none)."""
        if args.dataset_name:
            return [] if os.path.exists(args.dataset_name) else [args.dataset_name]
        if args.train_file or args.train_dir:
            return []
        return [f"the default {self.name} dataset"]

    # 1. The model: its config without model flags, its preprocessor, the config fitted to both.
    def model_classes(self) -> dict[str, str]:
        """transformers' model type -> class name of the task's head (e.g. ``gpt2`` -> ``GPT2LMHeadModel``)."""
        from transformers.models.auto import modeling_auto

        return getattr(modeling_auto, self.head_mapping)

    def embedded_config(self, args: argparse.Namespace):
        """The config of the small model built here when no model flag is given."""
        raise NotImplementedError

    def embedded_source(self, args: argparse.Namespace) -> str:
        """Where the embedded model comes from, in words, for logs and the model card."""
        raise NotImplementedError

    def load_preprocessor(self, args: argparse.Namespace, config):
        """The tokenizer or image processor the run preprocesses with and saves beside the model."""
        raise NotImplementedError

    def configure_model(self, config, preprocessor, args: argparse.Namespace, labels: dict[str, Any] | None) -> None:
        """Fit the model's config to the preprocessor and to the labels ``check_raw`` found, before it is built."""

    def adapt_model(self, model, preprocessor) -> set[str]:
        """Fit the built model to the preprocessor (e.g. a larger vocabulary); returns the parameters it made."""
        return set()

    def token_labels(self, preprocessor):
        """The tokenizer that labels the attention maps' axes with tokens, or None (images)."""

    # 2. Raw data and its checks (before the model is built: the labels shape the model's head).
    def load_raw(self, args: argparse.Namespace):
        raise NotImplementedError

    def check_raw(self, args: argparse.Namespace, raw) -> dict[str, Any] | None:
        """Check columns and labels; return label info ({num_labels, names, regression}) or None."""
        raise NotImplementedError

    # 3. Preprocessing, once the tokenizer / image processor exists.
    def prepare(self, args, raw, preprocessor, model_config, labels, accelerator) -> TaskData:
        raise NotImplementedError

    # 4. Evaluation with the task's metrics.
    def evaluate(
        self, model, dataloaders: dict[str, Any], accelerator, args, progress: bool = True
    ) -> dict[str, float]:
        raise NotImplementedError

    def training_inputs(self, batch: dict[str, Any], epoch: int, args) -> dict[str, Any]:
        """The model inputs of a training batch (the image task adds its augmentation here)."""
        return batch

    def metric_names(self) -> list[str]:
        return [self.primary_metric]

    def metric_columns(self) -> list[str]:
        """Every metric ``evaluate`` reports that the results list: the task's own, then the evaluation loss where it
        reports one (all_results.json's metric_names, sweep.csv's columns)."""
        return self.metric_names()

    # 5. What the run reports.
    def extra_results(self) -> dict[str, Any]:
        """Settings the task resolved while preparing the data, for all_results.json (e.g. the block size)."""
        return {}

    def card_training_rows(self, results: dict[str, Any], settings: dict[str, Any]) -> list[tuple[str, Any]]:
        """(setting, value) rows the model card's Training table adds for this task."""
        return []


# --------------------------------------------------------------------------------------------- helpers


def uses_embedded_model(args: argparse.Namespace) -> bool:
    """Whether no model flag is given, so that the recipe builds its small embedded model."""
    return not (args.model_name_or_path or args.config_name or args.model_type)


def load_data(path: str, name: str | None = None, what: str = "dataset", **kwargs):
    """``datasets.load_dataset``; a failure is a RecipeError naming the data (and, for Hub data, the offline way)."""
    import datasets

    try:
        return datasets.load_dataset(path, name, **kwargs)
    except Exception as error:
        hint = ""
        if path not in ("csv", "json", "text", "imagefolder"):
            hint = (
                "\nWithout Hub access (HF_HUB_OFFLINE=1 or no network), use local data: --train_file/--validation_file "
                "(text tasks) or --train_dir/--validation_dir (images)."
            )
        raise RecipeError(f"Could not load the {what} {path!r}{f' ({name})' if name else ''}: {error}{hint}") from error


def split_off_validation(raw, percentage: int, args: argparse.Namespace):
    """Hold out ``percentage`` percent of the training split as validation, shuffled with ``--validation_split_seed``
    (default :data:`VALIDATION_SPLIT_SEED`), not the training seed: runs with different ``--seed``
    evaluate on the same examples, so a spread over seeds is the training's alone. Returns the split and its
    description for ``DataInfo.eval_split``."""
    import datasets

    if len(raw["train"]) < 2:
        raise RecipeError("The training data has fewer than 2 examples: cannot hold out a validation split.")
    seed = VALIDATION_SPLIT_SEED if args.validation_split_seed is None else args.validation_split_seed
    split = raw["train"].train_test_split(test_size=percentage / 100, seed=seed, shuffle=True)
    described = f"{percentage}% of train (split seed {seed})"
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]}), described


def require_columns(raw, columns: dict[str, str | None], splits) -> None:
    """Refuse data without a column the task reads (role -> column name), naming the flag that picks it."""
    for split in splits:
        available = raw[split].column_names
        for role, column in columns.items():
            if column is not None and column not in available:
                raise RecipeError(
                    f"The {split} data has no {role} column {column!r}; its columns are {available}. "
                    f"Name the right one with --{_flag_for(role)}."
                )


def _flag_for(role: str) -> str:
    return {
        "text": "text_column_name",
        "first text": "sentence1_key",
        "second text": "sentence2_key",
        "label": "label_column_name",
        "image": "image_column_name",
    }[role]


def first_examples(dataset, count: int | None):
    """The first ``count`` examples (``--max_train_samples``, ``--max_eval_samples``); all of them for None."""
    return dataset if count is None or count >= len(dataset) else dataset.select(range(count))


def load_local_metric(name: str, config_name: str | None = None):
    """An offline `evaluate` metric from ``recipes/metrics/<name>``, kept in memory (no cache files)."""
    import evaluate

    return evaluate.load(str(METRICS_DIR / name), config_name, keep_in_memory=True)


def progress_bar(dataloader, accelerator, description: str, enabled: bool):
    """An evaluation progress bar, shown on the local main process only."""
    from tqdm.auto import tqdm

    return tqdm(dataloader, desc=description, leave=False, disable=not (enabled and accelerator.is_local_main_process))
