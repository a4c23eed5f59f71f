"""Attention dropout on every compute path: the same entries dropped for the same seed, masks regenerated rather than
stored, and the semantics of the reference (after the softmax, kept entries scaled by 1 / (1 - p), none in eval).

Each call draws one seed from torch's default generator (hf_neural_attn.ops.dropout), so ``torch.manual_seed``
before a call fixes its mask. Comparisons are in fp32 with the tolerance of tests/ops/test_paths_masks_gqa.py (1e-5,
times a gradient's magnitude above 1), on every row: rows that see no key included (zero under a boolean mask,
uniform over every key under an additive one, on every path). torch.compile: tests/ops/test_compile.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.models import logits, model_inputs, perturb_scorers, tiny_gpt2, tiny_llama
from helpers.paths import always_blockwise
from helpers.references import HIDDEN, assert_same_outputs_and_grads, geometry, randomise
from helpers.scorers import FUSED_SCORERS
from torch.utils._python_dispatch import TorchDispatchMode

import hf_neural_attn
from hf_neural_attn.ops import blockwise, chunked, dispatch
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.ops.dropout import AttentionDropout, head_streams, keep_mask
from hf_neural_attn.scorers import NeuralAttentionConfig, NeuralAttentionScorer, QanaConfig, QanaScorer

D = 4
SCALING = D**-0.5
P = 0.3
# name -> config; "neural-deep" has no fused form: the generic chunked path.
TERMS = {
    "qana": lambda: QanaConfig(h=3),
    "neural": lambda: NeuralAttentionConfig(h=4, proj_dim=2),
    "neural-deep": lambda: NeuralAttentionConfig(h=4, depth=2),
}
# "padded" is SDPA's boolean mask of a left-padded batch, "padded-additive" the eager mask of the same batch.
MASKS = ["causal", "padded", "padded-additive", "sliding", "full"]


def make_scorer(term: str, heads: int, kv_heads: int, dtype=torch.float32):
    config = TERMS[term]()
    scorer_class = QanaScorer if term == "qana" else NeuralAttentionScorer
    scorer = scorer_class(config, geometry(num_heads=heads, num_kv_heads=kv_heads, head_dim=D, dtype=dtype))
    randomise(scorer, std=0.5)
    return scorer.to(dtype)


def case(kind: str, heads: int, kv_heads: int, q_len: int = 9, dtype=torch.float32, seed: int = 0):
    """(hidden, query, key, value) leaves, the mask as transformers hands it, and is_causal."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()

    tensors = (
        randn(2, q_len, HIDDEN),
        randn(2, heads, q_len, D),
        randn(2, kv_heads, q_len, D),
        randn(2, kv_heads, q_len, D),
    )
    allowed = torch.ones(2, 1, q_len, q_len, dtype=torch.bool)
    if kind != "full":
        allowed &= torch.ones(q_len, q_len, dtype=torch.bool).tril()
    if kind.startswith("padded"):
        allowed[1, ..., :3] = False  # three pads on the left: rows 0-2 of sequence 1 see no key
    if kind == "sliding":
        allowed &= torch.ones(q_len, q_len, dtype=torch.bool).triu(-2)
    mask = None if kind in ("causal", "full") else allowed
    if kind == "padded-additive":
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return tensors, mask, kind != "full"


def run(scorer, impl, tensors, mask, is_causal, seed, p=P):
    """Output and the gradients of hidden, q, k, v and every scorer parameter, one training call with dropout ``p``
    whose seed is drawn after ``torch.manual_seed(seed)``."""
    scorer.config.impl = impl
    hidden, query, key, value = tensors
    leaves = [*tensors, *scorer.parameters()]
    for leaf in leaves:
        leaf.grad = None
    extras = scorer.query_extras(hidden, None) if scorer.needs_hidden_states else None
    torch.manual_seed(seed)
    output, _ = scored_attention(
        scorer, query, key, value, mask, scaling=SCALING, dropout=p, training=True, extras=extras, is_causal=is_causal
    )
    weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)
    (output * weights).sum().backward()
    return output.detach(), [leaf.grad for leaf in leaves]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 2 query rows on both blockwise paths: 9 tokens span several blocks, causal blocks are skipped."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 2)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 2)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("term", list(TERMS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_every_path_drops_what_the_reference_drops(small_blocks, term, heads, kv_heads, kind):
    scorer = make_scorer(term, heads, kv_heads)
    tensors, mask, is_causal = case(kind, heads, kv_heads)
    expected = run(scorer, "reference", tensors, mask, is_causal, seed=5)
    assert_same_outputs_and_grads(run(scorer, "chunked", tensors, mask, is_causal, seed=5), expected, atol=1e-5)
    # Dropout is live: another seed gives another output.
    assert (run(scorer, "chunked", tensors, mask, is_causal, seed=6)[0] - expected[0]).abs().max() > 1e-3


