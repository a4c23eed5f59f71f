"""Contract 8: the scorers compute the papers' formulas.

Each reference below is written straight from the paper, in float64 and with explicit loops: QANA by
widening W_Q and slicing every query as [s; U; V; b; c] (Vermillion, Sec. 3.2), row-wise RoPE applied to
one row at a time; Neural Attention by building the concatenation C_ij = [q'_i ; k'_j] and passing it
through W_h (DiGiugno & Mahmood, Eq. 7-9). The library never builds either.
"""

import pytest
import torch
from helpers.references import (
    ACTIVATIONS,
    F64,
    HEADS,
    HIDDEN,
    KV_HEADS,
    D,
    causal_gradcheck,
    geometry,
    qana_case,
    randomise,
    rope_rows,
    rope_vector,
)
from helpers.scorers import FUSED_SCORERS

from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import (
    NeuralAttentionConfig,
    NeuralAttentionScorer,
    QanaConfig,
    QanaScorer,
)


@pytest.mark.parametrize("h", [1, 3])
@pytest.mark.parametrize("activation", ["gelu", "tanh"])
@pytest.mark.parametrize("use_rope", [False, True])
def test_qana_matches_the_literal_widened_query(h, activation, use_rope):
    torch.manual_seed(0)
    scorer = QanaScorer(QanaConfig(h=h, activation=activation), geometry())
    randomise(scorer)
    hidden, w_s, b_s, keys, q_positions, k_positions = qana_case()
    (batch, q_len), k_len = hidden.shape[:2], keys.shape[2]
    scaling = D**-0.5
    sigma = ACTIVATIONS[activation]

    # Literal: the widened W_Q, per head the original D_K rows then the extension's rows.
    rows = scorer.rows_per_head
    assert rows == h * D + 2 * h + 1  # D_Q - D_K
    w_ext = scorer.query_extension.weight.view(HEADS, rows, HIDDEN)
    b_ext = scorer.query_extension.bias.view(HEADS, rows)
    expected = torch.empty(batch, HEADS, q_len, k_len, dtype=F64)
    for n in range(HEADS):
        w_wide = torch.cat([w_s.view(HEADS, D, HIDDEN)[n], w_ext[n]])  # (D_Q, hidden)
        b_wide = torch.cat([b_s.view(HEADS, D)[n], b_ext[n]])
        for bi in range(batch):
            for i in range(q_len):
                q = w_wide @ hidden[bi, i] + b_wide  # (D_Q,)
                s = q[:D]
                U = q[D : D + h * D].reshape(h, D)
                V = q[D + h * D : D + h * D + h].reshape(1, h)
                b = q[-h - 1 : -1]
                c = q[-1:]
                if use_rope:
                    s = rope_vector(s, q_positions[i].item())
                    U = torch.stack([rope_vector(U[row], q_positions[i].item()) for row in range(h)])
                for j in range(k_len):
                    k = keys[bi, n, j]
                    if use_rope:
                        k = rope_vector(k, k_positions[j].item())
                    mlp = (V @ sigma(U @ k + b) + c).squeeze()
                    expected[bi, n, i, j] = s @ k * scaling + scorer.gate[n] * mlp

    # Library: s and k rotated by "the model", U by the scorer's row-wise RoPE.
    query = (hidden @ w_s.T + b_s).view(batch, q_len, HEADS, D).transpose(1, 2)
    rotate = (lambda x: rope_rows(x, q_positions)) if use_rope else None
    if use_rope:
        query, keys = rope_rows(query, q_positions), rope_rows(keys, k_positions)
    extras = scorer.query_extras(hidden, rotate)
    actual = scorer.scores(query, keys, extras, scaling)
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


def neural_pair_scores_literal(scorer, query, key, sigma):
    """A_ij = w_a . sigma(W_h C_ij + b_h) with C_ij = [q'_i ; k'_j] built explicitly (Eq. 7-9); the
    down-projections' biases added where ``proj_bias`` gives them one (the authors' code)."""
    if scorer.config.proj_dim is not None:
        query, key = query @ scorer.query_down.weight.T, key @ scorer.key_down.weight.T
        if scorer.config.proj_bias:
            query, key = query + scorer.query_down.bias, key + scorer.key_down.bias
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    C = torch.cat(
        [query.unsqueeze(3).expand(-1, -1, -1, k_len, -1), key.unsqueeze(2).expand(-1, -1, q_len, -1, -1)], dim=-1
    )  # (batch, heads, q, k, 2d')
    W_h = torch.cat([scorer.pair_query.weight, scorer.pair_key.weight], dim=1)  # (h, 2d')
    A = torch.empty(batch, heads, q_len, k_len, dtype=F64)
    for index in torch.cartesian_prod(*(torch.arange(size) for size in (batch, heads, q_len, k_len))):
        bi, n, i, j = index.tolist()
        z = sigma(W_h @ C[bi, n, i, j] + scorer.pair_key.bias)
        for layer in scorer.deeper:
            z = sigma(layer.weight @ z + layer.bias)
        A[bi, n, i, j] = scorer.output.weight[0] @ z
    return A


