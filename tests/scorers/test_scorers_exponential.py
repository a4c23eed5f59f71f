"""NSEA and HEA (Ortiz Valencia): the paper's product and exponential written out literally, the
algebraic properties it states (and where they fail), the closed form, masks, causality, training."""

import math

import pytest
import torch
from helpers.models import VOCAB, family_names, tiny_bert, tiny_llama, tiny_model
from helpers.references import F64, geometry

import hf_neural_attn
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import HeaConfig, HeaScorer, NseaConfig, NseaScorer
from hf_neural_attn.scorers.exponential import nonsquare_exp, nonsquare_product

BLOCKED = torch.finfo(F64).min


def circledast(a, b):
    """Definition 1 literally: the sum over k of the block matrix whose i-th row is A_k ⊙ B_i."""
    m, n = a.shape
    total = torch.zeros(m, n, dtype=a.dtype)
    for k in range(m):  # the paper writes k = 1..n; A has m rows, and its proof sums over rows
        total += torch.stack([a[k] * b[i] for i in range(m)])
    return total


def series(a, terms, product, identity):
    """I + sum_{k=1..K} A^k / k! with A^k = A^{k-1} (product) A (Definitions 2-3), term by term."""
    power, total = identity, identity.clone()
    for k in range(1, terms + 1):
        power = product(power, a)
        total = total + power / float(math.factorial(k))
    return total


def random(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


# --- The paper's algebra --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 6), (6, 4), (5, 5)])
def test_circledast_closed_form_associativity_and_null_element(shape):
    a, b, c = (random(*shape, seed=s) for s in range(3))
    torch.testing.assert_close(nonsquare_product(a, b), circledast(a, b), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(circledast(circledast(a, b), c), circledast(a, circledast(b, c)))
    zero = torch.zeros(shape, dtype=F64)
    assert torch.equal(circledast(zero, a), zero) and torch.equal(circledast(a, zero), zero)
    # Not commutative, which the paper does not claim either.
    assert not torch.allclose(circledast(a, b), circledast(b, a))


def test_circledast_identity_is_a_left_identity_only_when_rows_cover_columns():
    """I ⊛ A multiplies A's columns by I's column sums: all ones iff m >= n. It is never a right identity."""
    for m, n in [(6, 4), (5, 5)]:
        a = random(m, n)
        torch.testing.assert_close(circledast(torch.eye(m, n, dtype=F64), a), a)
        assert not torch.allclose(circledast(a, torch.eye(m, n, dtype=F64)), a)
    a = random(4, 6)  # more columns than rows: the last two columns are wiped out
    left = circledast(torch.eye(4, 6, dtype=F64), a)
    torch.testing.assert_close(left[:, :4], a[:, :4])
    assert torch.equal(left[:, 4:], torch.zeros(4, 2, dtype=F64))


def test_the_papers_I_is_no_identity_for_the_hadamard_product():
    """Why HEA's series starts at the all-ones matrix: with A^0 = I, every power I ⊙ A^k keeps only the
    diagonal, so the series would attend to nothing but the diagonal."""
    a, eye = random(4, 6), torch.eye(4, 6, dtype=F64)
    assert torch.equal(eye * a, torch.where(eye.bool(), a, 0.0)) and not torch.allclose(eye * a, a)
    hea = scorer(HeaScorer, HeaConfig, heads=1, kv_heads=1, terms=3)
    zeros = torch.zeros(1, 1, 3, 4, dtype=F64)
    weights = hea.weights(zeros, zeros, None, 0.5)  # A = 0: only the A^0 term remains
    assert torch.equal(weights, torch.ones(1, 1, 3, 3, dtype=F64))


@pytest.mark.parametrize("terms", [1, 2, 3, 6])
@pytest.mark.parametrize("shape", [(5, 5), (6, 4), (4, 6)])
def test_truncated_circledast_exponential_has_a_closed_form(shape, terms):
    a = random(*shape) * 0.5
    literal = series(a, terms, circledast, torch.eye(*shape, dtype=F64))
    torch.testing.assert_close(nonsquare_exp(a, terms), literal, rtol=1e-12, atol=1e-12)


def test_whole_series_closed_form_is_the_limit_of_the_truncations():
    a = random(5, 5) * 0.3
    literal = series(a, 40, circledast, torch.eye(5, 5, dtype=F64))
    torch.testing.assert_close(nonsquare_exp(a, None), literal, rtol=1e-12, atol=1e-12)
    a[:, 2] += 1e-6 / 5 - a[:, 2].mean()  # column sum 1e-6: the small-s branch of expm1(s)/s
    a[:, 3] -= a[:, 3].mean()  # column sum 0: the limit expm1(s)/s -> 1
    torch.testing.assert_close(nonsquare_exp(a, None), series(a, 40, circledast, torch.eye(5, 5, dtype=F64)))


# --- The scorers: outputs against the literal definitions -------------------------------------------------


def scorer(cls, config_cls, heads=2, kv_heads=1, d=4, **options):
    shape = geometry(
        hidden_size=heads * d,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        query_bias=False,
        query_weight_std=0.02,
    )
    return cls(config_cls(mode="replace", **options), shape)


def padding_mask(batch, seq, lengths):
    """Additive (batch, 1, seq, seq): keys beyond each sequence's length blocked for every query."""
    mask = torch.zeros(batch, 1, seq, seq, dtype=F64)
    for b, length in enumerate(lengths):
        mask[b, ..., length:] = BLOCKED
    return mask


@pytest.mark.parametrize("terms", [1, 2, 4, None])
@pytest.mark.parametrize("need_weights", [False, True])
def test_nsea_output_is_the_literal_series_times_values_and_ignores_padding(terms, need_weights):
    """The linear-time path and the weight-matrix path both equal exp_⊛(Q K^T * scale) V computed
    literally on each sequence without its padding; grouped-query heads share their kv head."""
    nsea = scorer(NseaScorer, NseaConfig, terms=terms)
    batch, seq, lengths, scale = 2, 6, [6, 4], 0.5
    query, key, value = (
        random(batch, 2, seq, 4, seed=1),
        random(batch, 1, seq, 4, seed=2),
        random(batch, 1, seq, 4, seed=3),
    )
    out, weights = scored_attention(
        nsea, query, key, value, padding_mask(batch, seq, lengths), scaling=scale, need_weights=need_weights
    )
    assert (weights is not None) == need_weights
    for b, length in enumerate(lengths):
        for n in range(2):
            q, k, v = query[b, n, :length], key[b, 0, :length], value[b, 0, :length]
            exponent = q @ k.T * scale
            literal = series(exponent, 40 if terms is None else terms, circledast, torch.eye(length, dtype=F64)) @ v
            torch.testing.assert_close(out[b, :length, n], literal, rtol=1e-10, atol=1e-10)
            if need_weights:
                assert torch.all(weights[b, n, :length, length:] == 0)  # padded keys get no weight


@pytest.mark.parametrize("terms", [1, 2, 5, None])
def test_hea_output_is_the_elementwise_series_with_blocked_pairs_at_zero(terms):
    hea = scorer(HeaScorer, HeaConfig, terms=terms)
    seq, scale = 5, 0.5
    query, key, value = random(1, 2, seq, 4, seed=1), random(1, 1, seq, 4, seed=2), random(1, 1, seq, 4, seed=3)
    causal = torch.zeros(1, 1, seq, seq, dtype=F64).masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), BLOCKED)
    out, weights = scored_attention(hea, query, key, value, causal, scaling=scale, is_causal=True, need_weights=True)
    for n in range(2):
        exponent = query[0, n] @ key[0, 0].T * scale
        ones = torch.ones(seq, seq, dtype=F64)
        literal = series(exponent, 40 if terms is None else terms, torch.mul, ones) * ones.tril()
        torch.testing.assert_close(weights[0, n], literal, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out[0, :, n], literal @ value[0, 0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["nsea", "hea"])
def test_gradcheck(name):
    cls, config_cls = (NseaScorer, NseaConfig) if name == "nsea" else (HeaScorer, HeaConfig)
    module = scorer(cls, config_cls, heads=2, kv_heads=2, terms=3)
    mask = padding_mask(2, 4, [4, 3])

    def attention(query, key, value):
        return scored_attention(module, query, key, value, mask, scaling=0.5)[0]

    inputs = tuple(random(2, 2, 4, 4, seed=s).mul(0.5).requires_grad_() for s in range(3))
    assert torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-7)


