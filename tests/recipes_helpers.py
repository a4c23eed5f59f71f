"""Tiny models, tokenizers and data files for the recipe tests, all built here (nothing is downloaded)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The recipes are a package of the repository (importable from its root: pytest's pythonpath has "."), run as
# modules: `python -m recipes.finetune` from the repository root.
ROOT = Path(__file__).resolve().parent.parent
FINETUNE = ["-m", "recipes.finetune"]

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "tree",
    "good",
    "bad",
    "great",
    "awful",
    "fine",
    "poor",
    "nice",
    "dull",
    "big",
    "small",
    "red",
    "blue",
    "quick",
    "slow",
    "bird",
    "fish",
    "sees",
    "likes",
    "eats",
    "runs",
    "jumps",
    "house",
    "river",
    "hill",
    "sky",
    "sun",
    "moon",
]

# Small GPT-2 shape used throughout: 2 layers, hidden 32, 2 heads (head dim 16). Dropout off so that runs
# with different process counts can be compared (each process would draw its own dropout masks).
TINY_GPT2 = {
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
TINY_GPT2_OVERRIDES = "n_layer=2,n_embd=32,n_head=2,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0"

# A small GPT-2 built from scratch on the demo's text (flags), and --config_overrides that every recipe refuses before
# training, with the error each gives (a regular expression).
TINY_SCRATCH = ["--model_type", "gpt2", "--dataset_name", "pydoc_data", "--block_size", "32", "--max_train_steps", "1"]
BAD_OVERRIDES = {
    "n_layer=1,n_embd=32,n_head=2,attn_pdrop=2": r"'attn_pdrop=2': a dropout probability must be in \[0, 1\]",
    "resid_pdrop=-0.1": r"'resid_pdrop=-0.1': a dropout probability must be in \[0, 1\]",
    "n_layer=1,no_such_key=3": "the gpt2 config \\(GPT2Config\\) has no key 'no_such_key'",
    "n_layer=two": r"'n_layer=two': n_layer takes an integer \(the gpt2 config has n_layer=12\)",
    "n_layer=1,,n_head=2": "'' is not key=value",
    "n_layer": "'n_layer' is not key=value",
    "n_embd=33": "GPT2LMHeadModel cannot be built with --config_overrides 'n_embd=33': ValueError: `embed_dim` must be",
}


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons, which the last in-process run's Accelerator set."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread while in the block: tiny models gain nothing from two, and on a busy machine two threads
    that wait for each other make a run many times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def in_process_runs() -> Iterator[None]:
    """Where recipe runs happen in this process (a module-scoped fixture's, which the function-scoped fixtures
    below do not cover): one thread, and Accelerate's state reset afterwards."""
    with single_thread():
        try:
            yield
        finally:
            reset_accelerate_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process run builds its own Accelerator; reset Accelerate's process-wide singletons after it."""
    yield
    reset_accelerate_state()


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread for in-process recipe runs (see single_thread)."""
    with single_thread():
        yield


def recipe_assets(root: Path) -> dict[str, Path]:
    """Tiny GPT-2, Llama and ViT checkpoints, text files and image folders under ``root``, as recipe flags name
    them (a test module builds them once, in a module-scoped fixture)."""
    train, validation = write_text_files(root / "text")
    images_train, images_validation = write_image_folders(root / "images")
    return {
        "root": root,
        "gpt2": save_tiny_gpt2(root / "tiny-gpt2"),
        "llama": save_tiny_llama(root / "tiny-llama"),
        "vit": save_tiny_vit(root / "tiny-vit"),
        "train_txt": train,
        "validation_txt": validation,
        "images_train": images_train,
        "images_validation": images_validation,
    }


def finetune_in_process(output_dir: Path, *flags: str) -> dict:
    """``recipes.finetune`` run here, with ``flags`` into ``output_dir``; returns what ``run`` returns."""
    from recipes.args import parse_args
    from recipes.training import run

    return run(parse_args([*flags, "--output_dir", str(output_dir)]))


def clm_flags(assets, *extra: str) -> list[str]:
    """A 4-step causal-LM run of the tiny GPT-2 on the assets' text files, then ``extra``."""
    return [
        *("--model_name_or_path", str(assets["gpt2"]), "--train_file", str(assets["train_txt"])),
        *("--validation_file", str(assets["validation_txt"])),
        *("--task", "clm", "--block_size", "32", "--per_device_train_batch_size", "4"),
        *("--per_device_eval_batch_size", "4", "--learning_rate", "1e-3", "--max_train_steps", "4"),
        *extra,
    ]


def png_size(path: Path) -> tuple[int, int]:
    """The pixel size of a PNG a run wrote (a truncated or non-PNG file fails)."""
    from PIL import Image

    assert path.is_file() and path.stat().st_size > 5_000, f"{path} missing or empty"
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()
        return image.size


def map_size(heads: int) -> tuple[int, int]:
    """attention_maps.png: a column per head; rows patched, unpatched, difference (plotting's documented size)."""
    return round(100 * (2.4 * heads + 1.2)), round(100 * (2.4 * 3 + 1.0))


def tiny_recipe_assets(root: Path) -> dict[str, Path]:
    """A tiny GPT-2 checkpoint and train/validation text files under ``root``, as recipe flags name them."""
    train, validation = write_text_files(root / "text")
    return {"gpt2": save_tiny_gpt2(root / "tiny-gpt2"), "train_txt": train, "validation_txt": validation}


