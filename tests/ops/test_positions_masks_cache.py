"""Contracts 3 and 4: relative position under RoPE, causal and padding masks, the KV cache, generate()."""

import pytest
import torch
from helpers.models import VOCAB, family_names, perturb_scorers, tiny_model, tokens

import hf_neural_attn
from hf_neural_attn.attention import hf_neural_attention_forward
from hf_neural_attn.families.llama import LlamaFamily

CAUSAL = family_names(core=True, causal=True)
# Agreement between two fp32 computations of the same logits through different summation orders
# (cache vs. no cache, shifted RoPE angles): observed ~1e-7, bounded at 1e-4 as the contract states.
TOL = 1e-4


def live_model(family, scorer_name, **options):
    model = tiny_model(family)
    hf_neural_attn.patch_model(model, scorer_name, **options)
    perturb_scorers(model)
    return model


@pytest.mark.parametrize("shift", [1, 17, 50])
def test_qana_on_llama_depends_on_relative_position_only(shift):
    model = live_model("llama", "qana")
    ids = tokens(2, 12)
    positions = torch.arange(12).expand(2, -1)
    base = model(ids, position_ids=positions).logits
    shifted = model(ids, position_ids=positions + shift).logits
    torch.testing.assert_close(shifted, base, rtol=0, atol=TOL)


def test_position_shift_test_catches_missing_row_wise_rope(monkeypatch):
    """Without RoPE on U the QANA term depends on absolute positions, and the test above must fail."""
    monkeypatch.setattr(LlamaFamily, "rotary", lambda self, module, args, kwargs: None)
    model = live_model("llama", "qana")
    ids = tokens(2, 12)
    positions = torch.arange(12).expand(2, -1)
    base = model(ids, position_ids=positions).logits
    shifted = model(ids, position_ids=positions + 17).logits
    assert (shifted - base).abs().max() > 100 * TOL


@pytest.mark.parametrize("family", CAUSAL)
def test_later_tokens_never_move_earlier_logits(family, scorer_name):
    model = live_model(family, scorer_name)
    ids = tokens(2, 12)
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 5) % VOCAB
    before, after = model(ids).logits, model(changed).logits
    torch.testing.assert_close(after[:, :7], before[:, :7], rtol=0, atol=1e-6)
    assert (after[:, 7:] - before[:, 7:]).abs().max() > 1e-3


def test_attention_function_applies_causal_mask_when_handed_none():
    """A causal module that receives no mask (a direct call) still attends causally."""
    model = live_model("llama", "neural")
    attention = model.model.layers[0].self_attn
    query = torch.randn(1, 4, 5, 8)
    key, value = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    _, probs = hf_neural_attention_forward(attention, query, key, value, None, scaling=8**-0.5)
    assert probs.shape == (1, 4, 5, 5)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.all(probs[..., ~allowed] == 0)
    assert torch.all(probs[..., allowed] > 0)


@pytest.mark.parametrize("family", CAUSAL)
@pytest.mark.parametrize("layers", [None, [1]])
def test_left_padded_batch_matches_each_sequence_alone(family, scorer_name, layers):
    model = live_model(family, scorer_name, layers=layers)
    long, short = tokens(1, 9, seed=4), tokens(1, 6, seed=5)
    pad = 9 - 6
    ids = torch.zeros(2, 9, dtype=torch.long)
    ids[0], ids[1, pad:] = long[0], short[0]
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :pad] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batched = model(ids, attention_mask=attention_mask, position_ids=position_ids).logits
    torch.testing.assert_close(batched[0], model(long).logits[0], rtol=0, atol=TOL)
    torch.testing.assert_close(batched[1, pad:], model(short).logits[0], rtol=0, atol=TOL)


@pytest.mark.parametrize("family", CAUSAL)
def test_incremental_step_with_cache_matches_full_forward(family, scorer_name):
    model = live_model(family, scorer_name)
    ids = tokens(2, 10)
    full = model(ids).logits
    prefix = model(ids[:, :7], use_cache=True)
    cache = prefix.past_key_values
    step = model(ids[:, 7:8], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], full[:, 7], rtol=0, atol=TOL)
    # Two more tokens at once, on top of the grown cache.
    rest = model(ids[:, 8:10], past_key_values=step.past_key_values, use_cache=True)
    torch.testing.assert_close(rest.logits, full[:, 8:10], rtol=0, atol=TOL)


@pytest.mark.parametrize("family", CAUSAL)
def test_generate_is_the_same_with_and_without_cache(family, scorer_name):
    model = live_model(family, scorer_name)
    prompt = tokens(2, 5)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, use_cache=True, **settings)
    without_cache = model.generate(prompt, use_cache=False, **settings)
    assert with_cache.shape == (2, 13)
    assert torch.equal(with_cache, without_cache)


@pytest.mark.parametrize("layers", [None, [1]])
def test_static_cache_prefill_matches_the_full_forward(layers):
    """Over an SDPA base, transformers hands a static cache's prefill no mask (SDPA's is_causal, aligned to the
    first query, stands for it) while the keys include the cache's empty slots: those must stay unseen."""
    from transformers import StaticCache

    model = live_model("llama", "qana", layers=layers)
    assert model.config.hf_neural_attn["base_attn_implementation"] == "sdpa"
    ids = tokens(2, 6)
    cache = StaticCache(config=model.config, max_cache_len=16)
    prefill = model(ids, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(prefill, model(ids).logits, rtol=0, atol=TOL)
    step = model(ids[:, :1], past_key_values=cache, use_cache=True).logits  # one more token on the static cache
    torch.testing.assert_close(step[:, -1], model(torch.cat([ids, ids[:, :1]], 1)).logits[:, -1], rtol=0, atol=TOL)
