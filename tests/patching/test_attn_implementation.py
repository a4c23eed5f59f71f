"""Switching the attention implementation of a patched model, as transformers' tools do, keeps the scorers.

``model.set_attn_implementation(...)`` and ``config._attn_implementation = ...`` change the *base*
implementation: what the modules the patch does not score run, and whose masks the scored ones get. The scorers keep
running, ``config._attn_implementation`` keeps reading "hf_neural_attn" (what makes transformers call them), the
record says the base, a save records it and ``unpatch_model`` leaves the model on it. Scorers are perturbed (live)
throughout, and only the first layer is scored, so every model also has a module that runs the base.

Tolerances: eager and SDPA compute the same attention in different orders, 1e-4 on logits of tiny fp32 models.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from helpers.models import (
    BERT_COMMON,
    CORE_FAMILIES,
    logits,
    model_inputs,
    padded_inputs,
    perturb_scorers,
    tiny_gpt2,
    tiny_model,
)
from transformers import BertConfig, EncoderDecoderConfig, EncoderDecoderModel, GPT2Config, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_neural_attn

SWITCH_TOLERANCE = {"rtol": 0, "atol": 1e-4}


def patched(family: str, base: str = "sdpa"):
    """(the unpatched model, the same weights patched with live QANA on layer 0), both over ``base``."""
    model = tiny_model(family, attn_implementation=base)
    unpatched = copy.deepcopy(model)
    hf_neural_attn.patch_model(model, "qana", h=2, layers=[0])
    perturb_scorers(model, std=1.0)
    return unpatched, model


@pytest.fixture
def base_calls(monkeypatch):
    """Counts the base implementations the unscored modules run: eager (the module's own eager function) or SDPA."""
    calls = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(
        ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", lambda *a, **k: calls.append("sdpa") or sdpa(*a, **k)
    )
    for module_name in ("llama", "gpt2", "vit", "bert"):
        module = sys.modules[f"transformers.models.{module_name}.modeling_{module_name}"]
        eager = module.eager_attention_forward
        monkeypatch.setattr(
            module, "eager_attention_forward", lambda *a, _eager=eager, **k: calls.append("eager") or _eager(*a, **k)
        )
    return calls


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_switching_eager_and_sdpa_keeps_the_scorers(family, base_calls):
    unpatched, model = patched(family, base="sdpa")
    inputs = model_inputs(family)
    with torch.no_grad():
        over_sdpa = logits(model, inputs)
        assert base_calls == ["sdpa"]  # the unscored second layer
        base_calls.clear()
        model.set_attn_implementation("eager")
        over_eager = logits(model, inputs)
        assert base_calls == ["eager"]
        assert hf_neural_attn.is_patched(model)
        assert model.config._attn_implementation == "hf_neural_attn"  # what makes transformers call the scorers
        assert hf_neural_attn.patch_record(model).base_attn_implementation == "eager"
        assert model.config.base_attn_implementation == "eager"
        torch.testing.assert_close(over_eager, over_sdpa, **SWITCH_TOLERANCE)
        assert (over_eager - logits(unpatched, inputs)).abs().max() > 10 * SWITCH_TOLERANCE["atol"]  # still patched
        # Back, the other way transformers' tools use: writing the config's attribute.
        model.config._attn_implementation = "sdpa"
        torch.testing.assert_close(logits(model, inputs), over_sdpa, rtol=0, atol=1e-6)
        assert hf_neural_attn.patch_record(model).base_attn_implementation == "sdpa"


def test_switching_with_padding_on_an_encoder(base_calls):
    """BERT with right padding: the base's mask form changes (SDPA's boolean, eager's additive) and both scored
    and unscored layers follow it."""
    model = tiny_model("bert", attn_implementation="sdpa")
    hf_neural_attn.patch_model(model, "neural", h=2, layers=[1])
    perturb_scorers(model)
    inputs = padded_inputs("right-padded")
    with torch.no_grad():
        over_sdpa = model(**inputs).last_hidden_state
        model.set_attn_implementation("eager")
        over_eager = model(**inputs).last_hidden_state
    assert base_calls == ["sdpa", "eager"]
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(over_eager[real], over_sdpa[real], **SWITCH_TOLERANCE)


def test_an_implementation_that_cannot_run_gets_transformers_error_and_changes_nothing():
    _, model = patched("llama")
    inputs = model_inputs("llama")
    with torch.no_grad():
        before = logits(model, inputs)
    with pytest.raises(ImportError, match="FlashAttention2"):  # transformers' own check: no flash-attn here
        model.set_attn_implementation("flash_attention_2")
    assert model.config.base_attn_implementation == "sdpa"
    assert hf_neural_attn.patch_record(model).base_attn_implementation == "sdpa"
    with torch.no_grad():
        torch.testing.assert_close(logits(model, inputs), before, rtol=0, atol=0)


def test_a_save_records_the_new_base_and_the_reload_runs_it(tmp_path, base_calls):
    _, model = patched("llama", base="sdpa")
    model.set_attn_implementation("eager")
    model.save_pretrained(tmp_path)
    reloaded = hf_neural_attn.from_pretrained(tmp_path).eval()
    assert hf_neural_attn.patch_record(reloaded).base_attn_implementation == "eager"
    assert reloaded.config.base_attn_implementation == "eager"
    inputs = model_inputs("llama")
    base_calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(logits(reloaded, inputs), logits(model, inputs), rtol=0, atol=1e-6)
    assert set(base_calls) == {"eager"}


def test_unpatch_leaves_the_model_on_the_base_chosen_last():
    unpatched, model = patched("gpt2", base="sdpa")
    model.set_attn_implementation("eager")
    hf_neural_attn.unpatch_model(model)
    assert model.config._attn_implementation == "eager"
    assert type(model.config) is GPT2Config
    unpatched.set_attn_implementation("eager")  # as if set on the unpatched model
    inputs = model_inputs("gpt2")
    for (name, a), (_, b) in zip(model.state_dict().items(), unpatched.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with torch.no_grad():
        torch.testing.assert_close(logits(model, inputs), logits(unpatched, inputs), rtol=0, atol=0)


def test_assisted_decoding_equals_greedy_decoding():
    """transformers' generation test: a patched model as its own assistant decodes what greedy search decodes."""
    _, model = patched("llama")
    model.set_attn_implementation("eager")
    assistant = copy.deepcopy(model)
    prompt = model_inputs("llama", batch=1, seq=6)["input_ids"]
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    greedy = model.generate(prompt, **settings)
    assisted = model.generate(prompt, assistant_model=assistant, **settings)
    assert torch.equal(assisted, greedy)


def test_sub_configs_switch_too():
    """A composite model (a BERT encoder and a GPT-2 decoder with cross-attention): the patch scores the decoder's
    self-attention; switching the whole model switches every config, the patched decoder's included."""
    torch.manual_seed(0)
    encoder = BertConfig(**BERT_COMMON)
    decoder = tiny_gpt2(add_cross_attention=True).config
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config._attn_implementation = "sdpa"
    model = EncoderDecoderModel(config=config).eval()
    hf_neural_attn.patch_model(model, "qana", h=2)
    perturb_scorers(model)
    inputs = {
        "input_ids": model_inputs("gpt2", seq=7)["input_ids"],
        "decoder_input_ids": model_inputs("gpt2", seq=5, seed=2)["input_ids"],
    }
    with torch.no_grad():
        over_sdpa = model(**inputs).logits
        model.set_attn_implementation("eager")
        over_eager = model(**inputs).logits
    assert model.config.decoder._attn_implementation == "hf_neural_attn"
    assert model.config.decoder.base_attn_implementation == "eager"
    assert model.config.encoder._attn_implementation == "eager"  # not patched: an ordinary switch
    torch.testing.assert_close(over_eager, over_sdpa, **SWITCH_TOLERANCE)


def test_plain_class_reload_of_a_switched_checkpoint_is_patched_on_the_switched_base(tmp_path):
    _, model = patched("llama")
    model.set_attn_implementation("eager")
    model.save_pretrained(tmp_path)
    plain = LlamaForCausalLM.from_pretrained(tmp_path)
    assert hf_neural_attn.is_patched(plain) and plain.config.base_attn_implementation == "eager"
    inputs = model_inputs("llama")
    torch.testing.assert_close(plain(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-6)
