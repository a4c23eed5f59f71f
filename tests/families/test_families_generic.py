"""Phi-3 and the decoders served by the standard-attention adapter (explicit entries and the generic fallback),
and the models it refuses. Tiny configs, built offline.

Tolerances as in test_families_llama_like: the patched init equals the original to rounding (bounded at 1e-5),
two fp32 computations of the same logits by different routes (cache, shifted RoPE angles, padding) to 1e-4.
"""

import sys
import types
import warnings

import pytest
import torch
import transformers as tf
from helpers.models import (
    FAMILY_CASES,
    HEAD_DIM,
    TINY_DECODER,
    assert_left_padding_and_cache_exact,
    family_cases,
    perturb_scorers,
    tiny_model,
    tokens,
)
from helpers.scorers import FUSED_SCORERS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.olmo.modeling_olmo import OlmoAttention, apply_rotary_pos_emb, eager_attention_forward

import hf_neural_attn
from hf_neural_attn.families import FAMILIES, UnsupportedAttentionError
from hf_neural_attn.families.bert import BertFamily
from hf_neural_attn.families.gpt2 import GPT2Family
from hf_neural_attn.families.llama import LlamaFamily
from hf_neural_attn.families.standard import StandardAttentionFamily
from hf_neural_attn.families.vit import ViTFamily
from hf_neural_attn.record import FALLBACK_ATTR

# Phi-3 and the decoders of families/standard_decoders.py (explicit entries, the family name is recorded), and
# those the generic fallback serves (no entry on purpose, recorded as "standard").
CASES = family_cases(adapter="standard")


@pytest.fixture
def without_family(monkeypatch):
    """Take a family out of the registry for one test. The registry's order is restored afterwards too (the
    generic fallback must stay last): monkeypatch.delitem alone would put the entry back after it."""
    saved = dict(FAMILIES)
    yield lambda name: monkeypatch.delitem(FAMILIES, name)
    FAMILIES.clear()
    FAMILIES.update(saved)


def patch(model, case, scorer, **options):
    """Patch; the generic path must say it is generic, an explicit entry must not warn."""
    if case.generic:
        with pytest.warns(UserWarning, match="no tested hf_neural_attn family.*generic standard-attention path"):
            hf_neural_attn.patch_model(model, scorer, **options)
    else:
        hf_neural_attn.patch_model(model, scorer, **options)
    return model


def test_every_registered_family_has_a_row_served_by_its_adapter():
    """FAMILY_CASES (tests/helpers/models.py) has a row for every family of the registry and none for the models left
    to the generic fallback; each row's adapter column names the adapter the library serves it with."""
    adapters = {
        "llama": LlamaFamily,
        "gpt2": GPT2Family,
        "vit": ViTFamily,
        "bert": BertFamily,
        "standard": StandardAttentionFamily,
    }
    assert {case.name for case in FAMILY_CASES if not case.generic} == set(FAMILIES) - {"standard"}
    assert not {case.name for case in FAMILY_CASES if case.generic} & set(FAMILIES)
    assert list(FAMILIES)[-1] == "standard"  # the fallback is tried last
    for case in FAMILY_CASES:
        assert isinstance(FAMILIES[case.recorded], adapters[case.adapter]), case.name


@pytest.mark.parametrize("case", CASES)
def test_both_scorers_preserve_then_move_logits_and_unpatch_restores(case):
    model = case.build()
    ids = tokens(2, 12)
    original = model(ids).logits
    implementation = model.config._attn_implementation
    for scorer_name in FUSED_SCORERS:
        patch(model, case, scorer_name)
        assert model.config.hf_neural_attn["family"] == case.recorded
        torch.testing.assert_close(model(ids).logits, original, rtol=0, atol=1e-5)
        perturb_scorers(model, std=1.0)
        # The init agrees to ~1e-7; a live scorer moves logits by far more than the bound.
        assert (model(ids).logits - original).abs().max() > 100 * 1e-5
        hf_neural_attn.unpatch_model(model)
        assert model.config._attn_implementation == implementation
        assert not hf_neural_attn.scorer_parameters(model)
        assert torch.equal(model(ids).logits, original)


