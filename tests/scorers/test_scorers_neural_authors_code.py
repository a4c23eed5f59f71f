"""Neural Attention as the authors' public code computes it: ``NeuralAttentionConfig.authors_code()``.

The reference below is a small copy of the authors' module, in plain torch: DiGiugno & Mahmood,
github.com/awayfromzel/neural-attention-research, ``nlp_neural_attention/Models/NeuralAttention.py`` (their einops
rearranges written as view/permute). It differs from the paper's equations where the code does: biased
down-projections, ``Linear(2d' -> d') ReLU Linear(d' -> d'/2) ReLU Linear(d'/2 -> 1)``, and no 1/sqrt(d) on the
score (docs/scorers.md, "The paper, the authors' code and the defaults").

Tolerances: float64 throughout. The library sums the first layer as P_i + R_j instead of one product with the
concatenation, and drops the last layer's bias (a constant per score, which softmax removes): scores agree to
1e-10 after that bias is subtracted, attention outputs and gradients to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_gpt2
from helpers.references import F64, HEADS, HIDDEN, KV_HEADS, D, causal_gradcheck, geometry, randomise
from torch import nn

import hf_neural_attn
from hf_neural_attn.ops import blockwise, chunked
from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import NeuralAttentionConfig, NeuralAttentionScorer

TOLERANCE = {"rtol": 1e-10, "atol": 1e-10}
SEQ = 7  # tokens: with query blocks of 3, three blocks and causal blocks skipped


class AuthorsNeuralAttention(nn.Module):
    """The authors' NeuralAttention module (see the module doc), causal, without a padding mask."""

    def __init__(self, dim: int, heads: int, projection_dim: int):
        super().__init__()
        self.heads, self.dim_head = heads, dim // heads
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.W_out = nn.Linear(dim, dim, bias=False)
        self.q_proj = nn.Linear(self.dim_head, projection_dim)
        self.k_proj = nn.Linear(self.dim_head, projection_dim)
        self.linear1 = nn.Linear(projection_dim * 2, projection_dim)
        self.linear2 = nn.Linear(projection_dim, projection_dim // 2)
        self.linear3 = nn.Linear(projection_dim // 2, 1)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v, each (batch, heads, n, dim_head), from x (batch, n, dim): their 'b n (d k h) -> k b h n d'."""
        batch, n, _ = x.shape
        return tuple(self.to_qkv(x).view(batch, n, self.dim_head, 3, self.heads).permute(3, 0, 4, 1, 2))

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """(batch, heads, n, n): the MLP on every concatenated pair, unscaled."""
        q, k = self.q_proj(q), self.k_proj(k)
        n = q.shape[2]
        pairs = torch.cat((q.unsqueeze(3).repeat(1, 1, 1, n, 1), k.unsqueeze(2).repeat(1, 1, n, 1, 1)), dim=-1)
        return self.linear3(torch.relu(self.linear2(torch.relu(self.linear1(pairs))))).squeeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_heads(x)
        score = self.scores(q, k)
        score = score.masked_fill(torch.ones_like(score).triu_(1).bool(), float("-inf"))
        out = torch.softmax(score, dim=-1) @ v
        return self.W_out(out.transpose(1, 2).flatten(2))


def load_authors_weights(scorer: NeuralAttentionScorer, authors: AuthorsNeuralAttention) -> None:
    """The authors' scoring weights into the library's scorer: linear1 split into its query and key halves (its
    bias with the key half), linear2 the deeper layer, linear3's weight the output weights (its bias has no place:
    softmax removes it)."""
    d = authors.q_proj.out_features
    with torch.no_grad():
        for mine, theirs in ((scorer.query_down, authors.q_proj), (scorer.key_down, authors.k_proj)):
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)
        scorer.pair_query.weight.copy_(authors.linear1.weight[:, :d])
        scorer.pair_key.weight.copy_(authors.linear1.weight[:, d:])
        scorer.pair_key.bias.copy_(authors.linear1.bias)
        scorer.deeper[0].weight.copy_(authors.linear2.weight)
        scorer.deeper[0].bias.copy_(authors.linear2.bias)
        scorer.output.weight.copy_(authors.linear3.weight)


def authors_module_for(attention: nn.Module, proj_dim: int) -> AuthorsNeuralAttention:
    """The authors' module with random scoring weights and a GPT-2 attention's projections, mapped: their to_qkv is
    c_attn with its columns in their (d, k, h) order, W_out is c_proj (both without biases, which the caller
    zeroes on the GPT-2 side)."""
    dim, heads = attention.embed_dim, attention.num_heads
    authors = AuthorsNeuralAttention(dim, heads, proj_dim).double()
    # Normal draws, larger than PyTorch's default: at d' = 2 the second layer is one ReLU unit, which the default
    # init often leaves inactive for every pair of a small input (every score 0, nothing compared).
    randomise(authors, seed=1, std=0.7)
    with torch.no_grad():
        qkv = attention.c_attn.weight.T.view(3, heads, dim // heads, dim)  # GPT-2's (k, h, d) output order
        authors.to_qkv.weight.copy_(qkv.permute(2, 0, 1, 3).reshape(3 * dim, dim))
        authors.W_out.weight.copy_(attention.c_proj.weight.T)
    return authors


def test_the_preset_is_the_authors_options():
    config = NeuralAttentionConfig.authors_code(proj_dim=4, impl="chunked")
    expected = {"proj_dim": 4, "proj_bias": True, "h": 4, "depth": 2, "activation": "relu", "mode": "replace"}
    assert {name: getattr(config, name) for name in expected} == expected
    assert config.scale_mlp is False and config.impl == "chunked"
    assert config.hidden_widths() == [4, 2]  # 2d' -> d' -> d'/2 -> 1
    assert NeuralAttentionConfig.authors_code().proj_dim == 2  # their head_dim // 32 at the paper's head dim 64
    with pytest.raises(ValueError, match="none for proj_dim=1. Use proj_dim >= 2"):
        NeuralAttentionConfig.authors_code(proj_dim=1)


@pytest.mark.parametrize("proj_dim", [2, 4])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_a_patched_gpt2_layer_is_the_authors_module(monkeypatch, paths_taken, impl, proj_dim):
    """Layer 0 of a float64 GPT-2 patched with the preset, against the authors' module with the same weights:
    the scores, and the attention block's output on the reference path and on impl="chunked" (depth 2 has no
    fused form: the generic chunked path, in blocks of 3 queries)."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 3)
    model = tiny_gpt2().double()
    attention = model.transformer.h[0].attn
    with torch.no_grad():  # the authors' projections have no biases
        attention.c_attn.bias.zero_()
        attention.c_proj.bias.zero_()
    config = NeuralAttentionConfig.authors_code(proj_dim=proj_dim, impl=impl)
    with pytest.warns(UserWarning, match="mode='replace'"):
        hf_neural_attn.patch_model(model, config, layers=[0])
    scorer = attention.attn_scorer
    authors = authors_module_for(attention, proj_dim)
    load_authors_weights(scorer, authors)

    x = torch.randn(2, SEQ, attention.embed_dim, dtype=F64, generator=torch.Generator().manual_seed(2))
    q, k, _ = authors.split_heads(x)
    expected_scores = authors.scores(q, k) - authors.linear3.bias
    torch.testing.assert_close(scorer.scores(q, k, None, attention.head_dim**-0.5), expected_scores, **TOLERANCE)
    assert expected_scores.std() > 0.01, "every ReLU unit is inactive: the case compares nothing"

    with torch.no_grad():
        output = attention(x)[0]
    torch.testing.assert_close(output, authors(x), **TOLERANCE)
    assert paths_taken == [impl]


def test_a_whole_model_trains_the_same_on_the_reference_and_the_chunked_path(monkeypatch):
    """Loss and every parameter's gradient of a float64 GPT-2 with the preset in its first layer."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 3)
    input_ids = torch.randint(2, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    results = {}
    for impl in ("reference", "chunked"):
        model = tiny_gpt2().double()
        with pytest.warns(UserWarning, match="mode='replace'"):
            hf_neural_attn.patch_model(model, NeuralAttentionConfig.authors_code(impl=impl), layers=[0])
        randomise(model.transformer.h[0].attn.attn_scorer, std=0.7)  # the same draw for both paths, its unit live
        model(input_ids, labels=input_ids).loss.backward()
        results[impl] = {name: p.grad for name, p in model.named_parameters()}
    reference, chunked_grads = results["reference"], results["chunked"]
    assert reference["transformer.h.0.attn.attn_scorer.query_down.bias"].abs().max() > 0
    for name, grad in reference.items():
        torch.testing.assert_close(chunked_grads[name], grad, **TOLERANCE, msg=name)


def test_gradcheck_of_the_preset():
    """float64 gradcheck of the preset's whole scorer path (hidden states, q, k, v and every parameter)."""
    torch.manual_seed(0)
    scorer = NeuralAttentionScorer(NeuralAttentionConfig.authors_code(proj_dim=4), geometry(num_kv_heads=2))
    randomise(scorer, std=0.5)
    query, key = torch.randn(2, 1, HEADS, 3, D, dtype=F64, generator=torch.Generator().manual_seed(0))
    assert scorer.pair_scores(query, key).std() > 0.01, "every ReLU unit is inactive: the check would be empty"
    assert causal_gradcheck(scorer, seq=3)


def one_layer_unscaled_scorer() -> NeuralAttentionScorer:
    """The new options on a one-hidden-layer MLP, which has a fused form (the blockwise path and the kernels)."""
    config = NeuralAttentionConfig(h=3, proj_dim=2, proj_bias=True, mode="replace", scale_mlp=False)
    scorer = NeuralAttentionScorer(config, geometry())  # 2 query heads on 1 key/value head
    randomise(scorer, std=0.6)
    return scorer


def test_the_blockwise_path_serves_the_new_options(monkeypatch, paths_taken):
    """Unscaled replace scores with biased projections on the blockwise path (blocks of 2, grouped-query heads, a
    left-padded sequence): output and every gradient equal the reference path's, which is A itself, unscaled."""
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 2)
    scorer = one_layer_unscaled_scorer()
    assert scorer.fused_unsupported_reason() is None
    generator = torch.Generator().manual_seed(4)
    query = torch.randn(2, 2, 5, D, dtype=F64, generator=generator)
    key, value = (torch.randn(2, KV_HEADS, 5, D, dtype=F64, generator=generator) for _ in range(2))
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5).clone()
    allowed[1, ..., :2] = False
    allowed[1, ..., :] |= torch.eye(5, dtype=torch.bool)  # every row attends somewhere
    mask = torch.zeros(allowed.shape, dtype=F64).masked_fill(~allowed, torch.finfo(F64).min)
    # Unscaled: the reference's scores are the pair MLP itself.
    torch.testing.assert_close(scorer.scores(query, key, None, 0.5), scorer.pair_scores(query, key), rtol=0, atol=0)

    results = {}
    for impl in ("reference", "chunked"):
        scorer.config.impl = impl
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        scorer.zero_grad()
        output, _ = scored_attention(scorer, *inputs, mask, scaling=D**-0.5, extras=None, is_causal=True)
        (output * torch.linspace(-1, 1, output.numel(), dtype=F64).view_as(output)).sum().backward()
        results[impl] = [output.detach(), *(t.grad for t in inputs), *(p.grad.clone() for p in scorer.parameters())]
    assert paths_taken == ["reference", "blockwise"]
    for index, (tensor, expected) in enumerate(zip(results["chunked"], results["reference"], strict=True)):
        torch.testing.assert_close(tensor, expected, **TOLERANCE, msg=lambda m, i=index: f"tensor {i}: {m}")

    scorer.config.impl = "chunked"

    def attention(query, key, value, *parameters):  # gradcheck perturbs the scorer's parameters in place
        return scored_attention(scorer, query, key, value, mask, scaling=D**-0.5, extras=None, is_causal=True)[0]

    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    assert torch.autograd.gradcheck(attention, (*leaves, *scorer.parameters()), eps=1e-6, atol=1e-6)


def test_the_preset_round_trips_through_a_checkpoint(tmp_path):
    model = tiny_gpt2()
    with pytest.warns(UserWarning, match="mode='replace'"):
        hf_neural_attn.patch_model(model, NeuralAttentionConfig.authors_code(), layers=[0])
    randomise(model.transformer.h[0].attn.attn_scorer, std=0.5)
    model.save_pretrained(tmp_path)
    reloaded = hf_neural_attn.from_pretrained(tmp_path)
    options = reloaded.config.hf_neural_attn["options"]
    assert (options["proj_bias"], options["scale_mlp"], options["depth"], options["h"]) == (True, False, 2, 2)
    scorer = reloaded.transformer.h[0].attn.attn_scorer
    assert scorer.config == NeuralAttentionConfig.authors_code(pair_input="concat")
    input_ids = torch.randint(2, 64, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=1e-6)


def test_a_record_without_the_new_options_loads_as_before():
    """Records written before proj_bias and scale_mlp existed meant no bias and Eq. 10's scaling."""
    record = {"impl": "auto", "h": 4, "activation": "gelu", "init": "default", "proj_dim": 2, "mode": "replace"}
    config = NeuralAttentionConfig.from_record({**record, "depth": 1, "pair_input": "concat"})
    assert (config.proj_bias, config.scale_mlp) == (False, True)
    scorer = NeuralAttentionScorer(config, geometry(hidden_size=HIDDEN))
    assert scorer.query_down.bias is None and scorer.key_down.bias is None
