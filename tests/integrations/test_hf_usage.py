"""Contract 5: patched models behave the way HF models are used."""

import pytest
import torch
from helpers.models import (
    family_case,
    logits,
    model_inputs,
    perturb_scorers,
    tiny_gpt2,
    tiny_llama,
    tiny_model,
    tiny_vit,
    training_loss,
)
from helpers.scorers import FUSED_SCORERS

import hf_neural_attn

DROPOUT_CONFIG = {
    "llama": {"attention_dropout": 0.5},
    "gpt2": {"attn_pdrop": 0.5},
    "vit": {"attention_probs_dropout_prob": 0.5},
}


def test_attention_dropout_applies_in_train_mode_only(family, scorer_name):
    model = tiny_model(family, **DROPOUT_CONFIG[family])
    inputs = model_inputs(family, seq=16)
    original = logits(model, inputs)
    hf_neural_attn.patch_model(model, scorer_name)
    # Eval mode: no dropout, and still the original function.
    torch.testing.assert_close(logits(model, inputs), original, rtol=0, atol=1e-5)
    model.train()
    torch.manual_seed(0)
    first = model(**inputs, output_attentions=True)
    second_logits = logits(model, inputs)
    assert (first.logits - second_logits).abs().max() > 1e-4
    # Inverted dropout on the probabilities: about half the allowed entries are zeroed, the kept ones
    # scaled by 1/(1-p) = 2.
    probs = first.attentions[0]
    allowed = torch.ones(probs.shape[-2:], dtype=torch.bool)
    if family_case(family).causal:
        allowed = allowed.tril()
    zero_fraction = (probs[..., allowed] == 0).float().mean().item()
    assert 0.4 < zero_fraction < 0.6, zero_fraction


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(family, scorer_name):
    reference, checkpointed = tiny_model(family), tiny_model(family)
    inputs = model_inputs(family)
    results = []
    for model in (reference, checkpointed):
        hf_neural_attn.patch_model(model, scorer_name)
        perturb_scorers(model)
        model.train()
        if model is checkpointed:
            model.activation_checkpointing_enable()
            assert model.is_activation_checkpointing
        loss = training_loss(model, inputs)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in hf_neural_attn.scorer_parameters(model).items()}
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7)


HALF = [torch.bfloat16, torch.float16]


def half_inputs(family, dtype):
    inputs = model_inputs(family)
    if "pixel_values" in inputs:
        inputs = {"pixel_values": inputs["pixel_values"].to(dtype)}
    return inputs


# In half precision, compare with the eager path: the patch computes the dot product as eager does (SDPA
# rounds differently), so agreement is to rounding of the ~1e-7 pair residue; observed exactly equal.
HALF_TOL = 1e-4


@pytest.mark.parametrize("dtype", HALF)
def test_autocast_forward_and_backward_match_the_eager_model(family, scorer_name, dtype):
    model = tiny_model(family, attn_implementation="eager")
    inputs = model_inputs(family)
    with torch.autocast("cpu", dtype=dtype):
        original = logits(model, inputs).float()
    hf_neural_attn.patch_model(model, scorer_name)
    model.train()
    with torch.autocast("cpu", dtype=dtype):
        out = model(**inputs)
        loss = training_loss(model, inputs)
    loss.backward()
    torch.testing.assert_close(out.logits.float(), original, rtol=0, atol=HALF_TOL)
    for name, parameter in hf_neural_attn.scorer_parameters(model).items():
        assert torch.isfinite(parameter.grad).all(), name


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_weights_match_the_eager_model(family, scorer_name, dtype):
    model = tiny_model(family, attn_implementation="eager").to(dtype)
    inputs = half_inputs(family, dtype)
    original = logits(model, inputs)
    hf_neural_attn.patch_model(model, scorer_name)
    assert all(p.dtype == dtype for p in hf_neural_attn.scorer_parameters(model).values())
    torch.testing.assert_close(logits(model, inputs), original, rtol=0, atol=HALF_TOL)
    perturb_scorers(model)
    assert torch.isfinite(logits(model, inputs)).all()


def test_output_attentions_are_probabilities_for_every_layer(family, scorer_name):
    model = tiny_model(family)
    inputs = model_inputs(family)
    hf_neural_attn.patch_model(model, scorer_name, layers=[0])
    perturb_scorers(model)
    attentions = model(**inputs, output_attentions=True).attentions
    # The unpatched layer's map comes back too (through the eager path for that call), on every family.
    assert len(attentions) == 2
    for probs in attentions:
        assert probs.shape[:2] == (2, 4) and probs.shape[-1] == probs.shape[-2]
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), rtol=0, atol=1e-5)
    if family_case(family).causal:
        assert torch.all(attentions[0].triu(diagonal=1) == 0)