@pytest.mark.parametrize("case", CASES)
def test_qana_positions_left_padding_and_kv_cache(case):
    """QANA is the scorer that reads hidden states and RoPE through the family; Neural Attention's part of the
    plumbing (geometry only) is covered by the preservation test above."""
    model = case.build()
    prompt = tokens(2, 5)
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    unpatched_generation = model.generate(prompt, **settings)
    patch(model, case, "qana")
    # At init the patched model generates what the original does (greedy, with the KV cache).
    assert torch.equal(model.generate(prompt, **settings), unpatched_generation)

    perturb_scorers(model, std=0.5)
    # Shifting every position leaves RoPE scores unchanged only if QANA's rows turn exactly like the model's
    # query (partial rotary, interleaved, local and global RoPE, NoPE layers).
    ids = tokens(2, 12)
    positions = torch.arange(12).expand(2, -1)
    base = model(ids, position_ids=positions).logits
    torch.testing.assert_close(model(ids, position_ids=positions + 13).logits, base, rtol=0, atol=1e-4)

    # Left padding, and (with a live scorer) logits from the KV cache equal those of the full sequence.
    assert_left_padding_and_cache_exact(model)


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_round_trip(case, tmp_path):
    model = patch(case.build(), case, "qana", layers=[1])
    perturb_scorers(model, std=0.5)
    model.save_pretrained(tmp_path / case.name)
    loaded = hf_neural_attn.from_pretrained(tmp_path / case.name)
    ids = tokens(2, 8)
    assert type(loaded) is type(model)
    assert loaded.config.hf_neural_attn["family"] == model.config.hf_neural_attn["family"]
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    family_cases(lambda case: case.name != "phi3", adapter="standard", generic=False),  # Phi-3: no q_proj
)
def test_generic_fallback_alone_serves_every_explicit_model_the_same_way(case, monkeypatch, without_family):
    """The explicit entries are only names: with an entry removed, the fallback patches the model identically."""
    ids = tokens(2, 12)
    explicit = case.build()
    hf_neural_attn.patch_model(explicit, "qana")
    perturb_scorers(explicit, std=1.0)

    without_family(case.name)
    generic = case.build()
    original = generic(ids).logits
    with pytest.warns(UserWarning, match="generic standard-attention path"):
        hf_neural_attn.patch_model(generic, "qana")
    assert generic.config.hf_neural_attn["family"] == "standard"
    torch.testing.assert_close(generic(ids).logits, original, rtol=0, atol=1e-5)
    perturb_scorers(generic, std=1.0)
    torch.testing.assert_close(generic(ids).logits, explicit(ids).logits, rtol=0, atol=1e-6)


def test_phi3_scorer_reads_the_query_rows_of_the_fused_projection_and_rotary_is_partial():
    model = tiny_model("phi3")
    attention = model.model.layers[0].self_attn
    rows = model.config.num_attention_heads * attention.head_dim
    with torch.no_grad():
        attention.qkv_proj.weight[rows:] *= 50  # key and value rows far larger: a std over them would show
    assert model.model.rotary_emb.inv_freq.numel() * 2 == attention.head_dim // 2
    hf_neural_attn.patch_model(model, "qana", h=2)
    geometry = attention.attn_scorer.geometry
    assert geometry.query_weight_std == pytest.approx(float(attention.qkv_proj.weight[:rows].detach().std()), rel=1e-6)
    assert (geometry.hidden_size, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim) == (32, 4, 2, 8)
    assert geometry.query_bias is False


# --- refusals --------------------------------------------------------------------------------------------------


def assert_refused(model, match):
    ids = tokens(1, 6)
    before = model(ids).logits
    implementation = model.config._attn_implementation
    with pytest.raises(UnsupportedAttentionError, match=match):
        hf_neural_attn.patch_model(model, "qana")
    assert isinstance(UnsupportedAttentionError("x"), TypeError)
    assert not hasattr(model.config, "hf_neural_attn")
    assert model.config._attn_implementation == implementation
    assert not any(hasattr(module, FALLBACK_ATTR) for module in model.modules())
    assert torch.equal(model(ids).logits, before)


def test_gemma2_attention_soft_capping_is_refused():
    model = tiny_model("gemma2_no_softcap", attn_logit_softcapping=50.0)
    assert_refused(model, r"Gemma2Attention .*logit soft-capping \(softcap=50.0\)")


def test_gpt_oss_attention_sinks_are_refused():
    config = tf.GptOssConfig(**TINY_DECODER, **HEAD_DIM, num_local_experts=2, num_experts_per_tok=1)
    torch.manual_seed(0)
    assert_refused(tf.GptOssForCausalLM(config).eval(), r"GptOssAttention .*attention sinks")