@pytest.mark.parametrize(
    "options",
    [
        {"h": 4},
        {"h": 3, "proj_dim": 2},
        {"h": 4, "proj_dim": 2, "depth": 2, "activation": "relu"},
        {"h": 2, "mode": "replace"},
        {"h": 4, "proj_dim": 3, "mode": "replace", "depth": 3, "activation": "tanh"},
        {"h": 3, "proj_dim": 2, "proj_bias": True, "mode": "replace", "scale_mlp": False},
        {"h": 2, "proj_dim": 2, "proj_bias": True},
    ],
)
def test_neural_attention_matches_the_literal_concatenation(options):
    torch.manual_seed(0)
    scorer = NeuralAttentionScorer(NeuralAttentionConfig(**options), geometry())
    randomise(scorer, std=0.6)
    sigma = ACTIVATIONS[scorer.config.activation]
    query = torch.randn(2, HEADS, 3, D, dtype=F64)
    key = torch.randn(2, HEADS, 4, D, dtype=F64)
    scaling = D**-0.5
    A = neural_pair_scores_literal(scorer, query, key, sigma)
    if scorer.config.mode == "replace":
        expected = A * scaling if scorer.config.scale_mlp else A  # Eq. 10: softmax(A / sqrt(d)); the code: A
    else:
        dot = torch.einsum("bnqd,bnkd->bnqk", query, key) * scaling
        expected = dot + scorer.gate.view(1, -1, 1, 1) * A
    torch.testing.assert_close(scorer.scores(query, key, None, scaling), expected, rtol=1e-10, atol=1e-10)


def literal_attention(scores, value, mask):
    return torch.softmax(scores + mask, dim=-1) @ value


@pytest.mark.parametrize("scorer_name", FUSED_SCORERS)
def test_scored_attention_is_softmax_of_scores_with_mask_and_grouped_heads(scorer_name):
    torch.manual_seed(0)
    if scorer_name == "qana":
        scorer = QanaScorer(QanaConfig(h=2), geometry())
    else:
        scorer = NeuralAttentionScorer(NeuralAttentionConfig(h=3, proj_dim=2), geometry())
    randomise(scorer)
    batch, q_len, k_len = 2, 4, 4
    hidden = torch.randn(batch, q_len, HIDDEN, dtype=F64)
    extras = scorer.query_extras(hidden, None)
    query = torch.randn(batch, HEADS, q_len, D, dtype=F64)
    key = torch.randn(batch, KV_HEADS, k_len, D, dtype=F64)
    value = torch.randn(batch, KV_HEADS, k_len, D, dtype=F64)
    mask = torch.zeros(batch, 1, q_len, k_len, dtype=F64)
    mask[..., ~torch.ones(q_len, k_len, dtype=torch.bool).tril()] = torch.finfo(F64).min
    mask[1, ..., 0] = torch.finfo(F64).min  # a padded first key in the second sequence
    out, probs = scored_attention(scorer, query, key, value, mask, scaling=D**-0.5, extras=extras)
    # Grouped-query attention: both query heads read the single kv head.
    key_full, value_full = key.expand(-1, HEADS, -1, -1), value.expand(-1, HEADS, -1, -1)
    expected = literal_attention(scorer.scores(query, key_full, extras, D**-0.5), value_full, mask)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-12, atol=1e-12)
    assert torch.all(probs[1, :, 1:, 0] == 0)  # the padded key gets no weight...
    # ...and the query that can see nothing at all (causal and padded) averages uniformly, like eager.
    torch.testing.assert_close(probs[1, :, 0], torch.full((HEADS, k_len), 1 / k_len, dtype=F64))


@pytest.mark.parametrize("scorer_name", FUSED_SCORERS)
def test_gradcheck_through_inputs_and_parameters(scorer_name):
    torch.manual_seed(0)
    if scorer_name == "qana":
        scorer = QanaScorer(QanaConfig(h=2), geometry(num_kv_heads=HEADS))
    else:
        scorer = NeuralAttentionScorer(NeuralAttentionConfig(h=3, proj_dim=2, depth=2), geometry(num_kv_heads=HEADS))
    randomise(scorer, std=0.5)
    assert causal_gradcheck(scorer, seq=3)


@pytest.mark.parametrize("skip", [True, False])
def test_qana_dot_product_view_scores_the_plain_dot_product_with_the_same_parameters(skip):
    """What plotting calls "unpatched" for a patch that cannot be undone: the same queries and keys, scored by the
    dot product alone, on the scorer's own parameter tensors; the scorer itself keeps its term."""
    torch.manual_seed(0)
    scorer = QanaScorer(QanaConfig(h=2, skip=skip), geometry(num_kv_heads=HEADS))
    randomise(scorer)
    gate = scorer.gate.detach().clone()
    hidden = torch.randn(2, 3, HIDDEN, dtype=F64)
    query, key = torch.randn(2, HEADS, 3, D, dtype=F64), torch.randn(2, HEADS, 5, D, dtype=F64)
    before = scorer.scores(query, key, scorer.query_extras(hidden, None), D**-0.5)

    view = scorer.dot_product_view()
    scores = view.scores(query, key, view.query_extras(hidden, None), D**-0.5)
    torch.testing.assert_close(scores, query @ key.transpose(-1, -2) * D**-0.5, rtol=1e-12, atol=1e-12)
    shared = dict(view.named_parameters())
    assert all(shared[name] is parameter for name, parameter in scorer.named_parameters() if name != "gate")
    # the scorer is unchanged
    assert scorer.config.skip is skip and torch.equal(scorer.gate, gate)
    torch.testing.assert_close(scorer.scores(query, key, scorer.query_extras(hidden, None), D**-0.5), before)


def test_a_scorer_without_a_dot_product_view_says_so():
    scorer = NeuralAttentionScorer(NeuralAttentionConfig(h=3, mode="replace"), geometry())
    with pytest.raises(ValueError, match="'neural' has no dot-product-only view.*unpatch_model"):
        scorer.dot_product_view()
