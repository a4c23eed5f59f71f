"""What the text tasks (``clm.py``, ``glue.py``) share: text files, the tokenizer, and the embedded GPT-2.

The embedded model, built when no model flag is given, is a small GPT-2-shaped config with the byte-level
``ByT5Tokenizer``: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import hf_neural_attn
from recipes.errors import RecipeError
from recipes.tasks.base import Task

logger = logging.getLogger(__name__)

# --train_file / --validation_file extension -> the `datasets` builder that reads it.
TEXT_EXTENSIONS = {"txt": "text", "text": "text", "csv": "csv", "json": "json", "jsonl": "json"}
TEXT_FILE_FLAGS = ("train_file", "validation_file", "validation_mismatched_file")
# The embedded model: small enough to train on two CPU cores in a minute or two.
EMBEDDED_TEXT_CONFIG = {
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
}
EMBEDDED_BLOCK_SIZE = 128
EMBEDDED_NAME = "embedded (built from a config here, byte-level ByT5Tokenizer)"


class TextTask(Task):
    """A task over text: local data in text files, a tokenizer, a decoder (or a classifier on one)."""

    head_hint = "Use a decoder such as gpt2 or llama."
    # Why plain .txt files cannot hold this task's data (labelled tasks need .csv or .json), or None where they can;
    # whether it reads --validation_mismatched_file (MNLI).
    plain_text_refused: str | None = None
    reads_mismatched_file = False

    def check_args(self, args: argparse.Namespace) -> None:
        if args.train_dir or args.validation_dir:
            raise RecipeError(
                f"--train_dir/--validation_dir are for --task image; --task {args.task} reads --train_file."
            )
        if args.validation_mismatched_file and not self.reads_mismatched_file:
            raise RecipeError("--validation_mismatched_file is for --task mnli only.")
        for name in TEXT_FILE_FLAGS:
            path = getattr(args, name)
            if path is None:
                continue
            if not os.path.isfile(path):
                raise RecipeError(f"--{name} {path} does not exist.")
            extension = path.rsplit(".", 1)[-1].lower()
            if extension not in TEXT_EXTENSIONS:
                raise RecipeError(
                    f"--{name} {path}: unsupported file type .{extension}; use .txt, .csv, .json or .jsonl."
                )
            if self.plain_text_refused and TEXT_EXTENSIONS[extension] == "text":
                raise RecipeError(f"--{name} {path}: {self.plain_text_refused}")
        extensions = {
            TEXT_EXTENSIONS[p.rsplit(".", 1)[-1].lower()] for p in (args.train_file, args.validation_file) if p
        }
        if len(extensions) > 1:
            raise RecipeError("--train_file and --validation_file must be of the same type (both text, csv or json).")
        if args.validation_file and not args.train_file:
            raise RecipeError("--validation_file needs --train_file too.")
        super().check_args(args)

    def embedded_config(self, args: argparse.Namespace):
        from transformers import GPT2Config

        return GPT2Config(**EMBEDDED_TEXT_CONFIG, n_positions=args.block_size or EMBEDDED_BLOCK_SIZE)

    def embedded_source(self, args: argparse.Namespace) -> str:
        if args.tokenizer_name:
            return f"embedded (built from a config here, tokenizer {args.tokenizer_name})"
        return EMBEDDED_NAME

    # Whether the task pads batches with the tokenizer's pad token (classification does; clm masks its own padding).
    pads_with_tokenizer = True

    def load_preprocessor(self, args: argparse.Namespace, config):
        """The tokenizer: --tokenizer_name, the model's, or the byte-level ByT5Tokenizer (no download)."""
        return load_tokenizer(args, needs_pad_token=self.pads_with_tokenizer)

    def configure_model(self, config, tokenizer, args: argparse.Namespace, labels: dict[str, Any] | None) -> None:
        """Fit the config to the tokenizer (from-scratch models) and to the task's labels (classification)."""
        if args.model_name_or_path is None:
            overridden = set(_override_keys(args.config_overrides))
            if "vocab_size" not in overridden:
                config.vocab_size = len(tokenizer)
            eos = tokenizer.eos_token_id
            for name, value in (("bos_token_id", tokenizer.bos_token_id or eos), ("eos_token_id", eos)):
                if name not in overridden and hasattr(config, name):
                    setattr(config, name, value)
        if labels is not None:
            config.num_labels = labels["num_labels"]
            config.problem_type = "regression" if labels["regression"] else "single_label_classification"
            if not labels["regression"]:
                config.id2label = dict(enumerate(labels["names"]))
                config.label2id = {name: index for index, name in enumerate(labels["names"])}
            config.pad_token_id = tokenizer.pad_token_id

    def adapt_model(self, model, tokenizer) -> set[str]:
        """Grow the embeddings to a tokenizer with more tokens; the resized matrices have new rows to learn, so they
        stay trainable under --train_only_new_params."""
        # The whole matrix's rows: under DeepSpeed ZeRO-3 the weight's own shape is each process's empty placeholder.
        if len(tokenizer) <= hf_neural_attn.full_shape(model.get_input_embeddings().weight)[0]:
            return set()
        model.resize_token_embeddings(len(tokenizer))
        resized = [model.get_input_embeddings(), model.get_output_embeddings()]
        resized_weights = {id(module.weight) for module in resized if module is not None}
        return {name for name, parameter in model.named_parameters() if id(parameter) in resized_weights}

    def token_labels(self, tokenizer):
        return tokenizer


def local_text_files(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    """The `datasets` builder for ``--train_file``'s extension and the files of each split."""
    files = {"train": args.train_file}
    if args.validation_file:
        files["validation"] = args.validation_file
    if getattr(args, "validation_mismatched_file", None):
        files["validation_mismatched"] = args.validation_mismatched_file
    builder = TEXT_EXTENSIONS[args.train_file.rsplit(".", 1)[-1].lower()]
    return builder, files


def load_tokenizer(args: argparse.Namespace, needs_pad_token: bool = True):
    """The tokenizer: --tokenizer_name, the model's, or the byte-level ByT5Tokenizer (no download). A tokenizer
    without a pad token pads with its eos token; without either, it is refused only where ``needs_pad_token``."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    name = args.tokenizer_name or args.model_name_or_path
    if name is None:
        if args.model_type or args.config_name:
            built = f"--model_type {args.model_type}" if args.model_type else f"--config_name {args.config_name}"
            why = f"the model is built from scratch ({built}) without a tokenizer of its own"
        else:
            why = "the model is the embedded one"
        logger.info(
            "Tokenizer: the byte-level ByT5Tokenizer, as --tokenizer_name is not given and %s; pass "
            "--tokenizer_name (e.g. gpt2) for another.",
            why,
        )
        return ByT5Tokenizer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as error:
        raise RecipeError(f"Could not load a tokenizer from {name!r}: {error}") from error
    logger.info(
        "Tokenizer: %s from %s (%s)",
        type(tokenizer).__name__,
        name,
        "--tokenizer_name" if args.tokenizer_name else "the model's own, --model_name_or_path",
    )
    if tokenizer.pad_token is None and (tokenizer.eos_token is not None or needs_pad_token):
        # The standard Hugging Face way for decoders without a pad token (GPT-2, Llama).
        if tokenizer.eos_token is None:
            raise RecipeError(f"The tokenizer of {name!r} has neither a pad nor an eos token to pad with.")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _override_keys(overrides: str | None) -> list[str]:
    return [item.split("=", 1)[0].strip() for item in (overrides or "").split(",") if "=" in item]
