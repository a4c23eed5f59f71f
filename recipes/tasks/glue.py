"""The nine GLUE tasks (``--task cola``, ``sst2``, ...): sentence (pair) classification, STS-B regression.

Metrics: ``matthews_correlation`` (CoLA), ``accuracy``, ``accuracy`` + ``f1`` (MRPC, QQP), ``pearson`` +
``spearmanr`` (STS-B), matched ``accuracy`` and mismatched ``accuracy_mm`` (MNLI), through the local `evaluate`
module ``recipes/metrics/glue`` (offline; the same keys as the Hub's ``glue`` metric).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from recipes.errors import RecipeError
from recipes.tasks.base import (
    EVAL_SPLIT_USE,
    DataInfo,
    TaskData,
    first_examples,
    load_data,
    load_local_metric,
    progress_bar,
    require_columns,
    split_off_validation,
)
from recipes.tasks.text import TextTask, local_text_files

logger = logging.getLogger(__name__)

GLUE_TASKS = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli")
# The text columns of each task (as in the Hugging Face example scripts) and its label names.
TASK_TO_KEYS = {
    "cola": ("sentence", None),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "stsb": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}
GLUE_LABEL_NAMES = {
    "cola": ["unacceptable", "acceptable"],
    "sst2": ["negative", "positive"],
    "mrpc": ["not_equivalent", "equivalent"],
    "qqp": ["not_duplicate", "duplicate"],
    "mnli": ["entailment", "neutral", "contradiction"],
    "qnli": ["entailment", "not_entailment"],
    "rte": ["entailment", "not_entailment"],
    "wnli": ["not_entailment", "entailment"],
}
GLUE_PRIMARY_METRIC = {"cola": "matthews_correlation", "stsb": "pearson", "mrpc": "f1", "qqp": "f1"}
DEFAULT_GLUE_DATASET = "nyu-mll/glue"


class GlueTask(TextTask):
    kind = "glue"
    pipeline_tag = "text-classification"
    hub_task_name = "Text Classification"
    head_mapping = "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"
    head_description = "a sequence-classification head"
    plain_text_refused = "GLUE tasks need labelled .csv or .json files, not plain text."

    def __init__(self, name: str):
        super().__init__(name)
        self.primary_metric = GLUE_PRIMARY_METRIC.get(name, "accuracy")
        self.regression = name == "stsb"
        self.reads_mismatched_file = name == "mnli"

    @classmethod
    def describe_names(cls, names: list[str]) -> str:
        return f"one of the GLUE tasks {names}"

    @property
    def dataset_label(self) -> str:
        return f"GLUE {self.name.upper()}"

    def check_args(self, args):
        if args.eval_split:  # GLUE evaluates on its own validation split(s)
            raise RecipeError(EVAL_SPLIT_USE)
        super().check_args(args)

    def eval_split_names(self) -> list[str]:
        return ["validation", "validation_mismatched"] if self.name == "mnli" else ["validation"]

    def load_raw(self, args):
        import datasets

        if args.train_file:
            builder, files = local_text_files(args)
            raw = load_data(builder, data_files=files, what="local data")
            self.info = DataInfo("local files", files=list(files.values()))
            if "validation" not in raw:
                percentage = args.validation_split_percentage or 10
                split, self.info.eval_split = split_off_validation(
                    datasets.DatasetDict({"train": raw["train"]}), percentage, args
                )
                raw["train"], raw["validation"] = split["train"], split["validation"]
            if self.name == "mnli" and "validation_mismatched" not in raw:
                logger.warning("MNLI without --validation_mismatched_file: only matched accuracy is reported.")
            return raw
        name = args.dataset_name or DEFAULT_GLUE_DATASET
        config = args.dataset_config_name or (self.name if name == DEFAULT_GLUE_DATASET else None)
        loaded = load_data(name, config)
        self.info = DataInfo(name, dataset_config=config, hub_dataset=True)
        renames = {"validation_matched": "validation"} if self.name == "mnli" else {}
        raw = datasets.DatasetDict({renames.get(split, split): data for split, data in loaded.items()})
        if "validation" not in raw:
            raise RecipeError(f"Dataset {name} has no validation split (splits: {list(loaded)}).")
        self.info.eval_split = "validation_matched" if self.name == "mnli" else "validation"
        return raw

    def check_raw(self, args, raw):
        first, second = TASK_TO_KEYS[self.name]
        self.keys = (args.sentence1_key or first, args.sentence2_key or second)
        self.label_column = args.label_column_name or "label"
        splits = ["train", *[s for s in self.eval_split_names() if s in raw]]
        require_columns(
            raw, {"first text": self.keys[0], "second text": self.keys[1], "label": self.label_column}, splits
        )
        return self._label_info(raw, splits)

    def _label_info(self, raw, splits) -> dict[str, Any]:
        import datasets

        column = self.label_column
        if self.regression:
            for split in splits:
                values = raw[split][column]
                if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in values):
                    raise RecipeError(f"STS-B labels must be numbers (similarity scores); the {split} data has others.")
            return {"num_labels": 1, "names": None, "regression": True, "to_id": None}
        feature = raw["train"].features[column]
        if isinstance(feature, datasets.ClassLabel):
            names = list(feature.names)
            values = {v for split in splits for v in raw[split][column]}
            if any(v < 0 for v in values):
                raise RecipeError(f"The {column!r} column has unlabelled examples (-1), e.g. a GLUE test split.")
            return {"num_labels": len(names), "names": names, "regression": False, "to_id": None}
        values = {v for split in splits for v in raw[split][column]}
        default_names = GLUE_LABEL_NAMES[self.name]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            if any(v < 0 for v in values):
                raise RecipeError(
                    f"The {column!r} column has negative labels: unlabelled examples (e.g. a test split)."
                )
            names = default_names if max(values) < len(default_names) else [str(i) for i in range(max(values) + 1)]
            return {"num_labels": len(names), "names": names, "regression": False, "to_id": None}
        if all(isinstance(v, str) for v in values):
            names = default_names if values <= set(default_names) else sorted(values)
            return {
                "num_labels": len(names),
                "names": names,
                "regression": False,
                "to_id": {name: index for index, name in enumerate(names)},
            }
        raise RecipeError(
            f"The {column!r} column must hold integer or string class labels; got {sorted(map(repr, values))[:5]}."
        )

    def prepare(self, args, raw, tokenizer, model_config, labels, accelerator):
        from transformers import DataCollatorWithPadding

        first, second = self.keys
        label_column, to_id = self.label_column, labels["to_id"]
        padding = "max_length" if args.pad_to_max_length else False

        def preprocess(examples):
            texts = (examples[first],) if second is None else (examples[first], examples[second])
            result = tokenizer(*texts, padding=padding, max_length=args.max_seq_length, truncation=True)
            values = examples[label_column]
            if self.regression:
                result["labels"] = [float(v) for v in values]
            else:
                result["labels"] = [to_id[v] for v in values] if to_id else list(values)
            return result

        processed = {}
        with accelerator.main_process_first():
            for split in ["train", *[s for s in self.eval_split_names() if s in raw]]:
                processed[split] = raw[split].map(
                    preprocess,
                    batched=True,
                    remove_columns=raw[split].column_names,
                    desc=f"Tokenizing {split}",
                    load_from_cache_file=not args.overwrite_cache,
                    num_proc=args.preprocessing_num_workers,
                )
        train = first_examples(processed.pop("train"), args.max_train_samples)
        evals = {split: first_examples(data, args.max_eval_samples) for split, data in processed.items()}
        collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=None)
        return TaskData(train, evals, collate, collate, self.info)

    def evaluate(self, model, dataloaders, accelerator, args, progress=True):
        model.eval()
        results: dict[str, float] = {}
        for split, dataloader in dataloaders.items():
            config = "mnli_mismatched" if split == "validation_mismatched" else self.name
            metric = load_local_metric("glue", config)
            with torch.no_grad():
                for batch in progress_bar(dataloader, accelerator, f"Evaluating {split}", progress):
                    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
                    predictions = logits.squeeze(-1) if self.regression else logits.argmax(dim=-1)
                    predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
                    metric.add_batch(predictions=predictions.cpu().numpy(), references=references.cpu().numpy())
            scores = metric.compute()
            if split == "validation_mismatched":
                results.update({f"{key}_mm": value for key, value in scores.items()})
            else:
                results.update(scores)
                if len(scores) > 1:
                    results["combined_score"] = float(sum(scores.values()) / len(scores))
        model.train()
        return results

    def metric_names(self) -> list[str]:
        names = {
            "cola": ["matthews_correlation"],
            "stsb": ["pearson", "spearmanr"],
            "mrpc": ["f1", "accuracy"],
            "qqp": ["f1", "accuracy"],
            "mnli": ["accuracy", "accuracy_mm"],
        }
        return names.get(self.name, ["accuracy"])
