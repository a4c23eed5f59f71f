"""Query rows that see no key: the leading pads of a left-padded causal batch.

transformers' usual language-modelling labels (``input_ids`` with the pads set to -100) let the last pad row predict
the first real token, so what a pad row's attention returns is in the loss. Unpatched, it is what the base
implementation's mask form gives: SDPA (a boolean mask) returns zero for a row with no key (its safe softmax), eager (an
additive mask of the dtype's minimum) returns uniform weights over every key. A patched model at init must give the
same loss and gradients, and every compute path the same as the reference path, on every row.

The paths run with 4-row query blocks, so a 12-token batch with 7 pads spans blocks that the causal skip would cut
short. Tolerances: paths against each other in float64, 1e-10 times the largest gradient; patched against unpatched
in float64 under SDPA (1e-10), and in float32 under eager (1e-5), since transformers' own eager mask overflows to
-inf on float64 pad rows of the Llama-style families and gives NaN there.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import LEFT_PADDED, family_cases
from helpers.references import HIDDEN, geometry, randomise

import hf_neural_attn
from hf_neural_attn.ops import blockwise, chunked
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import NeuralAttentionConfig, NeuralAttentionScorer, QanaConfig, QanaScorer

SEQ, PADS = 12, 7
# "neural-deep" has no fused form: impl="chunked" runs the generic chunked path for it, the blockwise one for the others.
SCORERS = {"qana": {}, "neural": {}, "neural-deep": {"depth": 2}}
CAUSAL_SAMPLE = family_cases(lambda case: case.inputs == LEFT_PADDED, sample=True)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 4)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 4)


def left_padded_batch():
    """(2, SEQ) token ids whose second row starts with PADS pads, its attention mask, and HF's LM labels."""
    ids = torch.randint(3, 64, (2, SEQ), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :PADS], ids[1, :PADS] = 0, 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def loss_and_grads(model):
    ids, mask, labels = left_padded_batch()
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(grads, expected, rtol):
    scale = max(grad.abs().max().item() for grad in expected.values())
    assert set(expected) <= set(grads)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=rtol * scale, msg=name)


def patched(model, scorer: str, impl: str):
    copy_ = copy.deepcopy(model)
    torch.manual_seed(5)  # the same scorer init for every path
    hf_neural_attn.patch_model(copy_, scorer.removesuffix("-deep"), impl=impl, **SCORERS[scorer])
    return copy_


@pytest.mark.parametrize("scorer", list(SCORERS))
@pytest.mark.parametrize("base", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CAUSAL_SAMPLE)
def test_left_padded_batch_is_function_preserving_and_the_paths_agree(small_blocks, case, base, scorer):
    model64 = case.build(attn_implementation=base).double()
    reference_loss, reference_grads = loss_and_grads(patched(model64, scorer, "reference"))
    chunked_loss, chunked_grads = loss_and_grads(patched(model64, scorer, "chunked"))
    torch.testing.assert_close(chunked_loss, reference_loss, rtol=0, atol=1e-12)
    assert_close_grads(chunked_grads, reference_grads, rtol=1e-10)

    model = model64 if base == "sdpa" else model64.float()
    unpatched_loss, unpatched_grads = loss_and_grads(model)
    for impl in ("reference", "chunked"):
        loss, grads = loss_and_grads(patched(model, scorer, impl))
        tolerance = 1e-10 if base == "sdpa" else 1e-5
        torch.testing.assert_close(loss, unpatched_loss, rtol=0, atol=tolerance, msg=impl)
        assert_close_grads(grads, unpatched_grads, rtol=tolerance)


D, HEADS = 4, 2


def scorer_and_inputs(name: str):
    config = QanaConfig(h=3) if name == "qana" else NeuralAttentionConfig(h=4, **SCORERS[name])
    scorer_class = QanaScorer if name == "qana" else NeuralAttentionScorer
    scorer = scorer_class(config, geometry(num_heads=HEADS, num_kv_heads=HEADS, head_dim=D, dtype=torch.float64))
    randomise(scorer, std=0.5)
    scorer = scorer.double()
    generator = torch.Generator().manual_seed(0)
    leaves = [
        torch.randn(2, SEQ, HIDDEN, generator=generator, dtype=torch.float64).requires_grad_(),
        *(torch.randn(2, HEADS, SEQ, D, generator=generator, dtype=torch.float64).requires_grad_() for _ in range(3)),
    ]
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().expand(2, 1, SEQ, SEQ).clone()
    allowed[1, ..., :PADS] = False  # the pad keys: the first PADS rows of sequence 1 see no key
    return scorer, leaves, allowed


def attend(scorer, impl, leaves, mask):
    scorer.config.impl = impl
    hidden, query, key, value = leaves
    for leaf in [*leaves, *scorer.parameters()]:
        leaf.grad = None
    extras = scorer.query_extras(hidden, None) if scorer.needs_hidden_states else None
    output, _ = scored_attention(scorer, query, key, value, mask, scaling=D**-0.5, extras=extras, is_causal=True)
    return output


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("name", list(SCORERS))
def test_rows_without_keys_follow_the_mask_form(small_blocks, name, impl):
    scorer, leaves, allowed = scorer_and_inputs(name)
    value = leaves[3]
    # Boolean (SDPA's): zero, and nothing flows back from those rows.
    output = attend(scorer, impl, leaves, allowed)  # (batch, q, heads, d)
    assert torch.equal(output[1, :PADS], torch.zeros_like(output[1, :PADS]))
    output[1, :PADS].sum().backward()
    for leaf in [*leaves, *scorer.parameters()]:
        assert leaf.grad is None or not leaf.grad.any()
    # Additive (eager's): uniform weights over every key of the sequence, the causally later ones included.
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    output = attend(scorer, impl, leaves, additive)
    uniform = value[1].mean(dim=-2)  # (heads, d)
    torch.testing.assert_close(output[1, :PADS], uniform.expand(PADS, HEADS, D), rtol=0, atol=1e-12)