# --- Through patch_model ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", family_names(core=True, causal=True))
def test_nsea_refuses_causal_models_and_leaves_them_untouched(family):
    model = tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="nsea cannot serve .*causal.*later tokens.*'hea'"):
        hf_neural_attn.patch_model(model, "nsea", mode="replace")
    assert not hf_neural_attn.is_patched(model)
    assert model.config._attn_implementation != "hf_neural_attn"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "'nsea' has no function-preserving form.*mode='replace'"),
        ({"mode": "replace", "impl": "chunked"}, "impl='chunked' does not apply to 'nsea'"),
        ({"mode": "replace", "terms": 0}, "terms must be a positive integer"),
        ({"mode": "residual"}, "mode='residual' is not supported"),
    ],
)
def test_nsea_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        hf_neural_attn.patch_model(tiny_bert(), "nsea", **options)


def test_hea_is_causal_on_a_decoder():
    """Changing a later token leaves every earlier position's logits unchanged."""
    model = hf_neural_attn.patch_model(tiny_llama(), "hea", mode="replace")
    ids = torch.randint(2, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=0)
    assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["nsea", "hea"])
def test_encoder_outputs_ignore_padding(name):
    model = hf_neural_attn.patch_model(tiny_bert(), name, mode="replace")
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 6:] = 0
    with torch.no_grad():
        batched = model(ids, attention_mask=attention_mask).logits
        alone = model(ids[1:, :6]).logits
    torch.testing.assert_close(batched[1:, :6], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["nsea", "hea"])
def test_trains_from_scratch(name):
    """A tiny masked-LM memorises one batch: the loss falls, gradients stay finite (the checkpoint round trip is
    in tests/scorers/test_scorer_contracts.py)."""
    model = hf_neural_attn.patch_model(tiny_bert(), name, mode="replace").train()
    ids = torch.randint(2, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
