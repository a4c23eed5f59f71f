"""Every compute path gives the reference's outputs and gradients on every mask form and on grouped-query attention.

The oracle is the reference path with an explicit additive float mask built here, and keys repeated here for
their query heads. Each path (``reference``, ``chunked`` and ``auto``) then runs the same call with the mask in
the form transformers hands it (None for a purely causal batch, SDPA's boolean mask, the eager float mask) and
the keys in their kv heads. The chunked path runs in blocks of 3 queries, so lengths are not block multiples
and causal blocks are skipped. fp32, 1e-5 on outputs and on every gradient (hidden states, q, k, v, each scorer
parameter), absolute, times the tensor's largest magnitude where that is above 1: a parameter gradient sums
many rows, and fp32's own spacing near 8 is already 1e-6. Rows with no key to attend to (left padding) are left out of the comparison: their
output is uniform over whichever keys a path visits.

The last tests check which path a call takes: the ``impl="auto"`` rule by shape, and that it is the default.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import logits, model_inputs, perturb_scorers, tiny_gpt2
from helpers.paths import PATH_IMPLS, PORTABLE_IMPLS, always_blockwise, scorer_impls
from helpers.references import F64, HIDDEN, assert_same_outputs_and_grads, geometry, randomise
from torch.utils._python_dispatch import TorchDispatchMode

import hf_neural_attn
from hf_neural_attn.ops import blockwise, chunked, dispatch
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import NeuralAttentionConfig, NeuralAttentionScorer, QanaConfig, QanaScorer

D = 4
SCALING = D**-0.5
ACTIVATIONS = ["gelu", "relu", "silu", "tanh", "sigmoid"]
# name -> config maker; "neural-deep" (two hidden layers) has no fused form and runs the generic chunked path.
TERMS = {
    "qana": lambda activation: QanaConfig(h=3, activation=activation),
    "neural-residual": lambda activation: NeuralAttentionConfig(h=4, proj_dim=2, activation=activation),
    "neural-replace": lambda activation: NeuralAttentionConfig(h=3, mode="replace", activation=activation),
    "neural-deep": lambda activation: NeuralAttentionConfig(h=4, depth=2, activation=activation),
}
# (q_len, kv_len, mask): "none" = None with is_causal (a purely causal batch, no mask tensor), "bool" = SDPA's
# form, "float" = the eager form; "padded" left-pads the second sequence, "sliding" is a window of 3 keys.
MASKS = [
    (7, 7, "causal-none"),
    (7, 7, "causal-float"),
    (7, 7, "padded-bool"),
    (7, 7, "padded-float"),
    (8, 8, "sliding-bool"),
    (6, 6, "full-none"),
    (5, 9, "cache-bool"),  # five new queries after four cached positions
    (1, 9, "decode-none"),
]


def make_scorer(term: str, activation: str, heads: int, kv_heads: int, dtype=torch.float32):
    shape = geometry(num_heads=heads, num_kv_heads=kv_heads, head_dim=D, dtype=dtype)
    config = TERMS[term](activation)
    scorer_class = QanaScorer if term == "qana" else NeuralAttentionScorer
    scorer = scorer_class(config, shape)
    randomise(scorer, std=0.5)
    return scorer.to(dtype)


def allowed_keys(q_len: int, kv_len: int, kind: str, batch: int = 2) -> torch.Tensor | None:
    """(batch, 1, q_len, kv_len) booleans, True = attend (queries aligned to the end of the keys); None = all."""
    if kind.startswith("full"):
        return None
    offset = kv_len - q_len
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(offset)
    if kind.startswith("sliding"):
        allowed &= ~torch.ones(q_len, kv_len, dtype=torch.bool).tril(offset - 3)
    allowed = allowed.expand(batch, 1, -1, -1).clone()
    if kind.startswith("padded"):
        allowed[1, ..., :3] = False
    return allowed


def as_given(allowed: torch.Tensor | None, kind: str, dtype) -> torch.Tensor | None:
    """The mask in the form named by ``kind``'s suffix."""
    if kind.endswith("none"):
        return None
    if kind.endswith("bool"):
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def inputs(q_len, kv_len, heads, kv_heads, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()

    return (
        randn(2, q_len, HIDDEN),
        randn(2, heads, q_len, D),
        randn(2, kv_heads, kv_len, D),
        randn(2, kv_heads, kv_len, D),
    )


def run(scorer, impl, hidden, query, key, value, mask, is_causal, valid_rows):
    """Output (valid rows) and the gradients of hidden, q, k, v and every scorer parameter."""
    scorer.config.impl = impl
    tensors = [hidden, query, key, value, *scorer.parameters()]
    for tensor in tensors:
        tensor.grad = None
    extras = scorer.query_extras(hidden, None) if scorer.needs_hidden_states else None
    output, _ = scored_attention(scorer, query, key, value, mask, scaling=SCALING, extras=extras, is_causal=is_causal)
    keep = valid_rows.transpose(1, 2)  # (batch, q_len, 1, 1) against output (batch, q_len, heads, D)
    weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output) * keep
    (output * weights).sum().backward()
    return output.detach() * keep, [tensor.grad for tensor in tensors]


