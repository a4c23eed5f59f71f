"""The causal language-modelling task (``--task clm``): WikiText by default, the embedded Python documentation offline.

Metrics: ``perplexity`` (and ``eval_loss``). ``--perplexity_protocol sliding`` is the standard protocol: the
evaluation text is one token stream, cut into windows of ``block_size`` at ``--stride``; every token is scored
exactly once, with the context its window gives it. ``full_window`` is the protocol of the Neural Attention
authors' code: windows of ``block_size + 1`` tokens start every ``stride`` tokens, windows that do not fit are
dropped, every one of the ``block_size`` predictions of a window is scored (overlapping windows score tokens again)
and perplexity is ``exp`` of the mean window loss.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import ClassVar

import torch
import torch.nn.functional as F

from recipes.errors import RecipeError
from recipes.tasks import shakespeare
from recipes.tasks.base import (
    DataInfo,
    TaskData,
    first_examples,
    load_data,
    progress_bar,
    require_columns,
    split_off_validation,
    uses_embedded_model,
)
from recipes.tasks.text import TextTask, load_tokenizer, local_text_files

logger = logging.getLogger(__name__)

DEFAULT_CLM_DATASET = ("wikitext", "wikitext-2-raw-v1")
# The Python documentation topics that ship with the interpreter: the demo's data, and the data of a run without
# model flags; also selected by --dataset_name pydoc_data (e.g. to train a demo checkpoint further).
EMBEDDED_CORPUS = "pydoc_data"
EMBEDDED_CORPUS_USE = (
    f"--dataset_name {EMBEDDED_CORPUS} (the demo's text, shipped with Python) is for --task clm, without "
    "--dataset_config_name or --eval_split."
)


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


class CausalLMTask(TextTask):
    kind = "clm"
    primary_metric = "perplexity"
    greater_is_better = False
    pipeline_tag = "text-generation"
    hub_task_name = "Causal Language Modeling"
    dataset_label = "Causal LM"
    head_mapping = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
    head_description = "a causal language-modeling head"
    embedded_datasets: ClassVar[dict[str, str]] = {
        EMBEDDED_CORPUS: EMBEDDED_CORPUS_USE,
        shakespeare.CORPUS_NAME: shakespeare.CORPUS_USE,
    }
    harness_evaluates = True
    pads_with_tokenizer = False  # evaluation windows are padded with a masked id (WindowCollator)

    def check_args(self, args):
        if args.dataset_name in self.embedded_datasets and (args.dataset_config_name or args.eval_split):
            raise RecipeError(self.embedded_datasets[args.dataset_name])
        super().check_args(args)

    def load_preprocessor(self, args, config):
        """The tokenizer; tiny-shakespeare's own character vocabulary for a model built from scratch on it (nanoGPT's),
        unless --tokenizer_name names another."""
        if args.dataset_name == shakespeare.CORPUS_NAME and not (args.tokenizer_name or args.model_name_or_path):
            logger.info("Tokenizer: tiny-shakespeare's %d characters, one token each", len(shakespeare.vocabulary()))
            return shakespeare.character_tokenizer()
        return load_tokenizer(args, needs_pad_token=self.pads_with_tokenizer)

    def adapt_model(self, model, tokenizer) -> set[str]:
        """As TextTask's; and a model whose class name tells transformers no loss (GPT-2's ``GPT2LMHeadModel``) is
        given the causal-LM loss by name: the loss transformers falls back to, without its warning at the first
        step that it fell back."""
        if getattr(model, "loss_type", "") is None:
            model.loss_type = "ForCausalLM"
        return super().adapt_model(model, tokenizer)

    def hub_data(self, args):
        """The embedded corpus needs no Hub; nor does a run without data or model flags (it trains on that corpus)."""
        no_flags = not (args.dataset_name or args.train_file) and uses_embedded_model(args)
        if args.dataset_name in self.embedded_datasets or no_flags:
            return []
        return super().hub_data(args)

    def metric_columns(self) -> list[str]:
        return [*self.metric_names(), "eval_loss"]

    def extra_results(self):
        return {"block_size": self.block, "stride": self.stride}

    def card_training_rows(self, results, settings):
        return [
            ("block size", results.get("block_size")),
            ("perplexity protocol", f"{settings.get('perplexity_protocol')} (stride {results.get('stride')})"),
        ]

    def load_raw(self, args):
        percentage = args.validation_split_percentage or 5
        if args.train_file:
            builder, files = local_text_files(args)
            kwargs = {"keep_linebreaks": True} if builder == "text" else {}
            raw = load_data(builder, data_files=files, what="local data", **kwargs)
            self.info = DataInfo("local files", files=list(files.values()))
        elif args.dataset_name == EMBEDDED_CORPUS or (args.dataset_name is None and uses_embedded_model(args)):
            raw = embedded_corpus()
            self.info = DataInfo(EMBEDDED_CORPUS, dataset_config="topics")
        elif args.dataset_name == shakespeare.CORPUS_NAME:
            raw = shakespeare.corpus()
            self.info = DataInfo(
                shakespeare.CORPUS_NAME, dataset_config="characters", eval_split="validation (last 10 %, nanoGPT's)"
            )
        else:
            name, config = (args.dataset_name, args.dataset_config_name)
            if name is None:
                name, config = DEFAULT_CLM_DATASET[0], config or DEFAULT_CLM_DATASET[1]
            raw = load_data(name, config)
            self.info = DataInfo(name, dataset_config=config, hub_dataset=True)
            if args.eval_split:
                if args.eval_split not in raw:
                    raise RecipeError(f"--eval_split {args.eval_split!r}: {name} has splits {list(raw)}.")
                raw["validation"] = raw[args.eval_split]
                self.info.eval_split = args.eval_split
        if "validation" not in raw:
            raw, self.info.eval_split = split_off_validation(raw, percentage, args)
        return raw

    def check_raw(self, args, raw):
        column = args.text_column_name
        if column is None:
            columns = raw["train"].column_names
            column = "text" if "text" in columns else columns[0]
        require_columns(raw, {"text": column}, ["train", "validation"])
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
            if args.train_stride in (None, block):
                train = tokenized.map(group_texts, batched=True, desc=f"Grouping into blocks of {block}", **map_kwargs)
            else:
                stream = torch.tensor(list(itertools.chain.from_iterable(tokenized["input_ids"])), dtype=torch.long)
                train = TokenWindows(stream, block, args.train_stride)
        if len(train) == 0:
            raise RecipeError(f"The training text is shorter than one block of {block} tokens; lower --block_size.")
        train = first_examples(train, args.max_train_samples)

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
            for batch in progress_bar(dataloader, accelerator, "Evaluating", progress):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                nll, count = window_nll(logits, batch["targets"])
                nll, count = accelerator.gather_for_metrics((nll, count))
                sums.append(nll.double().cpu())
                counts.append(count.double().cpu())
        model.train()
        return perplexity_from_windows(torch.cat(sums), torch.cat(counts), self.protocol)


class TokenWindows(torch.utils.data.Dataset):
    """Training windows of ``block`` tokens starting every ``stride`` tokens of one token stream, made when read
    (``--train_stride``; overlapping windows would not fit in memory as a table). ``stride=1`` is every offset:
    shuffled, it is nanoGPT's sampler (a window at a uniformly random offset), drawn without replacement.

    Each item: ``{"input_ids": (block,), "labels": (block,)}`` (the model shifts the labels).
    """

    def __init__(self, stream: torch.Tensor, block: int, stride: int, count: int | None = None):
        self.stream, self.block, self.stride = stream, block, stride
        available = max(0, (len(stream) - block) // stride + 1)
        self.count = available if count is None else min(count, available)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        window = self.stream[index * self.stride : index * self.stride + self.block]
        return {"input_ids": window, "labels": window}

    def select(self, indices) -> TokenWindows:
        """The first windows (``--max_train_samples``, through ``first_examples``); only a leading range."""
        indices = list(indices)
        if indices != list(range(len(indices))):
            raise ValueError("TokenWindows.select takes a leading range")
        return TokenWindows(self.stream, self.block, self.stride, len(indices))


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
