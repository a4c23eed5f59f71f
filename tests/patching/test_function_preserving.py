"""Contract 1: unpatch gives back the original model exactly, every layer is patched, the patch record and APIs.
Preserved at init and live on every family, for every scorer case: tests/scorers/test_scorer_contracts.py."""

import torch
from helpers.models import logits, model_inputs, perturb_scorers, tiny_gpt2, tiny_llama, tiny_model
from helpers.references import EXACT

import hf_neural_attn


def test_llama_uses_grouped_query_attention_and_every_layer_is_patched():
    model = tiny_llama()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    hf_neural_attn.patch_model(model, "qana", h=4)
    patched = [layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "attn_scorer")]
    assert len(patched) == model.config.num_hidden_layers
    # QANA widens W_Q per head by h*D_K + 2h + 1 rows (the paper's D_Q - D_K).
    head_dim, h, heads = 8, 4, 4
    extension = patched[0].attn_scorer.query_extension.weight
    assert extension.shape == (heads * (h * head_dim + 2 * h + 1), model.config.hidden_size)


def test_unpatch_restores_names_shapes_and_outputs_bit_for_bit(family, scorer_name):
    model = tiny_model(family)
    inputs = model_inputs(family)
    original = logits(model, inputs)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    implementation = model.config._attn_implementation

    hf_neural_attn.patch_model(model, scorer_name)
    perturb_scorers(model)
    hf_neural_attn.unpatch_model(model)

    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == shapes
    assert model.config._attn_implementation == implementation
    assert not hasattr(model.config, "hf_neural_attn")
    assert not hf_neural_attn.is_patched(model)
    assert torch.equal(logits(model, inputs), original)
    # And it can be patched again.
    hf_neural_attn.patch_model(model, scorer_name)
    torch.testing.assert_close(logits(model, inputs), original, rtol=0, atol=EXACT)


def test_patch_returns_the_same_model_and_records_the_patch():
    model = tiny_gpt2()
    assert hf_neural_attn.patch_model(model, "neural", h=3, proj_dim=2, layers=[0]) is model
    record = model.config.hf_neural_attn
    assert record["scorer"] == "neural"
    assert record["layers"] == [0]
    assert record["options"]["h"] == 3 and record["options"]["proj_dim"] == 2
    assert record["version"] == hf_neural_attn.__version__


def test_config_object_api_matches_keyword_api():
    by_name = tiny_llama()
    by_config = tiny_llama()
    hf_neural_attn.patch_model(by_name, "neural", h=2, proj_dim=4, depth=2)
    hf_neural_attn.patch_model(by_config, hf_neural_attn.NeuralAttentionConfig(h=2, proj_dim=4, depth=2))
    assert by_name.config.hf_neural_attn == by_config.config.hf_neural_attn
    names = set(hf_neural_attn.scorer_parameters(by_name))
    assert names == set(hf_neural_attn.scorer_parameters(by_config))


def test_deep_copies_are_independent_patched_models():
    import copy

    model = tiny_llama()
    inputs = model_inputs("llama")
    original = logits(model, inputs)
    hf_neural_attn.patch_model(model, "qana")
    perturb_scorers(model)
    patched = logits(model, inputs)
    duplicate = copy.deepcopy(model)
    torch.testing.assert_close(logits(duplicate, inputs), patched, rtol=0, atol=0)
    hf_neural_attn.unpatch_model(duplicate)
    assert torch.equal(logits(duplicate, inputs), original)
    torch.testing.assert_close(logits(model, inputs), patched, rtol=0, atol=0)