def oracle(scorer, hidden, query, key, value, allowed, valid_rows):
    """The reference path on an explicit float mask and keys repeated for their query heads (as leaves, whose
    gradients are summed back over each group)."""
    groups = query.shape[1] // key.shape[1]
    repeated_key, repeated_value = (
        tensor.detach().repeat_interleave(groups, dim=1).requires_grad_() for tensor in (key, value)
    )
    float_mask = as_given(allowed, "float", query.dtype) if allowed is not None else None
    output, grads = run(scorer, "reference", hidden, query, repeated_key, repeated_value, float_mask, False, valid_rows)
    per_kv_head = [grad.unflatten(1, (key.shape[1], groups)).sum(2) for grad in grads[2:4]]
    return output, grads[:2] + per_kv_head + grads[4:]


@pytest.mark.parametrize("q_len,kv_len,kind", MASKS)
@pytest.mark.parametrize("term", list(TERMS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
def test_every_path_matches_the_reference_on_every_mask(monkeypatch, impl, heads, kv_heads, term, q_len, kv_len, kind):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 3)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 3)
    scorer = make_scorer(term, "gelu", heads, kv_heads)
    hidden, query, key, value = inputs(q_len, kv_len, heads, kv_heads)
    allowed = allowed_keys(q_len, kv_len, kind)
    valid_rows = allowed.any(-1, keepdim=True) if allowed is not None else torch.ones(2, 1, q_len, 1, dtype=torch.bool)
    expected = oracle(scorer, hidden, query, key, value, allowed, valid_rows)
    mask = as_given(allowed, kind, query.dtype)
    is_causal = not kind.startswith("full")
    assert_same_outputs_and_grads(
        run(scorer, impl, hidden, query, key, value, mask, is_causal, valid_rows), expected, atol=1e-5
    )


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("term", ["qana", "neural-residual", "neural-replace"])
def test_blockwise_path_matches_the_reference_for_every_activation(monkeypatch, term, activation):
    """The blockwise pair-MLP path has each activation's derivative of its own: check them all."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 3)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 3)
    scorer = make_scorer(term, activation, 4, 2)
    assert resolve_path(scorer, "chunked") == "blockwise"
    hidden, query, key, value = inputs(7, 7, 4, 2, seed=3)
    allowed = allowed_keys(7, 7, "padded")
    valid_rows = allowed.any(-1, keepdim=True)
    expected = oracle(scorer, hidden, query, key, value, allowed, valid_rows)
    result = run(scorer, "chunked", hidden, query, key, value, allowed, True, valid_rows)
    assert_same_outputs_and_grads(result, expected, atol=1e-5)


@pytest.mark.parametrize("term", ["qana", "neural-residual", "neural-replace"])
def test_blockwise_gradcheck_in_float64(monkeypatch, term):
    """float64 gradcheck of the blockwise path (GQA, padding, blocks of 2) against finite differences."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 2)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 2)
    scorer = make_scorer(term, "gelu", 4, 2, dtype=F64)
    scorer.config.impl = "chunked"
    hidden, query, key, value = inputs(5, 5, 4, 2, dtype=F64, seed=1)
    allowed = allowed_keys(5, 5, "padded")
    allowed[1, ..., :] |= torch.eye(5, dtype=torch.bool)  # every row attends somewhere: a smooth function

    def attention(hidden, query, key, value, *parameters):
        # The scorer's own parameters are gradcheck's inputs: it perturbs them in place.
        extras = scorer.query_extras(hidden, None) if scorer.needs_hidden_states else None
        return scored_attention(scorer, query, key, value, allowed, scaling=SCALING, extras=extras, is_causal=True)[0]

    parameters = list(scorer.parameters())
    assert torch.autograd.gradcheck(attention, (hidden, query, key, value, *parameters), eps=1e-6, atol=1e-6)


class _OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                self.shapes.add(tuple(value.shape))
        return result


