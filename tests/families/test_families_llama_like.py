"""Mistral, Qwen2, Qwen3 and Gemma: Llama's attention layout, served by the Llama adapter."""

import pytest
import torch
from helpers.models import assert_left_padding_and_cache_exact, family_cases, perturb_scorers, tokens

import hf_neural_attn


@pytest.fixture(params=family_cases(adapter="llama", core=False))
def case(request):
    """Each Llama-like row of FAMILY_CASES (Mistral with a sliding window shorter than the test sequences)."""
    return request.param


def test_patch_preserves_then_moves_logits_and_is_recorded(case, scorer_name):
    model = case.build()
    ids = tokens(2, 12)
    original = model(ids).logits
    hf_neural_attn.patch_model(model, scorer_name)
    assert model.config.hf_neural_attn["family"] == case.recorded
    torch.testing.assert_close(model(ids).logits, original, rtol=0, atol=1e-5)
    perturb_scorers(model, std=1.0)
    # As in test_function_preserving: the init agrees to ~1e-7; a live scorer moves logits 100x the bound.
    assert (model(ids).logits - original).abs().max() > 100 * 1e-5
    hf_neural_attn.unpatch_model(model)
    assert torch.equal(model(ids).logits, original)


def test_qana_depends_on_relative_position_only(case):
    model = case.build()
    hf_neural_attn.patch_model(model, "qana")
    perturb_scorers(model, std=0.5)
    ids = tokens(2, 12)
    positions = torch.arange(12).expand(2, -1)
    torch.testing.assert_close(
        model(ids, position_ids=positions + 13).logits, model(ids, position_ids=positions).logits, rtol=0, atol=1e-4
    )


def test_left_padding_cache_and_generate(case, scorer_name):
    model = case.build()
    hf_neural_attn.patch_model(model, scorer_name)
    perturb_scorers(model, std=0.5)
    assert_left_padding_and_cache_exact(model)
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    prompt = tokens(2, 5)
    with_cache = model.generate(prompt, use_cache=True, **settings)
    assert torch.equal(with_cache, model.generate(prompt, use_cache=False, **settings))


def test_checkpoint_round_trip(case, tmp_path):
    model = case.build()
    hf_neural_attn.patch_model(model, "qana", layers=[1])
    perturb_scorers(model, std=0.5)
    model.save_pretrained(tmp_path / case.name)
    loaded = hf_neural_attn.from_pretrained(tmp_path / case.name)
    ids = tokens(2, 8)
    assert type(loaded) is type(model)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