def test_layers_selects_which_attention_modules_are_patched():
    model = tiny_llama(num_hidden_layers=3)
    inputs = model_inputs("llama")
    original = logits(model, inputs)
    hf_neural_attn.patch_model(model, "qana", layers=[-1, 0])
    patched = [hasattr(layer.self_attn, "attn_scorer") for layer in model.model.layers]
    assert patched == [True, False, True]
    assert model.config.hf_neural_attn["layers"] == [0, 2]
    torch.testing.assert_close(logits(model, inputs), original, rtol=0, atol=1e-5)
    perturb_scorers(model)
    assert (logits(model, inputs) - original).abs().max() > 1e-4


def test_gpt2_scale_attn_by_inverse_layer_idx_is_kept():
    inputs = model_inputs("gpt2")
    scaled, plain = tiny_gpt2(scale_attn_by_inverse_layer_idx=True), tiny_gpt2()
    # Same weights; only the per-layer scaling differs, and it changes the function.
    assert (logits(scaled, inputs) - logits(plain, inputs)).abs().max() > 1e-6
    for scorer_name in FUSED_SCORERS:
        model = tiny_gpt2(scale_attn_by_inverse_layer_idx=True)
        original = logits(model, inputs)
        hf_neural_attn.patch_model(model, scorer_name)
        torch.testing.assert_close(logits(model, inputs), original, rtol=0, atol=1e-5)


def test_eager_base_implementation_is_used_for_unpatched_layers_and_restored():
    model = tiny_vit(attn_implementation="eager")
    inputs = model_inputs("vit")
    original = logits(model, inputs)
    hf_neural_attn.patch_model(model, "neural", layers=[1])
    assert model.config.hf_neural_attn["base_attn_implementation"] == "eager"
    torch.testing.assert_close(logits(model, inputs), original, rtol=0, atol=1e-5)
    hf_neural_attn.unpatch_model(model)
    assert model.config._attn_implementation == "eager"
    assert torch.equal(logits(model, inputs), original)


def test_sequence_classification_heads_patch_too():
    from transformers import GPT2ForSequenceClassification, LlamaForSequenceClassification

    for model_class, config in (
        (GPT2ForSequenceClassification, tiny_gpt2().config),
        (LlamaForSequenceClassification, tiny_llama().config),
    ):
        config.num_labels = 3
        config.pad_token_id = 0
        torch.manual_seed(0)
        model = model_class(config).eval()
        ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
        mask = (ids != 0).long()
        original = model(ids, attention_mask=mask).logits
        hf_neural_attn.patch_model(model, "qana")
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, original, rtol=0, atol=1e-5)


def test_llama_with_explicit_head_dim_and_attention_bias(scorer_name):
    # head_dim 16 != hidden 32 / 4 heads; q/k/v/o projections with biases.
    model = tiny_llama(head_dim=16, attention_bias=True)
    inputs = model_inputs("llama")
    original = logits(model, inputs)
    hf_neural_attn.patch_model(model, scorer_name)
    torch.testing.assert_close(logits(model, inputs), original, rtol=0, atol=1e-5)
    perturb_scorers(model, std=1.0)
    assert (logits(model, inputs) - original).abs().max() > 1e-3


def test_gpt2_cross_attention_keeps_its_original_implementation():
    model = tiny_gpt2(add_cross_attention=True, attn_implementation="eager")
    ids = model_inputs("gpt2")["input_ids"]
    encoder = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    before = model(ids, encoder_hidden_states=encoder, output_attentions=True)
    hf_neural_attn.patch_model(model, "qana")
    assert not any(hasattr(block.crossattention, "attn_scorer") for block in model.transformer.h)
    after = model(ids, encoder_hidden_states=encoder, output_attentions=True)
    torch.testing.assert_close(after.logits, before.logits, rtol=0, atol=1e-5)
    assert len(after.cross_attentions) == len(before.cross_attentions) == 2
    for new, old in zip(after.cross_attentions, before.cross_attentions):
        torch.testing.assert_close(new, old, rtol=0, atol=1e-6)


def test_gpt2_reorder_and_upcast_attn_is_kept_on_unpatched_layers():
    """GPT-2's eager option computes q.k in fp32: an fp16 layer with large q, k stays finite with it."""
    model = tiny_gpt2(reorder_and_upcast_attn=True, attn_implementation="eager")
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight[:, :64] *= 1000  # layer 1's q and k columns
    model = model.to(torch.float16)
    inputs = model_inputs("gpt2")
    original = logits(model, inputs)
    assert torch.isfinite(original).all()
    hf_neural_attn.patch_model(model, "neural", layers=[0])
    patched = logits(model, inputs)
    assert torch.isfinite(patched).all()
    # Layer 0 is patched, and so runs in fp16 where the original ran GPT-2's fp32 upcast: fp16 rounding.
    torch.testing.assert_close(patched, original, rtol=0, atol=1e-3)