def test_the_paths_take_the_dropout_the_dispatcher_draws(small_blocks, monkeypatch):
    """The chunked choice with dropout runs the blockwise path (not the reference), with one seed per call."""
    taken, seeds = [], []
    for name in ("reference", "chunked", "blockwise"):
        original = dispatch.PATHS[name]

        def spy(*args, _original=original, _name=name, **kwargs):
            taken.append(_name)
            seeds.append(kwargs["dropout"].seed)
            return _original(*args, **kwargs)

        monkeypatch.setitem(dispatch.PATHS, name, spy)
    scorer = make_scorer("qana", 2, 2)
    tensors, mask, is_causal = case("causal", 2, 2)
    run(scorer, "chunked", tensors, mask, is_causal, seed=1)
    run(scorer, "chunked", tensors, mask, is_causal, seed=1)
    run(scorer, "chunked", tensors, mask, is_causal, seed=2)
    assert taken == ["blockwise"] * 3
    assert seeds[0] == seeds[1] != seeds[2]


@pytest.mark.parametrize("term", ["qana", "neural-deep"])
def test_backward_reuses_the_forward_mask_in_float64(small_blocks, term):
    """gradcheck at a fixed seed: every evaluation drops the same entries, so a backward that regenerated another
    mask than its forward's would fail."""
    scorer = make_scorer(term, 2, 1, dtype=torch.float64)
    (hidden, query, key, value), mask, is_causal = case("padded", 2, 1, q_len=5, dtype=torch.float64)
    mask[1, ..., :] |= torch.eye(5, dtype=torch.bool)  # every row attends somewhere: a smooth function
    scorer.config.impl = "chunked"

    def attention(hidden, query, key, value, *parameters):
        # The scorer's own parameters are gradcheck's inputs too: it perturbs them in place.
        extras = scorer.query_extras(hidden, None) if scorer.needs_hidden_states else None
        torch.manual_seed(0)
        return scored_attention(
            scorer, query, key, value, mask, scaling=SCALING, dropout=0.5, training=True, extras=extras,
            is_causal=is_causal,
        )[0]  # fmt: skip

    inputs = (hidden, query, key, value, *scorer.parameters())
    assert torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-6)


def test_no_n_squared_tensor_is_made_with_dropout(small_blocks):
    """Blocks of 2 rows on 9 tokens: no op may return a tensor with 9 query rows against 9 keys."""

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    self.shapes.append(tuple(tensor.shape))
            return out

    for term in TERMS:
        scorer = make_scorer(term, 4, 2)
        tensors, mask, is_causal = case("causal", 4, 2)
        recorder = Shapes()
        with recorder:
            run(scorer, "chunked", tensors, mask, is_causal, seed=0)
        assert not [shape for shape in recorder.shapes if shape[-2:] == (9, 9)], term


def test_the_keep_rate_is_one_minus_p_and_the_mean_is_kept():
    streams = head_streams(2, 4, "cpu")
    for p in (0.1, 0.5, 0.9):
        kept = keep_mask(1234, p, streams, 0, 512, 512).double()
        n = kept.numel()
        bound = 5 * math.sqrt(p * (1 - p) / n)  # five standard deviations of the binomial rate
        assert abs(kept.mean().item() - (1 - p)) < bound, p
    # Dropout preserves the expected attention output: averaged over many seeds, the dropped probabilities are
    # the probabilities (kept entries scaled by 1 / (1 - p)).
    probs = torch.softmax(torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(0)), -1)
    average = sum(AttentionDropout(0.3, seed).kept(probs, head_streams(1, 2, "cpu"), 0) for seed in range(4000)) / 4000
    torch.testing.assert_close(average, probs, rtol=0, atol=0.03)  # 5 sigma of a mean over 4000 draws


def test_masks_differ_between_heads_rows_and_seeds():
    streams = head_streams(2, 2, "cpu")
    mask = keep_mask(7, 0.5, streams, 0, 64, 64)
    assert not torch.equal(mask[0, 0], mask[0, 1]) and not torch.equal(mask[0, 0], mask[1, 0])
    assert not torch.equal(mask[..., 0, :], mask[..., 1, :])
    assert not torch.equal(mask, keep_mask(8, 0.5, streams, 0, 64, 64))
    # A block of rows is the same as those rows of the whole: the mask is a function of position, not of blocks.
    assert torch.equal(keep_mask(7, 0.5, streams, 10, 20, 40), mask[..., 10:20, :40])