def test_qwen3_next_gated_query_projection_is_refused():
    config = tf.Qwen3NextConfig(**TINY_DECODER, **HEAD_DIM, layer_types=["full_attention", "full_attention"])
    torch.manual_seed(0)
    model = tf.Qwen3NextForCausalLM(config).eval()
    assert_refused(model, r"Qwen3NextAttention .*64 output rows but its attention scores 4 heads x 8")


def test_two_kinds_of_attention_are_refused_by_the_generic_path():
    model = tiny_model("starcoder2")

    class OtherStarcoder2Attention(type(model.model.layers[1].self_attn)):
        pass

    model.model.layers[1].self_attn.__class__ = OtherStarcoder2Attention
    assert_refused(model, r"several attention classes.*OtherStarcoder2Attention.*Starcoder2Attention")


# Attention modules that look standard but are not: the probe must refuse each, naming what it found.
# They live in a modeling namespace of their own, as a model's classes would.
odd_modeling = types.ModuleType("odd_modeling")
odd_modeling.apply_rotary_pos_emb = apply_rotary_pos_emb


def tempered_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=1.5 * scaling, dropout=dropout)


odd_modeling.eager_attention_forward = tempered_eager_attention


class OddAttention(OlmoAttention):
    query_scale = 1.0
    angle_factor = 1  # RoPE at a multiple of each position

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2) * self.query_scale
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        if self.angle_factor == 2:
            cos, sin = cos * cos - sin * sin, 2 * sin * cos
        query, key = odd_modeling.apply_rotary_pos_emb(query, key, cos, sin)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, odd_modeling.eager_attention_forward
        )
        output, weights = attention(self, query, key, value, attention_mask, scaling=self.scaling, **kwargs)
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1)), weights


class DoubleAngleAttention(OddAttention):
    angle_factor = 2


class ScaledQueryAttention(OddAttention):
    query_scale = 2.0


class TemperedAttention(OddAttention):
    pass


@pytest.mark.parametrize(
    "attention_class, match",
    [
        (DoubleAngleAttention, r"DoubleAngleAttention .*rotates its query differently"),
        (ScaledQueryAttention, r"ScaledQueryAttention .*query is not its query projection"),
        (TemperedAttention, r"TemperedAttention .*not softmax\(scaling \* q k\^T\) v"),
    ],
)
def test_probe_refuses_modules_that_only_look_standard(attention_class, match, monkeypatch, without_family):
    monkeypatch.setitem(sys.modules, "odd_modeling", odd_modeling)
    monkeypatch.setattr(attention_class, "__module__", "odd_modeling")
    model = tiny_model("olmo", clip_qkv=None)
    for layer in model.model.layers:
        layer.self_attn.__class__ = attention_class
    without_family("olmo")
    assert_refused(model, match)


def test_the_odd_attention_itself_passes_the_probe(monkeypatch, without_family):
    """The refusals above come from each module's one difference, not from the test's module as such."""
    monkeypatch.setitem(sys.modules, "odd_modeling", odd_modeling)
    monkeypatch.setattr(odd_modeling, "eager_attention_forward", eager_attention_forward)
    monkeypatch.setattr(OddAttention, "__module__", "odd_modeling")
    model = tiny_model("olmo", clip_qkv=None)
    ids = tokens(2, 8)
    original = model(ids).logits
    for layer in model.model.layers:
        layer.self_attn.__class__ = OddAttention
    torch.testing.assert_close(model(ids).logits, original, rtol=0, atol=1e-6)
    without_family("olmo")
    with pytest.warns(UserWarning, match="OddAttention has no tested hf_neural_attn family"):
        hf_neural_attn.patch_model(model, "qana")
    torch.testing.assert_close(model(ids).logits, original, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_neural_attention_reads_relative_pairs_wherever_the_model_has_rope(case):
    """Neural Attention's default input on RoPE models pairs the dimensions the model's own rotation turns together
    (rotate-half, interleaved, partial; read off the rotation): every layer with RoPE scores relative positions,
    a NoPE layer reads its (unrotated) q and k as they are."""
    model = case.build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit entry must not fall to the generic path (which warns)
        patch(model, case, "neural")
    attention = [module for module in model.modules() if hasattr(module, "attn_scorer")]
    inputs = {module.attn_scorer.pair_input for module in attention}
    assert inputs == ({"relative", "concat"} if case.name == "smollm3" else {"relative"})
    perturb_scorers(model, std=0.5)
    ids = tokens(2, 12)
    positions = torch.arange(12).expand(2, -1)
    base = model(ids, position_ids=positions).logits
    torch.testing.assert_close(model(ids, position_ids=positions + 13).logits, base, rtol=0, atol=1e-4)
