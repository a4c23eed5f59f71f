"""Bahdanau's additive score and Luong's general score: function preservation on every family, the
formulas written out in float64, gradients, checkpoints."""

import pytest
import torch
from helpers import (
    F64,
    FACTORIES,
    HEADS,
    D,
    causal_gradcheck,
    geometry,
    logits,
    model_inputs,
    perturb_scorers,
    randomise,
)

import hf_neural_attn
from hf_neural_attn.scorers import AdditiveConfig, AdditiveScorer, GeneralConfig, GeneralScorer

NEW_SCORERS = ["additive", "general"]


@pytest.mark.parametrize("name", NEW_SCORERS)
def test_patch_preserves_outputs_at_init_and_is_live(family, name):
    model = FACTORIES[family]()
    inputs = model_inputs(family)
    with torch.no_grad():
        expected = logits(model, inputs)
        hf_neural_attn.patch_model(model, name)
        torch.testing.assert_close(logits(model, inputs), expected, rtol=0, atol=1e-5)
        perturb_scorers(model, std=1.0)
        # The init agrees to rounding (~1e-7); a live scorer moves the logits by orders of magnitude more.
        assert (logits(model, inputs) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("name", NEW_SCORERS)
def test_first_backward_reaches_the_new_parameters(family, name):
    """No init trap: general's W and additive's W_q, W_k and v all get a gradient on the first step."""
    model = FACTORIES[family]()
    hf_neural_attn.patch_model(model, name, **({"h": 4} if name == "additive" else {}))
    loss = logits(model, model_inputs(family)).square().mean()
    loss.backward()
    for parameter_name, parameter in hf_neural_attn.scorer_parameters(model).items():
        if parameter_name.endswith("gate"):
            continue  # the gate multiplies a term that is zero at init; it moves from the second step
        assert parameter.grad is not None and parameter.grad.abs().max() > 0, parameter_name


def test_additive_matches_bahdanau_written_out():
    torch.manual_seed(0)
    for mode in ("residual", "replace"):
        scorer = AdditiveScorer(AdditiveConfig(h=3, mode=mode), geometry(num_kv_heads=HEADS))
        randomise(scorer)
        query, key = torch.randn(2, HEADS, 3, D, dtype=F64), torch.randn(2, HEADS, 5, D, dtype=F64)
        got = scorer.scores(query, key, None, D**-0.5)
        expected = torch.empty_like(got)
        for b in range(2):
            for n in range(HEADS):
                for i in range(3):
                    for j in range(5):
                        hidden = scorer.query_map[n] @ query[b, n, i] + scorer.key_map[n] @ key[b, n, j]
                        score = scorer.output[n] @ torch.tanh(hidden)
                        if mode == "residual":
                            score = query[b, n, i] @ key[b, n, j] * D**-0.5 + scorer.gate[n] * score
                        expected[b, n, i, j] = score
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_general_matches_luong_written_out_and_starts_at_the_dot_product():
    torch.manual_seed(0)
    scorer = GeneralScorer(GeneralConfig(), geometry(num_kv_heads=HEADS))
    query, key = torch.randn(2, HEADS, 3, D, dtype=F64), torch.randn(2, HEADS, 5, D, dtype=F64)
    torch.testing.assert_close(scorer.scores(query, key, None, 0.5), query @ key.transpose(-1, -2) * 0.5)
    randomise(scorer)
    got = scorer.scores(query, key, None, 0.5)
    for b, n, i, j in [(0, 0, 0, 0), (1, 1, 2, 4), (0, 1, 1, 3)]:
        expected = query[b, n, i] @ scorer.bilinear[n] @ key[b, n, j] * 0.5
        torch.testing.assert_close(got[b, n, i, j], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", NEW_SCORERS)
def test_gradcheck(name):
    torch.manual_seed(0)
    if name == "additive":
        scorer = AdditiveScorer(AdditiveConfig(h=2), geometry(num_kv_heads=HEADS))
    else:
        scorer = GeneralScorer(GeneralConfig(), geometry(num_kv_heads=HEADS))
    randomise(scorer, std=0.5)
    assert causal_gradcheck(scorer, seq=3)


@pytest.mark.parametrize("name", NEW_SCORERS)
def test_chunked_path_matches_reference(name):
    results = {}
    for impl in ("reference", "chunked"):
        model = FACTORIES["llama"]()
        hf_neural_attn.patch_model(model, name, impl=impl)
        perturb_scorers(model, std=0.2)
        loss = logits(model, model_inputs("llama")).square().mean()
        loss.backward()
        results[impl] = (loss.detach(), {n: p.grad for n, p in hf_neural_attn.scorer_parameters(model).items()})
    torch.testing.assert_close(results["chunked"][0], results["reference"][0], rtol=1e-5, atol=1e-6)
    for parameter_name, grad in results["reference"][1].items():
        torch.testing.assert_close(results["chunked"][1][parameter_name], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NEW_SCORERS)
def test_checkpoint_round_trip(tmp_path, name):
    model = FACTORIES["gpt2"]()
    hf_neural_attn.patch_model(model, name)
    perturb_scorers(model)
    inputs = model_inputs("gpt2")
    model.save_pretrained(tmp_path)
    reloaded = hf_neural_attn.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(logits(reloaded, inputs), logits(model, inputs), rtol=0, atol=1e-6)


def test_additive_options_are_checked():
    with pytest.raises(ValueError, match="mode='bogus' is not supported"):
        hf_neural_attn.patch_model(FACTORIES["gpt2"](), "additive", mode="bogus")
    with pytest.raises(ValueError, match=r"Unknown option\(s\) \['h'\] for scorer 'general'"):
        hf_neural_attn.patch_model(FACTORIES["gpt2"](), "general", h=4)