def test_eval_mode_and_p_zero_drop_nothing():
    assert AttentionDropout.for_call(0.1, training=False) is None
    assert AttentionDropout.for_call(0.0, training=True) is None
    model = tiny_gpt2(attn_pdrop=0.3)
    hf_neural_attn.patch_model(model, "qana", h=2)
    perturb_scorers(model)
    inputs = model_inputs("gpt2")
    model.eval()
    torch.testing.assert_close(logits(model, inputs), logits(model, inputs), rtol=0, atol=0)


@pytest.fixture
def dropout_gpt2(monkeypatch):
    """A patched GPT-2 with attention dropout only, in train mode, and auto choosing blockwise for every call."""
    always_blockwise(monkeypatch)
    model = tiny_gpt2(attn_pdrop=0.3)
    hf_neural_attn.patch_model(model, "qana", h=2)
    perturb_scorers(model)
    return model.train()


def test_gradient_checkpointing_recomputes_the_same_masks(dropout_gpt2):
    inputs = model_inputs("gpt2", seq=16)
    results = []
    for checkpointed in (False, True):
        if checkpointed:
            dropout_gpt2.activation_checkpointing_enable()
        dropout_gpt2.zero_grad()
        torch.manual_seed(11)
        loss = dropout_gpt2(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in dropout_gpt2.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("value", [1.5, -0.1, float("nan")])
def test_a_dropout_value_that_is_no_probability_is_refused_naming_its_config_field(value):
    # At patch time, from the config, before the model changes.
    model = tiny_llama(attention_dropout=0.0)
    model.config.attention_dropout = value
    with pytest.raises(ValueError, match=r"config\.attention_dropout must be a probability in \[0, 1\]"):
        hf_neural_attn.patch_model(model, "qana")
    assert not hf_neural_attn.is_patched(model)
    # At call time, where the value reaches the attention (Llama copies it onto each attention module).
    model = tiny_llama(attention_dropout=0.1)
    hf_neural_attn.patch_model(model, "qana")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = value
    with pytest.raises(ValueError, match=r"config\.attention_dropout must be a probability"):
        model.train()(**model_inputs("llama"))
    # GPT-2 names its own field.
    model = tiny_gpt2()
    hf_neural_attn.patch_model(model, "neural")
    model.transformer.h[0].attn.attn_dropout.p = value
    with pytest.raises(ValueError, match=r"config\.attn_pdrop must be a probability"):
        model.train()(**model_inputs("gpt2"))


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("scorer", FUSED_SCORERS)
def test_dropout_one_drops_everything_as_the_unpatched_model_does(small_blocks, scorer, impl):
    unpatched = tiny_llama(attention_dropout=1.0).train()
    inputs = model_inputs("llama")
    expected = logits(unpatched, inputs)
    hf_neural_attn.patch_model(unpatched, scorer, impl=impl)
    perturb_scorers(unpatched)  # live scorers: only dropout can make their attention vanish
    patched = logits(unpatched, inputs)
    assert patched.isfinite().all()
    torch.testing.assert_close(patched, expected, rtol=0, atol=1e-5)


def _autocorrelation_z(centred: torch.Tensor, max_lag: int) -> torch.Tensor:
    """z-scores of the correlation between entries ``lag`` apart along the last axis, lags 1..max_lag, pooled over
    the other axes (an FFT per row: every lag at once)."""
    length = centred.shape[-1]
    spectrum = torch.fft.rfft(centred, n=2 * length)
    sums = torch.fft.irfft(spectrum * spectrum.conj(), n=2 * length)[..., 1 : max_lag + 1].flatten(0, -2).sum(0)
    pairs = (length - torch.arange(1, max_lag + 1, dtype=torch.float64)) * centred[..., 0].numel()
    return sums / pairs * pairs.sqrt()  # correlation (unit variance) times sqrt(number of pairs)


def test_dropout_masks_have_no_correlation_along_rows_or_columns():
    """Entries at any distance in a row or a column are uncorrelated: |z| under 6 at every lag (a 1024 x 1024 mask per
    head, two heads; random masks stay under about 4.5 over these 1,536 lags). An earlier hash correlated entries 296
    columns apart at z = -12.6 on this size."""
    p = 0.1
    kept = keep_mask(1234, p, head_streams(1, 2, "cpu"), 0, 1024, 1024).double()
    centred = (kept - (1 - p)) / math.sqrt(p * (1 - p))
    for axis, lags in (("columns", 1023), ("rows", 512)):
        z = _autocorrelation_z(centred if axis == "columns" else centred.transpose(-1, -2), lags)
        worst = int(z.abs().argmax())
        assert z.abs().max() < 6, f"entries {worst + 1} {axis} apart: z = {z[worst]:.1f}"
    heads = (centred[0, 0] * centred[0, 1]).mean() * math.sqrt(centred[0, 0].numel())
    assert abs(heads) < 6
