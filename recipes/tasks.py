"""Data and metrics of each task kind: causal LM (WikiText), the nine GLUE tasks, image classification (CIFAR).

Each task loads its data (local files or folders, a Hub dataset, or for the causal LM an embedded corpus
that ships with Python), checks its columns and labels before anything is trained, preprocesses it, and
evaluates a model on it with the task's official metrics:

* ``clm``: ``perplexity`` (and ``eval_loss``). ``--perplexity_protocol sliding`` is the standard protocol:
  the evaluation text is one token stream, cut into windows of ``block_size`` at ``--stride``; every token
  is scored exactly once, with the context its window gives it. ``full_window`` is the protocol of the Neural
  Attention authors' code: windows of ``block_size + 1`` tokens start every ``stride`` tokens, windows that do
  not fit are dropped, every one of the ``block_size`` predictions of a window is scored (overlapping windows
  score tokens again) and perplexity is ``exp`` of the mean window loss.
* GLUE: ``matthews_correlation`` (CoLA), ``accuracy``, ``accuracy`` + ``f1`` (MRPC, QQP), ``pearson`` +
  ``spearmanr`` (STS-B), matched ``accuracy`` and mismatched ``accuracy_mm`` (MNLI), through the local
  `evaluate` module ``recipes/metrics/glue`` (offline; same keys as the Hub's ``glue`` metric).
* ``image``: ``accuracy`` through ``recipes/metrics/accuracy``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# EMBEDDED_CORPUS: the Python documentation topics that ship with the interpreter, the demo's data; also selected
# by --dataset_name pydoc_data (e.g. to train a demo checkpoint further).
from .args import EMBEDDED_CORPUS, GLUE_TASKS, TEXT_EXTENSIONS, RecipeError

logger = logging.getLogger(__name__)

METRICS_DIR = Path(__file__).resolve().parent / "metrics"

# GLUE: the text columns of each task (as in the Hugging Face example scripts) and its label names.
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

DEFAULT_CLM_DATASET = ("wikitext", "wikitext-2-raw-v1")
DEFAULT_GLUE_DATASET = "nyu-mll/glue"
DEFAULT_IMAGE_DATASET = "uoft-cs/cifar10"
IMAGE_DATASET_ALIASES = {"cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100"}


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
    return not (args.model_name_or_path or args.config_name or args.model_type)


def _load_dataset(path: str, name: str | None = None, what: str = "dataset", **kwargs):
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


def _local_text_files(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    files = {"train": args.train_file}
    if args.validation_file:
        files["validation"] = args.validation_file
    if getattr(args, "validation_mismatched_file", None):
        files["validation_mismatched"] = args.validation_mismatched_file
    builder = TEXT_EXTENSIONS[args.train_file.rsplit(".", 1)[-1].lower()]
    return builder, files


def _split_off_validation(raw, percentage: int, seed: int):
    """Hold out ``percentage`` percent of the training split as validation (deterministic)."""
    import datasets

    if len(raw["train"]) < 2:
        raise RecipeError("The training data has fewer than 2 examples: cannot hold out a validation split.")
    split = raw["train"].train_test_split(test_size=percentage / 100, seed=seed, shuffle=True)
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})


def _require_columns(raw, columns: dict[str, str | None], splits) -> None:
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


def _limit(dataset, count: int | None):
    return dataset if count is None or count >= len(dataset) else dataset.select(range(count))


def load_local_metric(name: str, config_name: str | None = None):
    """An offline `evaluate` metric from ``recipes/metrics/<name>``, kept in memory (no cache files)."""
    import evaluate

    return evaluate.load(str(METRICS_DIR / name), config_name, keep_in_memory=True)


def _progress(dataloader, accelerator, description: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(dataloader, desc=description, leave=False, disable=not (enabled and accelerator.is_local_main_process))


# ------------------------------------------------------------------------------------------ causal LM


def embedded_corpus(validation_every: int = 10):
    """The Python documentation topics (``pydoc_data``, part of the standard library) as a text dataset.

    Topics in sorted order; every ``validation_every``-th topic is held out for validation. Topics repeat
    each other (``if`` and ``else`` are the same page, many share paragraphs), so validation paragraphs that
    also occur in a training topic are dropped: the held-out text is text the model has not seen.
    """
    from pydoc_data.topics import topics

    import datasets

    names = sorted(topics)
    train = [topics[name] for index, name in enumerate(names) if index % validation_every]
    seen = {paragraph.strip() for text in train for paragraph in text.split("\n\n")}
    validation = []
    for index, name in enumerate(names):
        if not index % validation_every:
            unseen = [p for p in topics[name].split("\n\n") if p.strip() and p.strip() not in seen]
            if unseen:
                validation.append("\n\n".join(unseen))
    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": train}),
            "validation": datasets.Dataset.from_dict({"text": validation}),
        }
    )


class CausalLMTask(Task):
    kind = "clm"
    primary_metric = "perplexity"
    greater_is_better = False
    pipeline_tag = "text-generation"

    def load_raw(self, args):
        percentage = args.validation_split_percentage or 5
        if args.train_file:
            builder, files = _local_text_files(args)
            kwargs = {"keep_linebreaks": True} if builder == "text" else {}
            raw = _load_dataset(builder, data_files=files, what="local data", **kwargs)
            self.info = DataInfo("local files", files=list(files.values()))
        elif args.dataset_name == EMBEDDED_CORPUS or (args.dataset_name is None and uses_embedded_model(args)):
            raw = embedded_corpus()
            self.info = DataInfo(EMBEDDED_CORPUS, dataset_config="topics")
        else:
            name, config = (args.dataset_name, args.dataset_config_name)
            if name is None:
                name, config = DEFAULT_CLM_DATASET[0], config or DEFAULT_CLM_DATASET[1]
            raw = _load_dataset(name, config)
            self.info = DataInfo(name, dataset_config=config, hub_dataset=True)
            if args.eval_split:
                if args.eval_split not in raw:
                    raise RecipeError(f"--eval_split {args.eval_split!r}: {name} has splits {list(raw)}.")
                raw["validation"] = raw[args.eval_split]
                self.info.eval_split = args.eval_split
        if "validation" not in raw:
            raw = _split_off_validation(raw, percentage, args.seed)
            self.info.eval_split = f"{percentage}% of train"
        return raw

    def check_raw(self, args, raw):
        column = args.text_column_name
        if column is None:
            columns = raw["train"].column_names
            column = "text" if "text" in columns else columns[0]
        _require_columns(raw, {"text": column}, ["train", "validation"])
        for split in ("train", "validation"):
            feature = raw[split].features[column]
            if getattr(feature, "dtype", None) not in ("string", "large_string"):
                raise RecipeError(f"The text column {column!r} of the {split} data holds {feature}, not text.")
        self.text_column = column

    def block_size(self, args, tokenizer, model_config) -> int:
        limit = getattr(model_config, "n_positions", None) or getattr(model_config, "max_position_embeddings", None)
        block = args.block_size or min(1024, tokenizer.model_max_length, limit or 1024)
        if limit and block > limit:
            raise RecipeError(f"--block_size {block} is longer than the model's {limit} positions.")
        return block

    def prepare(self, args, raw, tokenizer, model_config, labels, accelerator):
        block = self.block_size(args, tokenizer, model_config)
        stride = args.stride or block
        if stride > block:
            raise RecipeError(f"--stride {stride} is larger than the block size {block}: tokens would be skipped.")
        column = self.text_column

        def tokenize(examples):
            return tokenizer(examples[column], verbose=False)

        def group_texts(examples):
            # Concatenate and cut into blocks of `block` tokens, dropping the remainder (run_clm's way).
            concatenated = {key: list(itertools.chain.from_iterable(examples[key])) for key in examples}
            total = (len(concatenated["input_ids"]) // block) * block
            result = {key: [ids[i : i + block] for i in range(0, total, block)] for key, ids in concatenated.items()}
            result["labels"] = [list(ids) for ids in result["input_ids"]]
            return result

        map_kwargs = {"num_proc": args.preprocessing_num_workers, "load_from_cache_file": not args.overwrite_cache}
        with accelerator.main_process_first():
            tokenized = raw["train"].map(
                tokenize, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing", **map_kwargs
            )
            train = tokenized.map(group_texts, batched=True, desc=f"Grouping into blocks of {block}", **map_kwargs)
        if len(train) == 0:
            raise RecipeError(f"The training text is shorter than one block of {block} tokens; lower --block_size.")
        train = _limit(train, args.max_train_samples)

        text = "\n\n".join(raw["validation"][column])
        ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)
        windows = make_windows(ids, block, stride, args.perplexity_protocol)
        if not windows:
            raise RecipeError(
                f"The validation text ({len(ids)} tokens) is too short for one {args.perplexity_protocol} window "
                f"of {block} tokens."
            )
        windows = windows[: args.max_eval_samples] if args.max_eval_samples else windows
        self.protocol = args.perplexity_protocol
        self.block, self.stride = block, stride
        logger.info(
            "Evaluation: %d validation tokens, %d %s windows of %d tokens, stride %d",
            len(ids),
            len(windows),
            args.perplexity_protocol,
            block,
            stride,
        )
        from transformers import default_data_collator

        return TaskData(
            train_dataset=train,
            eval_datasets={"validation": windows},
            train_collate=default_data_collator,
            eval_collate=WindowCollator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0),
            info=self.info,
        )

    def evaluate(self, model, dataloaders, accelerator, args, progress=True):
        model.eval()
        sums, counts = [], []
        (dataloader,) = dataloaders.values()
        with torch.no_grad():
            for batch in _progress(dataloader, accelerator, "Evaluating", progress):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                nll, count = window_nll(logits, batch["targets"])
                nll, count = accelerator.gather_for_metrics((nll, count))
                sums.append(nll.double().cpu())
                counts.append(count.double().cpu())
        model.train()
        return perplexity_from_windows(torch.cat(sums), torch.cat(counts), self.protocol)


def make_windows(ids: torch.Tensor, block: int, stride: int, protocol: str) -> list[dict[str, torch.Tensor]]:
    """Evaluation windows over one token stream, as (input_ids, targets) with targets already shifted:
    ``targets[j]`` is the token the model should predict after ``input_ids[:j+1]``, or -100 if not scored.
    """
    n = len(ids)
    windows = []
    if protocol == "full_window":
        for begin in range(0, n - block, stride):  # windows of block + 1 tokens that fit entirely
            window = ids[begin : begin + block + 1]
            windows.append({"input_ids": window[:-1], "targets": window[1:].clone()})
        return windows
    # Sliding: every position 1 .. n-1 is predicted exactly once (position 0 has no context). The first
    # window scores its `block` predictions; each later one scores the next `stride` positions, reading the
    # `block` tokens before each (so every scored token has at least block - stride tokens of context).
    first_target = 1
    while first_target < n:
        end_target = min(first_target + (block if first_target == 1 else stride), n)  # scores [first, end)
        start = max(0, end_target - 1 - block)
        inputs = ids[start : end_target - 1]  # input j predicts position start + j + 1
        targets = ids[start + 1 : end_target].clone()
        targets[: first_target - start - 1] = -100  # positions an earlier window already scored
        windows.append({"input_ids": inputs, "targets": targets})
        first_target = end_target
    return windows


class WindowCollator:
    """Right-pads evaluation windows; padded positions are masked and never scored."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, windows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        length = max(len(w["input_ids"]) for w in windows)
        input_ids = torch.full((len(windows), length), self.pad_token_id, dtype=torch.long)
        targets = torch.full((len(windows), length), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(windows), length), dtype=torch.long)
        for row, window in enumerate(windows):
            size = len(window["input_ids"])
            input_ids[row, :size] = window["input_ids"]
            targets[row, :size] = window["targets"]
            attention_mask[row, :size] = 1
        return {"input_ids": input_ids, "targets": targets, "attention_mask": attention_mask}


