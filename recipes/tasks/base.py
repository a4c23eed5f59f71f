"""What every task shares: the Task interface, where the data came from, and the loading and checking helpers.

A task kind lives in its own module (``clm.py``, ``glue.py``, ``image.py``); ``recipes.tasks.get_task`` finds it by
name in the registry.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recipes.args import TEXT_EXTENSIONS, VALIDATION_SPLIT_SEED, RecipeError

logger = logging.getLogger(__name__)

# The offline `evaluate` modules (GLUE, accuracy) of recipes/metrics/.
METRICS_DIR = Path(__file__).resolve().parent.parent / "metrics"


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
    """One task kind: data, preprocessing, evaluation."""

    name: str
    kind: str
    primary_metric: str
    greater_is_better: bool = True
    pipeline_tag: str

    def __init__(self, name: str):
        self.name = name

    # 1. Raw data and its checks (before the model is built: the labels shape the model's head).
    def load_raw(self, args: argparse.Namespace):
        raise NotImplementedError

    def check_raw(self, args: argparse.Namespace, raw) -> dict[str, Any] | None:
        """Check columns and labels; return label info ({num_labels, names, regression}) or None."""
        raise NotImplementedError

    # 2. Preprocessing, once the tokenizer / image processor exists.
    def prepare(self, args, raw, preprocessor, model_config, labels, accelerator) -> TaskData:
        raise NotImplementedError

    # 3. Evaluation with the task's metrics.
    def evaluate(
        self, model, dataloaders: dict[str, Any], accelerator, args, progress: bool = True
    ) -> dict[str, float]:
        raise NotImplementedError

    def training_inputs(self, batch: dict[str, Any], epoch: int, args) -> dict[str, Any]:
        """The model inputs of a training batch (the image task adds its augmentation here)."""
        return batch

    def metric_names(self) -> list[str]:
        return [self.primary_metric]


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


def local_text_files(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    """The `datasets` builder for ``--train_file``'s extension and the files of each split."""
    files = {"train": args.train_file}
    if args.validation_file:
        files["validation"] = args.validation_file
    if getattr(args, "validation_mismatched_file", None):
        files["validation_mismatched"] = args.validation_mismatched_file
    builder = TEXT_EXTENSIONS[args.train_file.rsplit(".", 1)[-1].lower()]
    return builder, files


def split_off_validation(raw, percentage: int, args: argparse.Namespace):
    """Hold out ``percentage`` percent of the training split as validation, shuffled with ``--validation_split_seed``
    (default :data:`~recipes.args.VALIDATION_SPLIT_SEED`), not the training seed: runs with different ``--seed``
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
