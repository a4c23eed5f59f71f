"""A patched model's folder resolves its tokenizer, image processor, feature extractor and processor exactly as its
base's folder does.

A patched config.json says ``model_type: "hf_neural_attn"``, so where a tokenizer_config.json or
preprocessor_config.json names no class, transformers' Auto classes fall back on the config class: each patched
config class is registered wherever its base class is. Each test saves the same files beside the unpatched and the
patched model and compares what the Auto classes build.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.models import BERT_COMMON, tiny_gpt2, tiny_llama, tiny_vit
from transformers import (
    AutoImageProcessor,
    AutoProcessor,
    AutoTokenizer,
    BertConfig,
    BertModel,
    BertTokenizer,
    GPT2Tokenizer,
    LlamaTokenizer,
    ViTImageProcessor,
)

import hf_neural_attn

BPE_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "ab": 5, "Ġ": 6, "Ġab": 7}
WORDPIECE_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "##s"]


def unnamed(folder: Path, filename: str, key: str) -> None:
    """Drop the class name transformers wrote, so the Auto class has to go by the model's config."""
    path = folder / filename
    content = json.loads(path.read_text())
    content.pop(key, None)
    path.write_text(json.dumps(content))


def base_and_patched_folders(tmp_path: Path, model, write_files) -> tuple[Path, Path]:
    base, patched = tmp_path / "base", tmp_path / "patched"
    model.save_pretrained(base)
    hf_neural_attn.patch_model(model, "qana", h=2)
    model.save_pretrained(patched)
    for folder in (base, patched):
        write_files(folder)
    assert json.loads((patched / "config.json").read_text())["model_type"] == "hf_neural_attn"
    return base, patched


def tiny_bert_model() -> BertModel:
    torch.manual_seed(0)
    return BertModel(BertConfig(**BERT_COMMON)).eval()


def test_a_bert_folder_with_only_a_vocabulary(tmp_path):
    def vocabulary_only(folder: Path) -> None:
        (folder / "vocab.txt").write_text("\n".join(WORDPIECE_VOCAB) + "\n")

    base, patched = base_and_patched_folders(tmp_path, tiny_bert_model(), vocabulary_only)
    expected, tokenizer = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(patched)
    assert type(tokenizer) is type(expected) is BertTokenizer
    pair = tokenizer("the cat sat", "on the mats")
    assert pair == expected("the cat sat", "on the mats")
    assert set(pair["token_type_ids"]) == {0, 1}  # sentence pairs keep their segment ids


@pytest.mark.parametrize(
    "factory,tokenizer_class",
    [(tiny_gpt2, GPT2Tokenizer), (tiny_llama, LlamaTokenizer)],
    ids=["gpt2", "llama"],
)
def test_a_decoder_folder_whose_tokenizer_config_names_no_class(tmp_path, factory, tokenizer_class):
    def tokenizer_files(folder: Path) -> None:
        tokenizer_class(vocab=dict(BPE_VOCAB), merges=[("a", "b"), ("Ġ", "ab")]).save_pretrained(folder)
        unnamed(folder, "tokenizer_config.json", "tokenizer_class")

    base, patched = base_and_patched_folders(tmp_path, factory(), tokenizer_files)
    expected, tokenizer = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(patched)
    assert type(tokenizer) is type(expected)  # for Llama, transformers' own choice is its generic backend
    assert tokenizer("ab ab")["input_ids"] == expected("ab ab")["input_ids"]


def test_a_vit_folder_whose_preprocessor_config_names_no_class(tmp_path):
    def processor_files(folder: Path) -> None:
        ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(folder)
        unnamed(folder, "preprocessor_config.json", "image_processor_type")

    base, patched = base_and_patched_folders(tmp_path, tiny_vit(), processor_files)
    for auto_class in (AutoImageProcessor, AutoProcessor):
        expected, processor = auto_class.from_pretrained(base), auto_class.from_pretrained(patched)
        assert type(processor) is type(expected)
        assert processor.to_dict() == expected.to_dict()
