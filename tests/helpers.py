"""Tiny models built from configs (no downloads) and helpers shared by the tests (import from here, never
from conftest or another test file)."""

from __future__ import annotations

import os

# Nothing in the tests may reach the Hub; say so, so a stray lookup fails at once instead of waiting.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

import hf_neural_attn  # noqa: E402

VOCAB = 64


# A tiny rotary decoder: 2 layers, 4 query heads sharing 2 key/value heads (grouped-query attention). Llama,
# Mistral, Qwen and Gemma configs all take these keys.
TINY_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
)


def tiny_llama(**overrides) -> LlamaForCausalLM:
    config = {**TINY_DECODER, **overrides}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def tiny_gpt2(**overrides) -> GPT2LMHeadModel:
    # GPT-2 configs default to 0.1 dropout on residuals, embeddings and attention; tests that compare
    # train-mode runs need them off (the dropout test turns attention dropout back on).
    config = dict(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config.update(overrides)
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**config)).eval()


def tiny_vit(**overrides) -> ViTForImageClassification:
    config = dict(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=3,
    )
    config.update(overrides)
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(**config)).eval()


FACTORIES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "vit": tiny_vit}
SCORER_NAMES = ["qana", "neural"]


def model_inputs(family: str, batch: int = 2, seq: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if family == "vit":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=generator)}
    return {"input_ids": torch.randint(2, VOCAB, (batch, seq), generator=generator)}


def perturb_scorers(model, std: float = 0.3, seed: int = 0) -> None:
    """Move every new parameter away from its init, so the scorer's nonlinear path is live."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def logits(model, inputs: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    return model(**inputs, **kwargs).logits
