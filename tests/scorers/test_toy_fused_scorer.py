"""A new scorer with a fused form is one module and one registry line: this test writes one (``ToyPairScorer``, whose
fused form is the existing pair-MLP term), registers it for its own duration, patches a tiny model with it by name
and runs it on every path, touching no library module.

What must hold: ``impl="chunked"`` runs it blockwise (its fused form, not the generic chunked path), ``impl="auto"``
takes the reference path for a short call and the blockwise one above the scorer's ``reference_max_scores``, and
``impl="triton"`` runs the kernels (Triton's CPU interpreter); the logits agree with the reference path's within
``atol=1e-5`` and every parameter's gradient within ``1e-4`` times that gradient's largest magnitude (fp32: the paths
sum the same terms in different orders, ~1e-6 relative; the toy's own gradients are ~1e-4 in a tiny Llama, so an
absolute bound would not see a wrong one).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers.installed import needs_triton
from helpers.models import model_inputs, perturb_scorers, tiny_llama
from helpers.paths import always_blockwise
from torch import nn

import hf_neural_attn
from hf_neural_attn.ops.grouped import group_heads, grouped_matmul
from hf_neural_attn.ops.terms import PAIR_MLP, FusedInputs
from hf_neural_attn.scorers import ACTIVATIONS, SCORERS, MLPScorerConfig, Scorer

LOGITS_ATOL = 1e-5
GRAD_RTOL = 1e-4  # of each gradient's largest magnitude


@dataclass
class ToyPairConfig(MLPScorerConfig):
    """The toy's options: ``h``, ``activation``, ``init`` (unused) and ``impl``, all from MLPScorerConfig."""

    scorer_name = "toy_pair"


class ToyPairScorer(Scorer):
    """``scaling * q.k + gate * sum_l w_l act((q A)_l + (k B)_l + c_l)``: a pair MLP on each query and key, the
    smallest scorer whose fused form is the pair-MLP term."""

    name = "toy_pair"
    config_class = ToyPairConfig

    def __init__(self, config: ToyPairConfig, geometry):
        super().__init__(config, geometry)
        factory = {"dtype": geometry.dtype, "device": geometry.device}
        d, h = geometry.head_dim, config.h
        self.query_half = nn.Parameter(torch.empty(d, h, **factory))
        self.key_half = nn.Parameter(torch.empty(d, h, **factory))
        self.bias = nn.Parameter(torch.empty(h, **factory))
        self.output = nn.Parameter(torch.empty(h, **factory))
        self.gate = nn.Parameter(torch.empty(geometry.num_heads, **factory))
        self.init_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for parameter in (self.query_half, self.key_half, self.bias, self.output):
            parameter.normal_(0.0, 0.5)
        self.gate.zero_()  # function-preserving: the term starts switched off

    def scores(self, query, key, extras, scaling):
        kv_heads = key.shape[1]
        per_query = group_heads(query @ self.query_half, kv_heads)  # (batch, kv_heads, groups, q, h)
        per_key = key @ self.key_half + self.bias  # (batch, kv_heads, kv, h)
        hidden = ACTIVATIONS[self.config.activation](per_query.unsqueeze(-2) + per_key[:, :, None, None])
        mlp = (hidden @ self.output).flatten(1, 2)  # (batch, heads, q, kv)
        return grouped_matmul(query, key.transpose(-1, -2)) * scaling + self.gate.view(1, -1, 1, 1) * mlp

    def fused_unsupported_reason(self):
        return None

    def fused_inputs(self, query, key, extras):
        tensors = (query @ self.query_half, key @ self.key_half + self.bias, self.output, self.gate)
        return FusedInputs(PAIR_MLP, tensors, self.config.activation, self.config.h)


@pytest.fixture
def toy_registered(monkeypatch):
    """ToyPairScorer in the scorer registry while the test runs (one line, as in hf_neural_attn/scorers)."""
    monkeypatch.setitem(SCORERS, ToyPairScorer.name, ToyPairScorer)


def run_toy(impl: str):
    """Logits of a tiny Llama (4 query heads on 2 kv heads, RoPE, 6 tokens) patched with the live toy under
    ``impl``, and every parameter's gradient of its loss."""
    model = hf_neural_attn.patch_model(tiny_llama(), ToyPairScorer.name, h=3, impl=impl)
    perturb_scorers(model)  # gates away from 0: the toy's term is live
    inputs = model_inputs("llama", seq=6)
    output = model(**inputs, labels=inputs["input_ids"])
    output.loss.backward()
    return output.logits.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_matches_the_reference(impl: str, reference) -> None:
    logits, grads = run_toy(impl)
    ref_logits, ref_grads = reference
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    assert grads.keys() == ref_grads.keys() and any("query_half" in name for name in grads)
    for name, ref_grad in ref_grads.items():
        atol = GRAD_RTOL * ref_grad.abs().max().item()
        torch.testing.assert_close(grads[name], ref_grad, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "impl,long_calls,path",
    [("chunked", False, "blockwise"), ("auto", False, "reference"), ("auto", True, "blockwise")],
    ids=["chunked", "auto-short", "auto-long"],
)
def test_a_toy_fused_scorer_runs_on_its_fused_path_and_matches_the_reference(
    toy_registered, paths_taken, monkeypatch, impl, long_calls, path
):
    reference = run_toy("reference")
    assert paths_taken and set(paths_taken) == {"reference"}
    paths_taken.clear()
    if long_calls:
        always_blockwise(monkeypatch)  # every call above the toy's threshold (the Scorer default)
    assert_matches_the_reference(impl, reference)
    assert paths_taken and set(paths_taken) == {path}


@needs_triton
def test_a_toy_fused_scorer_runs_on_the_triton_kernels(toy_registered, interpreter, triton_calls):
    reference = run_toy("reference")
    assert_matches_the_reference("triton", reference)
    assert len(triton_calls) == 2  # one call per layer: the kernels served it, no fallback
