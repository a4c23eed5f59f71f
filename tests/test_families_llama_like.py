"""Mistral, Qwen2, Qwen3 and Gemma: Llama's attention layout, served by the Llama adapter."""

import copy

import pytest
import torch
from helpers import TINY_DECODER as COMMON
from helpers import assert_left_padding_and_cache_exact, perturb_scorers, tokens
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_neural_attn

MODELS = {
    # A sliding window shorter than the test sequences, so the window mask is exercised.
    "mistral": (MistralForCausalLM, MistralConfig(**COMMON, sliding_window=6)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON, head_dim=8)),  # per-head q_norm / k_norm
    "gemma": (GemmaForCausalLM, GemmaConfig(**COMMON, head_dim=8)),
}


def build(name):
    model_class, config = MODELS[name]
    torch.manual_seed(0)
    return model_class(copy.deepcopy(config)).eval()


@pytest.fixture(params=list(MODELS))
def name(request):
    return request.param


def test_patch_preserves_then_moves_logits_and_is_recorded(name, scorer_name):
    model = build(name)
    ids = tokens(2, 12)
    original = model(ids).logits
    hf_neural_attn.patch_model(model, scorer_name)
    assert model.config.hf_neural_attn["family"] == name
    torch.testing.assert_close(model(ids).logits, original, rtol=0, atol=1e-5)
    perturb_scorers(model, std=1.0)
    # As in test_function_preserving: the init agrees to ~1e-7; a live scorer moves logits 100x the bound.
    assert (model(ids).logits - original).abs().max() > 100 * 1e-5
    hf_neural_attn.unpatch_model(model)
    assert torch.equal(model(ids).logits, original)


def test_qana_depends_on_relative_position_only(name):
    model = build(name)
    hf_neural_attn.patch_model(model, "qana")
    perturb_scorers(model, std=0.5)
    ids = tokens(2, 12)
    positions = torch.arange(12).expand(2, -1)
    torch.testing.assert_close(
        model(ids, position_ids=positions + 13).logits, model(ids, position_ids=positions).logits, rtol=0, atol=1e-4
    )


def test_left_padding_cache_and_generate(name, scorer_name):
    model = build(name)
    hf_neural_attn.patch_model(model, scorer_name)
    perturb_scorers(model, std=0.5)
    assert_left_padding_and_cache_exact(model)
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    prompt = tokens(2, 5)
    with_cache = model.generate(prompt, use_cache=True, **settings)
    assert torch.equal(with_cache, model.generate(prompt, use_cache=False, **settings))


def test_checkpoint_round_trip(name, tmp_path):
    model = build(name)
    hf_neural_attn.patch_model(model, "qana", layers=[1])
    perturb_scorers(model, std=0.5)
    model.save_pretrained(tmp_path / name)
    loaded = hf_neural_attn.from_pretrained(tmp_path / name)
    ids = tokens(2, 8)
    assert type(loaded) is type(model)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
