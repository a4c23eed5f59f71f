"""Bahdanau's additive score and Luong's general score: the formulas written out in float64, gradcheck, their options.
Preservation, liveness, first backward, chunked path and checkpoints: tests/scorers/test_scorer_contracts.py."""

import pytest
import torch
from helpers.models import tiny_gpt2
from helpers.references import F64, HEADS, D, causal_gradcheck, geometry, randomise

import hf_neural_attn
from hf_neural_attn.scorers import AdditiveConfig, AdditiveScorer, GeneralConfig, GeneralScorer

NEW_SCORERS = ["additive", "general"]


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


def test_additive_options_are_checked():
    with pytest.raises(ValueError, match="mode='bogus' is not supported"):
        hf_neural_attn.patch_model(tiny_gpt2(), "additive", mode="bogus")
    with pytest.raises(ValueError, match=r"Unknown option\(s\) \['h'\] for scorer 'general'"):
        hf_neural_attn.patch_model(tiny_gpt2(), "general", h=4)
