"""The chunked path computes what the reference path computes, with memory linear in the sequence."""

import pytest
import torch
from helpers.models import logits, model_inputs, perturb_scorers, tiny_llama, tiny_model, training_labels
from helpers.paths import PATH_IMPLS
from helpers.references import F64, HEADS, HIDDEN, KV_HEADS, D, causal_gradcheck, geometry, randomise
from helpers.scorers import FUSED_SCORERS

import hf_neural_attn
from hf_neural_attn.ops import blockwise, chunked
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import NeuralAttentionConfig, NeuralAttentionScorer, QanaConfig, QanaScorer


def make_scorer(name, dtype=torch.float32, impl="reference"):
    if name == "qana":
        scorer = QanaScorer(QanaConfig(h=2, impl=impl), geometry(dtype=dtype))
    else:
        config = NeuralAttentionConfig(h=3, proj_dim=2, depth=2, impl=impl)
        scorer = NeuralAttentionScorer(config, geometry(dtype=dtype))
    randomise(scorer)
    return scorer.to(dtype)


def attention_case(q_len, kv_len, kind, dtype, seed=0):
    """Inputs for one attention call. ``kind``: causal (queries at the end of the keys, as with a KV cache),
    padded (causal plus a left-padded second sequence), or full (bidirectional, no mask)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()

    hidden = randn(2, q_len, HIDDEN)
    query, key, value = randn(2, HEADS, q_len, D), randn(2, KV_HEADS, kv_len, D), randn(2, KV_HEADS, kv_len, D)
    mask, valid_rows = None, torch.ones(2, 1, q_len, 1, dtype=torch.bool)
    if kind != "full":
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len).expand(2, 1, -1, -1).clone()
        if kind == "padded":
            allowed[1, ..., :3] = False
        mask = torch.zeros(2, 1, q_len, kv_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        valid_rows = allowed.any(-1, keepdim=True)
    return hidden, query, key, value, mask, valid_rows


def run(scorer, impl, hidden, query, key, value, mask, valid_rows, causal):
    """Output and gradients of every input and parameter, for an upstream gradient that ignores the rows
    with no allowed key (their output is uniform over whichever keys a path visits)."""
    scorer.config.impl = impl
    tensors = [hidden, query, key, value, *scorer.parameters()]
    for tensor in tensors:
        tensor.grad = None
    extras = scorer.query_extras(hidden, None)
    output, _ = scored_attention(scorer, query, key, value, mask, scaling=D**-0.5, extras=extras, is_causal=causal)
    weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)
    weights = weights * valid_rows.transpose(1, 2)
    (output * weights).sum().backward()
    return output.detach() * valid_rows.transpose(1, 2), [t.grad for t in tensors]


@pytest.mark.parametrize("scorer_name", FUSED_SCORERS)
@pytest.mark.parametrize("q_len,kv_len,kind", [(7, 7, "causal"), (5, 9, "causal"), (7, 7, "padded"), (6, 6, "full")])
def test_chunked_matches_reference_in_fp32(monkeypatch, scorer_name, q_len, kv_len, kind):
    # Blocks of 3 queries: sequence lengths that are not block multiples, and causal blocks to skip.
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 3)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 3)
    scorer = make_scorer(scorer_name)
    case = attention_case(q_len, kv_len, kind, torch.float32)
    causal = kind != "full"
    ref_out, ref_grads = run(scorer, "reference", *case, causal)
    out, grads = run(scorer, "chunked", *case, causal)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    assert len(grads) == len(ref_grads)
    for grad, ref_grad in zip(grads, ref_grads):
        assert (grad is None) == (ref_grad is None)
        if grad is not None:
            torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("scorer_name", FUSED_SCORERS)
def test_chunked_gradcheck_in_float64(monkeypatch, scorer_name):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 2)  # 5 queries: blocks of 2, 2 and 1
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 2)
    assert causal_gradcheck(make_scorer(scorer_name, dtype=F64, impl="chunked"), seq=5, seed=1)


def saved_bytes(fn):
    """Bytes autograd keeps for backward while running ``fn``."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return total


@pytest.mark.parametrize("scorer_name", FUSED_SCORERS)
def test_chunked_keeps_memory_linear_in_sequence_length(scorer_name):
    """The reference path keeps n² · h activations for backward; the chunked path keeps O(n) tensors."""
    scorer = make_scorer(scorer_name)
    kept = {}
    for impl in PATH_IMPLS:
        for n in (128, 256):
            hidden, query, key, value, mask, _ = attention_case(n, n, "causal", torch.float32)

            def step():
                scorer.config.impl = impl
                extras = scorer.query_extras(hidden, None)
                scored_attention(scorer, query, key, value, mask, scaling=D**-0.5, extras=extras, is_causal=True)

            kept[impl, n] = saved_bytes(step)
    # Doubling n: quadratic growth (about 4x) for the reference, linear plus the n² mask for chunked.
    assert kept["reference", 256] > 3.5 * kept["reference", 128]
    mask_bytes = 2 * 256 * 256 * 4
    assert kept["chunked", 256] - mask_bytes < 2.5 * (kept["chunked", 128] - mask_bytes / 4)
    assert kept["chunked", 256] < kept["reference", 256] / 5


@pytest.mark.parametrize("scorer_name", FUSED_SCORERS)
def test_chunked_models_match_reference_models(family, scorer_name, monkeypatch):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 4)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 4)
    inputs = model_inputs(family)
    results = {}
    for impl in PATH_IMPLS:
        model = tiny_model(family)
        hf_neural_attn.patch_model(model, scorer_name, impl=impl)
        perturb_scorers(model)
        model.train()
        out = model(**inputs, labels=training_labels(model, inputs))
        out.loss.backward()
        results[impl] = out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    ref_logits, ref_grads = results.pop("reference")
    for impl, (path_logits, grads) in results.items():
        torch.testing.assert_close(path_logits, ref_logits, rtol=0, atol=1e-5)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6)


def test_chunked_generation_and_attention_maps(monkeypatch):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 4)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 4)
    model = tiny_llama()
    hf_neural_attn.patch_model(model, "qana", impl="chunked")
    perturb_scorers(model)
    prompt = model_inputs("llama", seq=6)["input_ids"]
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, use_cache=True, **settings)
    assert torch.equal(with_cache, model.generate(prompt, use_cache=False, **settings))
    # Maps are only materialised by the reference path, which serves output_attentions calls.
    attentions = model(prompt, output_attentions=True).attentions
    assert len(attentions) == 2 and attentions[0].shape == (2, 4, 6, 6)
    torch.testing.assert_close(logits(model, {"input_ids": prompt}), model(prompt, output_attentions=True).logits)
