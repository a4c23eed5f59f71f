"""A padded encoder batch of unequal lengths: the blockwise paths score each sequence against the keys its mask
leaves it (sequences.key_spans), and give what the reference gives on the whole padded batch, outputs and every
gradient, with dropout and without (fp32, 1e-5 times a gradient's magnitude above 1)."""

from __future__ import annotations

import pytest
import torch
from helpers.references import HIDDEN, geometry, randomise

from hf_neural_attn.ops import blockwise, chunked, dispatch, sequences
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import NeuralAttentionConfig, NeuralAttentionScorer, QanaConfig, QanaScorer

D, HEADS, Q = 4, 2, 10
LENGTHS = [10, 6, 3]  # three sequences, right-padded to 10
SCORERS = {
    "qana": lambda: QanaScorer(
        QanaConfig(h=3), geometry(num_heads=HEADS, num_kv_heads=HEADS, head_dim=D, dtype=torch.float32)
    ),
    "neural": lambda: NeuralAttentionScorer(
        NeuralAttentionConfig(h=4), geometry(num_heads=HEADS, num_kv_heads=HEADS, head_dim=D, dtype=torch.float32)
    ),
    "neural-deep": lambda: NeuralAttentionScorer(
        NeuralAttentionConfig(h=4, depth=2),
        geometry(num_heads=HEADS, num_kv_heads=HEADS, head_dim=D, dtype=torch.float32),
    ),
}


def padded_batch(form: str):
    generator = torch.Generator().manual_seed(0)
    leaves = [
        torch.randn(len(LENGTHS), Q, HIDDEN, generator=generator).requires_grad_(),
        *(torch.randn(len(LENGTHS), HEADS, Q, D, generator=generator).requires_grad_() for _ in range(3)),
    ]
    allowed = torch.zeros(len(LENGTHS), 1, Q, Q, dtype=torch.bool)
    for index, length in enumerate(LENGTHS):
        allowed[index, ..., :length] = True
    mask = (
        allowed if form == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    )
    return leaves, mask


def run(scorer, impl, leaves, mask, dropout):
    scorer.config.impl = impl
    hidden, query, key, value = leaves
    for tensor in [*leaves, *scorer.parameters()]:
        tensor.grad = None
    extras = scorer.query_extras(hidden, None) if scorer.needs_hidden_states else None
    torch.manual_seed(3)
    output, _ = scored_attention(
        scorer, query, key, value, mask, scaling=D**-0.5, dropout=dropout, training=True, extras=extras
    )
    (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()
    return output.detach(), [t.grad for t in [*leaves, *scorer.parameters()]]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("form", ["bool", "float"])
@pytest.mark.parametrize("name", list(SCORERS))
def test_a_padded_batch_scores_each_sequence_on_its_own_keys(monkeypatch, name, form, dropout):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 3)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 3)
    scorer = SCORERS[name]()
    randomise(scorer, std=0.5)
    leaves, mask = padded_batch(form)
    expected = run(scorer, "reference", leaves, mask, dropout)
    seen = []
    path = "chunked" if name == "neural-deep" else "blockwise"
    original = dispatch.PATHS[path]

    def spy(*args, **kwargs):
        seen.append((args[1].shape[0], args[2].shape[-2]))  # the sequences and keys each call scores
        return original(*args, **kwargs)

    monkeypatch.setitem(dispatch.PATHS, path, spy)
    output, grads = run(scorer, "chunked", leaves, mask, dropout)
    assert seen == [(1, length) for length in LENGTHS]
    torch.testing.assert_close(output, expected[0], rtol=0, atol=1e-5)
    for index, (grad, ref_grad) in enumerate(zip(grads, expected[1], strict=True)):
        assert (grad is None) == (ref_grad is None), index  # parameters the scorer's form does not use
        if grad is not None:
            scale = max(1.0, ref_grad.abs().max().item())
            torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-5 * scale, msg=lambda m, i=index: f"{i}: {m}")


def test_key_spans_only_where_padding_saves_enough():
    allowed = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    assert sequences.key_spans(allowed, 2, 8) is None  # nothing to skip
    allowed[1, ..., 6:] = False  # 2 of 16 columns: 12.5 %
    assert sequences.key_spans(allowed, 2, 8) == [(0, 8), (0, 6)]
    allowed[1, ..., 7:] = True
    allowed[1, ..., 6] = False  # a hole in the middle is not a span's edge: 1 of 16 left out, too little
    assert sequences.key_spans(allowed, 2, 8) is None
    allowed = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    allowed[0, ..., :4] = False  # left padding: the span starts later
    assert sequences.key_spans(allowed, 2, 8) == [(4, 8), (0, 8)]
    allowed[1] = False  # a sequence with no key at all keeps every column
    assert sequences.key_spans(allowed, 2, 8) == [(4, 8), (0, 8)]
    assert sequences.key_spans(None, 2, 8) is None and sequences.key_spans(allowed[:1], 1, 8) is None


def test_a_sequence_slice_cuts_a_row_or_a_span_and_keeps_broadcast_axes():
    """The one cut both splits use: a padded batch's row (its keys' span) and a packed call's span of queries and
    keys, applied to the query, the keys, a mask whose batch or query axis broadcasts, and per-query inputs."""
    from typing import NamedTuple

    class Extras(NamedTuple):
        per_query: torch.Tensor  # (batch, heads, q_len, 1)
        shared: torch.Tensor  # (1, heads, 1, 1): broadcast over the batch

        def query_block(self, start, end):
            return Extras(self.per_query[:, :, start:end], self.shared)

    query, key = torch.randn(3, HEADS, 5, D), torch.randn(3, HEADS, 7, D)
    mask = torch.randn(3, 1, 5, 7)
    extras = Extras(torch.randn(3, HEADS, 5, 1), torch.randn(1, HEADS, 1, 1))

    row = sequences.SequenceSlice(sequences.EVERY, slice(2, 6), row=1)
    assert torch.equal(row.query_of(query), query[1:2]) and torch.equal(row.keys_of(key), key[1:2, :, 2:6])
    assert torch.equal(row.mask_of(mask), mask[1:2, ..., 2:6])
    assert torch.equal(row.mask_of(mask[:1, :, :1]), mask[:1, :, :1, 2:6])  # broadcast axes stay broadcast
    row_extras = row.extras_of(extras, batch=3)
    assert torch.equal(row_extras.per_query, extras.per_query[1:2]) and row_extras.shared is extras.shared
    assert row.mask_of(None) is None and row.extras_of(None, batch=3) is None

    span = sequences.SequenceSlice(slice(1, 3), slice(0, 4))  # a packed call: batch 1, a span of each axis
    assert (span.q_len, span.kv_len) == (2, 4)
    assert torch.equal(span.query_of(query[:1]), query[:1, :, 1:3]) and torch.equal(
        span.keys_of(key[:1]), key[:1, :, :4]
    )
    assert torch.equal(span.mask_of(mask[:1]), mask[:1, :, 1:3, :4])
    assert torch.equal(span.mask_of(mask[:1, :, :1]), mask[:1, :, :1, :4])
    assert torch.equal(span.extras_of(extras, batch=1).per_query, extras.per_query[:, :, 1:3])