def offline_env(home: Path | None = None, **extra: str) -> dict[str, str]:
    """Environment for recipe subprocesses: no Hub, one thread per process (deterministic float results)."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    if home is not None:
        env["HF_HOME"] = str(home)
    env.update(extra)
    return env


def run_recipe(args: list[str], env: dict[str, str], timeout: int = 300, launcher: list[str] | None = None):
    command = (launcher or [sys.executable]) + [*FINETUNE, *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


# ------------------------------------------------------------------------------------------------ text


def sentences(count: int, seed: int, length: int = 8) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(count)]


def write_text_files(folder: Path, train_lines: int = 120, validation_lines: int = 30) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    train, validation = folder / "train.txt", folder / "validation.txt"
    train.write_text("\n".join(sentences(train_lines, seed=1)) + "\n")
    validation.write_text("\n".join(sentences(validation_lines, seed=2)) + "\n")
    return train, validation


def write_glue_files(
    folder: Path, task: str, train_rows: int = 32, eval_rows: int = 16, fmt: str = "csv"
) -> dict[str, Path]:
    """GLUE-shaped files with the task's columns; labels follow a simple rule of the words, so a model can learn."""
    from recipes.tasks.glue import TASK_TO_KEYS

    folder.mkdir(parents=True, exist_ok=True)
    first, second = TASK_TO_KEYS[task]
    names = {"mnli": ["entailment", "neutral", "contradiction"]}

    def rows(count: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            row = {first: " ".join(rng.choice(WORDS) for _ in range(6))}
            if second:
                row[second] = " ".join(rng.choice(WORDS) for _ in range(5))
            positive = ("good" in row[first]) or ("great" in row[first])
            if task == "stsb":
                row["label"] = round(rng.uniform(0, 5), 2)
            elif task == "mnli":
                row["label"] = names["mnli"][rng.randrange(3)]  # string labels, mapped by the recipe
            else:
                row["label"] = int(positive)
            out.append(row)
        return out

    splits = {"train": rows(train_rows, 11), "validation": rows(eval_rows, 12)}
    if task == "mnli":
        splits["validation_mismatched"] = rows(eval_rows - 2, 13)
    paths = {}
    for split, data in splits.items():
        path = folder / f"{task}_{split}.{fmt}"
        if fmt == "csv":
            with open(path, "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=list(data[0]))
                writer.writeheader()
                writer.writerows(data)
        else:
            path.write_text("".join(json.dumps(row) + "\n" for row in data))
        paths[split] = path
    return paths


def glue_file_args(paths: dict[str, Path]) -> list[str]:
    args = ["--train_file", str(paths["train"]), "--validation_file", str(paths["validation"])]
    if "validation_mismatched" in paths:
        args += ["--validation_mismatched_file", str(paths["validation_mismatched"])]
    return args


# ---------------------------------------------------------------------------------------------- images


def write_image_folders(
    folder: Path, per_class_train: int = 6, per_class_eval: int = 3, size: int = 12
) -> tuple[Path, Path]:
    """Three colour classes of small PNGs: red, green and blue noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", per_class_train), ("validation", per_class_eval)):
        for channel, name in enumerate(("red", "green", "blue")):
            target = folder / split / name
            target.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                pixels = (rng.random((size, size, 3)) * 90).astype("uint8")
                pixels[..., channel] += 150
                Image.fromarray(pixels).save(target / f"{index}.png")
    return folder / "train", folder / "validation"


# ---------------------------------------------------------------------------------------------- models


def save_tiny_gpt2(folder: Path, seed: int = 0, dropout: float = 0.0) -> Path:
    """A 2-layer GPT-2 (hidden 32) with the byte-level ByT5 tokenizer, saved as a pretrained folder."""
    import torch
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = ByT5Tokenizer()
    torch.manual_seed(seed)
    sizes = {**TINY_GPT2, "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=1, **sizes)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def word_tokenizer(pad: bool):
    """A word-level fast tokenizer over WORDS; without a pad token unless ``pad`` (as GPT-2's and Llama's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "</s>"] + (["[PAD]"] if pad else [])
    vocab = {token: index for index, token in enumerate(specials + sorted(set(WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = {"pad_token": "[PAD]"} if pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>", **extra)


def save_tiny_llama(folder: Path, seed: int = 0, **sizes: int) -> Path:
    """A 2-layer Llama (hidden 32, grouped-query attention; config ``sizes`` override those) with a word tokenizer
    that has no pad token."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer(pad=False)
    torch.manual_seed(seed)
    sizes = {"hidden_size": 32, "intermediate_size": 64, **sizes}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=1,
        **sizes,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_vit(folder: Path, num_labels: int = 3, seed: int = 0) -> Path:
    """A 2-layer ViT (hidden 32, 16x16 images, patch 4) and its image processor."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessorPil

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=num_labels,
    )
    ViTForImageClassification(config).save_pretrained(folder)
    ViTImageProcessorPil(size={"height": 16, "width": 16}).save_pretrained(folder)
    return folder


def read_results(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "all_results.json").read_text())


def read_history(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "training_history.json").read_text())


def without_times(history: dict) -> dict:
    """A training history without its wall-clock readings (each evaluation's ``elapsed_s``), which no two runs
    share: what a resumed or repeated run must reproduce exactly."""
    evaluations = [{k: v for k, v in e.items() if k != "elapsed_s"} for e in history.get("evaluations", [])]
    return {**history, "evaluations": evaluations}