def window_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window summed negative log-likelihood of the scored targets, and their count."""
    nll = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=-100, reduction="none")
    scored = targets != -100
    return (nll * scored).sum(dim=1), scored.sum(dim=1)


def perplexity_from_windows(sums: torch.Tensor, counts: torch.Tensor, protocol: str) -> dict[str, float]:
    if protocol == "full_window":
        loss = (sums / counts).mean().item()  # the mean of the window losses, as the authors' code
    else:
        loss = (sums.sum() / counts.sum()).item()  # every token once: the corpus-level mean
    return {"perplexity": math.exp(loss) if loss < 700 else float("inf"), "eval_loss": loss}


# ------------------------------------------------------------------------------------------------ GLUE


class GlueTask(Task):
    kind = "glue"
    pipeline_tag = "text-classification"

    def __init__(self, name: str):
        super().__init__(name)
        self.primary_metric = GLUE_PRIMARY_METRIC.get(name, "accuracy")
        self.regression = name == "stsb"

    def eval_split_names(self) -> list[str]:
        return ["validation", "validation_mismatched"] if self.name == "mnli" else ["validation"]

    def load_raw(self, args):
        import datasets

        if args.train_file:
            builder, files = _local_text_files(args)
            raw = _load_dataset(builder, data_files=files, what="local data")
            self.info = DataInfo("local files", files=list(files.values()))
            if "validation" not in raw:
                percentage = args.validation_split_percentage or 10
                split = _split_off_validation(datasets.DatasetDict({"train": raw["train"]}), percentage, args.seed)
                raw["train"], raw["validation"] = split["train"], split["validation"]
                self.info.eval_split = f"{percentage}% of train"
            if self.name == "mnli" and "validation_mismatched" not in raw:
                logger.warning("MNLI without --validation_mismatched_file: only matched accuracy is reported.")
            return raw
        name = args.dataset_name or DEFAULT_GLUE_DATASET
        config = args.dataset_config_name or (self.name if name == DEFAULT_GLUE_DATASET else None)
        loaded = _load_dataset(name, config)
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
        _require_columns(
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
        train = _limit(processed.pop("train"), args.max_train_samples)
        evals = {split: _limit(data, args.max_eval_samples) for split, data in processed.items()}
        collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=None)
        return TaskData(train, evals, collate, collate, self.info)

    def evaluate(self, model, dataloaders, accelerator, args, progress=True):
        model.eval()
        results: dict[str, float] = {}
        for split, dataloader in dataloaders.items():
            config = "mnli_mismatched" if split == "validation_mismatched" else self.name
            metric = load_local_metric("glue", config)
            with torch.no_grad():
                for batch in _progress(dataloader, accelerator, f"Evaluating {split}", progress):
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


# ----------------------------------------------------------------------------------------------- image


class ImageTask(Task):
    kind = "image"
    primary_metric = "accuracy"
    pipeline_tag = "image-classification"

    def load_raw(self, args):
        import datasets

        if args.train_dir:
            files = {"train": os.path.join(args.train_dir, "**")}
            if args.validation_dir:
                files["validation"] = os.path.join(args.validation_dir, "**")
            raw = _load_dataset("imagefolder", data_files=files, what="image folders")
            self.info = DataInfo(
                "local image folders", files=[args.train_dir] + ([args.validation_dir] if args.validation_dir else [])
            )
        else:
            name = args.dataset_name or DEFAULT_IMAGE_DATASET
            name = IMAGE_DATASET_ALIASES.get(name, name)
            loaded = _load_dataset(name, args.dataset_config_name)
            self.info = DataInfo(name, dataset_config=args.dataset_config_name, hub_dataset=True)
            eval_split = args.eval_split or (
                "validation" if "validation" in loaded else "test" if "test" in loaded else None
            )
            if eval_split is not None and eval_split not in loaded:
                raise RecipeError(f"--eval_split {eval_split!r}: {name} has splits {list(loaded)}.")
            raw = datasets.DatasetDict({"train": loaded["train"]})
            if eval_split:
                raw["validation"] = loaded[eval_split]
                self.info.eval_split = eval_split
        if "validation" not in raw:
            percentage = args.validation_split_percentage or 15
            raw = _split_off_validation(raw, percentage, args.seed)
            self.info.eval_split = f"{percentage}% of train"
        return raw

    def check_raw(self, args, raw):
        import datasets

        features = raw["train"].features
        image = args.image_column_name
        if image is None:
            images = [name for name, feature in features.items() if isinstance(feature, datasets.Image)]
            image = "image" if "image" in features else (images[0] if images else "image")
        label = args.label_column_name
        if label is None:
            classes = [name for name, feature in features.items() if isinstance(feature, datasets.ClassLabel)]
            label = "label" if "label" in features else (classes[0] if classes else "label")
        _require_columns(raw, {"image": image, "label": label}, ["train", "validation"])
        self.image_column, self.label_column = image, label
        feature = features[label]
        if isinstance(feature, datasets.ClassLabel):
            names = list(feature.names)
        else:
            values = set(raw["train"][label]) | set(raw["validation"][label])
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise RecipeError(f"The label column {label!r} must hold class indices or class names (ClassLabel).")
            names = [str(i) for i in range(max(values) + 1)]
        return {"num_labels": len(names), "names": names, "regression": False, "to_id": None}

    def prepare(self, args, raw, processor, model_config, labels, accelerator):
        image_column, label_column = self.image_column, self.label_column
        size = model_config.image_size
        self.augment_padding = max(size // 8, 1)

        def transform(examples):
            images = [image.convert("RGB") for image in examples[image_column]]
            pixel_values = processor(images, return_tensors="pt")["pixel_values"]
            if pixel_values.shape[-1] != size or pixel_values.shape[-2] != size:
                raise RecipeError(
                    f"The image processor makes {tuple(pixel_values.shape[-2:])} images but the model expects {size}x{size}."
                )
            result = {"pixel_values": pixel_values, "labels": list(examples[label_column])}
            if "example_index" in examples:
                result["example_index"] = list(examples["example_index"])
            return result

        train = _limit(raw["train"], args.max_train_samples)
        train = train.add_column("example_index", list(range(len(train))))
        train = train.with_transform(transform)
        validation = _limit(raw["validation"], args.max_eval_samples).with_transform(transform)
        return TaskData(train, {"validation": validation}, collate_images, collate_images, self.info)

    def training_inputs(self, batch, epoch, args):
        """Random horizontal flip and padded random crop, drawn per example from (seed, epoch, example index):
        independent of the global RNG, of resuming and of the number of processes."""
        batch = dict(batch)
        indices = batch.pop("example_index")
        pixels = batch["pixel_values"]
        pad = self.augment_padding
        padded = F.pad(pixels, (pad, pad, pad, pad), mode="reflect")
        out = torch.empty_like(pixels)
        size_h, size_w = pixels.shape[-2:]
        for row, index in enumerate(indices.tolist()):
            generator = torch.Generator().manual_seed(zlib.crc32(f"{args.seed}/{epoch}/{index}".encode()))
            top, left = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,), generator=generator))
            crop = padded[row, :, top : top + size_h, left : left + size_w]
            if torch.rand((), generator=generator) < 0.5:
                crop = crop.flip(-1)
            out[row] = crop
        batch["pixel_values"] = out
        return batch

    def evaluate(self, model, dataloaders, accelerator, args, progress=True):
        model.eval()
        (dataloader,) = dataloaders.values()
        metric = load_local_metric("accuracy")
        with torch.no_grad():
            for batch in _progress(dataloader, accelerator, "Evaluating", progress):
                batch = {k: v for k, v in batch.items() if k != "example_index"}
                predictions = model(pixel_values=batch["pixel_values"]).logits.argmax(dim=-1)
                predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
                metric.add_batch(predictions=predictions.cpu().numpy(), references=references.cpu().numpy())
        model.train()
        return metric.compute()


def collate_images(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    batch = {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["labels"] for example in examples], dtype=torch.long),
    }
    if "example_index" in examples[0]:
        batch["example_index"] = torch.tensor([example["example_index"] for example in examples], dtype=torch.long)
    return batch


def get_task(name: str) -> Task:
    if name == "clm":
        return CausalLMTask(name)
    if name in GLUE_TASKS:
        return GlueTask(name)
    if name == "image":
        return ImageTask(name)
    raise RecipeError(f"Unknown task {name!r}; choose clm, one of the GLUE tasks {list(GLUE_TASKS)}, or image.")