@pytest.mark.parametrize("term", list(TERMS))
@pytest.mark.parametrize("impl", PATH_IMPLS)
def test_no_path_repeats_keys_or_values_under_grouped_query_attention(monkeypatch, impl, term):
    """8 query heads share 1 kv head: forward and backward never make a (batch, 8, kv_len, d) tensor, the shape
    of keys or values repeated for every query head (the outputs keep the query length, 5, not kv_len, 9)."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 2)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 2)
    scorer = make_scorer(term, "gelu", 8, 1)
    hidden, query, key, value = inputs(5, 9, 8, 1)
    allowed = allowed_keys(5, 9, "cache")
    recorder = _OutputShapes()
    with recorder:
        run(scorer, impl, hidden, query, key, value, allowed, True, allowed.any(-1, keepdim=True))
    assert key.grad.shape == (2, 1, 9, D)
    assert (2, 8, 9, D) not in recorder.shapes


# --- which path a call takes ---------------------------------------------------------------------------


def resolve_path(scorer, impl, q_len=8, kv_len=8, **flags):
    """The path (a key of dispatch.PATHS) ``impl`` takes for a causal fp32 CPU call of ``scorer``."""
    return dispatch.resolve_impl(
        impl, scorer, device="cpu", dtype=torch.float32, q_len=q_len, kv_len=kv_len, head_dim=D, is_causal=True,
        **flags,
    )  # fmt: skip


def test_auto_rule_by_shape(monkeypatch):
    """impl="auto" materialises scores up to the scorer's reference_max_scores numbers (batch x heads x q x kv x
    h), then goes blockwise; on CUDA too with the Triton kernels switched off (test_triton.py checks them on)."""
    scorer = make_scorer("qana", "gelu", 4, 4)  # h = 3

    def path(batch, q_len, kv_len, device="cpu", **flags):
        return dispatch.resolve_impl(
            "auto", scorer, device=device, dtype=torch.float32, q_len=q_len, kv_len=kv_len, head_dim=D,
            is_causal=True, batch=batch, heads=4, **flags,
        )  # fmt: skip

    largest = int((scorer.reference_max_scores / (4 * 3)) ** 0.5)  # the longest square call kept whole, batch 1
    assert path(1, largest, largest) == "reference"
    assert path(1, largest + 1, largest + 1) == "blockwise"  # QANA has a fused form: "chunked" runs it blockwise
    assert path(2, largest, largest) == "blockwise"  # the batch counts: the score tensor doubles
    assert path(1, 1, 8192) == "reference"  # a decode step scores one row
    monkeypatch.setattr(dispatch, "TRITON_IN_AUTO", False)
    assert path(1, 4096, 4096, device="cuda") == "blockwise"
    assert path(8, 4096, 4096, need_weights=True) == "reference"  # only the reference path returns maps


def test_auto_threshold_is_per_scorer():
    """QANA's blockwise form overtakes the reference path at smaller calls than Neural Attention's does
    (docs/benchmarks.md, "The auto rule"): a call between the two thresholds runs blockwise for QANA and on the
    reference path for Neural Attention; each scorer's own threshold is where its choice switches."""
    qana, neural = make_scorer("qana", "gelu", 4, 4), make_scorer("neural-residual", "gelu", 4, 4)  # h = 3, 4
    assert qana.reference_max_scores < neural.reference_max_scores

    def path(scorer, q_len):
        return dispatch.resolve_impl(
            "auto", scorer, device="cpu", dtype=torch.float32, q_len=q_len, kv_len=q_len, head_dim=D,
            is_causal=True, batch=1, heads=4,
        )  # fmt: skip

    between = int((neural.reference_max_scores / (4 * 4)) ** 0.5)  # Neural's longest square call kept whole
    assert 4 * between * between * 3 > qana.reference_max_scores  # ... which QANA (h = 3) computes blockwise
    assert path(qana, between) == "blockwise" and path(neural, between) == "reference"
    assert path(neural, between + 1) == "blockwise"


def test_patch_model_defaults_to_auto_and_auto_follows_the_call(monkeypatch):
    """What a user gets without naming impl: "auto"; short calls run the reference path, long ones (here: any,
    with the threshold at 0) the chunked one, with the same logits."""
    model = hf_neural_attn.patch_model(tiny_gpt2(), "qana")
    perturb_scorers(model)
    assert scorer_impls(model) == {"auto"}
    taken = []
    for name in list(dispatch.PATHS):
        original = dispatch.PATHS[name]

        def spy(*args, _original=original, _name=name, **kwargs):
            taken.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setitem(dispatch.PATHS, name, spy)
    inputs = model_inputs("gpt2")
    short = logits(model, inputs)
    assert taken and set(taken) == {"reference"}
    taken.clear()
    always_blockwise(monkeypatch)
    torch.testing.assert_close(logits(model, inputs), short, atol=1e-5, rtol=0)
    assert taken and set(taken) == {"blockwise"}
