"""Tiny models built from configs (no downloads) and helpers shared by the tests (import from here, never
from conftest or another test file).

Also here: the float64 scorer geometry and gradcheck used by the math, chunked and Triton tests, the tiny
encoder config, and SCORER_CASES, the table of scorer cases that tests/test_scorer_contracts.py runs every
common contract on (docs/testing.md)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

# Nothing in the tests may reach the Hub; say so, so a stray lookup fails at once instead of waiting.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

import hf_neural_attn
from hf_neural_attn.ops import scored_attention
from hf_neural_attn.scorers import AttentionGeometry

VOCAB = 64


# A tiny rotary decoder: 2 layers, 4 query heads sharing 2 key/value heads (grouped-query attention). Llama,
# Mistral, Qwen and Gemma configs all take these keys.
TINY_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
)


def tiny_llama(**overrides) -> LlamaForCausalLM:
    config = {**TINY_DECODER, **overrides}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def tiny_gpt2(**overrides) -> GPT2LMHeadModel:
    # GPT-2 configs default to 0.1 dropout on residuals, embeddings and attention; tests that compare
    # train-mode runs need them off (the dropout test turns attention dropout back on).
    config = dict(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config.update(overrides)
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**config)).eval()


def tiny_vit(**overrides) -> ViTForImageClassification:
    config = dict(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=3,
    )
    config.update(overrides)
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(**config)).eval()


FACTORIES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "vit": tiny_vit}
SCORER_NAMES = ["qana", "neural"]


def model_inputs(family: str, batch: int = 2, seq: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if family == "vit":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=generator)}
    return {"input_ids": torch.randint(2, VOCAB, (batch, seq), generator=generator)}


def tokens(batch: int, seq: int, seed: int = 3) -> torch.Tensor:
    """(batch, seq) random token ids of the tiny vocabulary (0 and 1 left out: pad and special ids)."""
    return torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_left_padding_and_cache_exact(model, atol: float = 1e-4) -> None:
    """A decoder with live scorers: a left-padded batch gives each sequence's own logits, and logits computed
    from the KV cache (two steps after a 7-token prefix) equal those of the full sequence."""
    long, short = tokens(1, 9, seed=4), tokens(1, 6, seed=5)
    ids = torch.zeros(2, 9, dtype=torch.long)
    ids[0], ids[1, 3:] = long[0], short[0]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    batched = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(batched[0], model(long).logits[0], rtol=0, atol=atol)
    torch.testing.assert_close(batched[1, 3:], model(short).logits[0], rtol=0, atol=atol)
    ids = tokens(2, 10)
    full = model(ids).logits
    prefix = model(ids[:, :7], use_cache=True)
    step = model(ids[:, 7:9], past_key_values=prefix.past_key_values, use_cache=True)
    torch.testing.assert_close(prefix.logits, full[:, :7], rtol=0, atol=atol)
    torch.testing.assert_close(step.logits, full[:, 7:9], rtol=0, atol=atol)


def perturb_scorers(model, std: float = 0.3, seed: int = 0) -> None:
    """Move every new parameter away from its init, so the scorer's nonlinear path is live."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in hf_neural_attn.scorer_parameters(model).values():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def logits(model, inputs: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    return model(**inputs, **kwargs).logits


# --- Tiny encoders (BERT, RoBERTa) -----------------------------------------------------------------------------

BERT_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    pad_token_id=1,
)


def tiny_bert() -> BertForMaskedLM:
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(**BERT_COMMON)).eval()


# --- Scorers on their own, in float64 ------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, D = 6, 2, 1, 4
F64 = torch.float64

# The activations the literal references write out, by the name the scorer configs take.
ACTIVATIONS = {"gelu": F.gelu, "tanh": torch.tanh, "relu": F.relu}


def geometry(**overrides) -> AttentionGeometry:
    values = dict(
        hidden_size=HIDDEN,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=D,
        query_bias=True,
        query_weight_std=0.5,
        dtype=F64,
        device=torch.device("cpu"),
    )
    values.update(overrides)
    return AttentionGeometry(**values)


def randomise(module, seed=0, std=0.7) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=F64) * std)


def rope_vector(vector, position, base=10000.0):
    """RoPE of one D-vector at one position, rotate-half convention (as Llama), written out."""
    half = vector.shape[-1] // 2
    out = torch.empty_like(vector)
    for m in range(half):
        angle = position * base ** (-2 * m / vector.shape[-1])
        x1, x2 = vector[m], vector[m + half]
        out[m] = x1 * math.cos(angle) - x2 * math.sin(angle)
        out[m + half] = x2 * math.cos(angle) + x1 * math.sin(angle)
    return out


def rope_rows(x, positions):
    """The library-side rotation: (batch, n, seq, D) rotated at ``positions`` (seq,), vectorised."""
    half = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=F64) * 2 / x.shape[-1])
    angles = positions.to(F64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated_half * sin


def qana_case(batch: int = 2, q_len: int = 3, k_len: int = 5):
    """Hidden states (batch, q_len, HIDDEN), the model's own query projection W_s (HEADS * D, HIDDEN) and b_s,
    keys (batch, HEADS, k_len, D), and the query and key positions (float64, from the global RNG)."""
    hidden = torch.randn(batch, q_len, HIDDEN, dtype=F64)
    w_s, b_s = torch.randn(HEADS * D, HIDDEN, dtype=F64), torch.randn(HEADS * D, dtype=F64)
    keys = torch.randn(batch, HEADS, k_len, D, dtype=F64)
    return hidden, w_s, b_s, keys, torch.arange(2, 2 + q_len), torch.arange(k_len)


class AttentionUnderTest(nn.Module):
    """Hidden states and q, k, v in, attention output out: the whole scorer path, as a module."""

    def __init__(self, scorer, mask, positions):
        super().__init__()
        self.scorer, self.mask, self.positions = scorer, mask, positions

    def forward(self, hidden, query, key, value):
        extras = self.scorer.query_extras(hidden, lambda x: rope_rows(x, self.positions))
        return scored_attention(self.scorer, query, key, value, self.mask, scaling=D**-0.5, extras=extras)[0]


def causal_gradcheck(scorer, seq: int, seed: int = 0) -> bool:
    """float64 gradcheck of the whole scorer path under a causal mask, with respect to the hidden states,
    q, k, v and every scorer parameter."""
    mask = torch.zeros(1, 1, seq, seq, dtype=F64)
    mask[..., ~torch.ones(seq, seq, dtype=torch.bool).tril()] = torch.finfo(F64).min
    module = AttentionUnderTest(scorer, mask, torch.arange(seq))
    names = [name for name, _ in module.named_parameters()]

    def attention(hidden, query, key, value, *parameters):
        return functional_call(module, dict(zip(names, parameters)), (hidden, query, key, value))

    generator = torch.Generator().manual_seed(seed)
    inputs = (
        torch.randn(1, seq, HIDDEN, dtype=F64, generator=generator).requires_grad_(),
        *(torch.randn(1, HEADS, seq, D, dtype=F64, generator=generator).requires_grad_() for _ in range(3)),
        *(p.detach().clone().requires_grad_() for p in module.parameters()),
    )
    return torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-7)


# --- The table of scorer cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScorerCase:
    """One way of patching a model, and what docs/scorers.md says it should do. A new scorer (or a new mode of
    one) is one row of SCORER_CASES; tests/test_scorer_contracts.py then runs every common contract on it."""

    name: str
    options: dict = field(default_factory=dict)
    preserving: bool = True  # outputs equal the unpatched model's at init
    # Parameter names (last dotted component before .weight/.bias, e.g. "gate", "query_down") whose first
    # gradient is zero by construction and that move from the second step (docs/scorers.md, "Our init").
    waits: tuple[str, ...] = ()
    parameters: bool = True  # the scorer adds parameters to the model
    chunked: bool = True  # impl="chunked" applies
    families: tuple[str, ...] = ("llama", "gpt2", "vit")  # FACTORIES keys it can patch

    @property
    def id(self) -> str:
        return "-".join([self.name, *(f"{key}={value}" for key, value in self.options.items())])

    @property
    def family(self) -> str:
        """The one family the costlier contracts (backward, chunked, checkpoint) run on."""
        return "gpt2" if "gpt2" in self.families else self.families[0]


SCORER_CASES = [
    ScorerCase("qana", {}, waits=("gate",)),
    ScorerCase("neural", {}, waits=("gate",)),
    ScorerCase("neural", {"proj_dim": 2}, waits=("gate", "query_down", "key_down")),
    ScorerCase("neural", {"mode": "replace"}, preserving=False),
    ScorerCase("additive", {}, waits=("gate",)),
    ScorerCase("additive", {"mode": "replace"}, preserving=False),
    ScorerCase("general", {}),
    # No parameters and no softmax: for training from scratch. NSEA mixes every query into each key's weight,
    # so it refuses causal models.
    ScorerCase("nsea", {"mode": "replace"}, preserving=False, parameters=False, chunked=False, families=("vit",)),
    ScorerCase("hea", {"mode": "replace"}, preserving=False, parameters=False, chunked=False),
]


def scorer_cases(with_family: bool = False, **where):
    """pytest params of SCORER_CASES rows whose attributes equal ``where``; with_family: one param per (row,
    family) the row can patch."""
    rows = [case for case in SCORER_CASES if all(getattr(case, key) == value for key, value in where.items())]
    if not with_family:
        return [pytest.param(case, id=case.id) for case in rows]
    return [pytest.param(case, family, id=f"{case.id}-{family}") for case in rows for family in case.families]


def negligible(grad: torch.Tensor, reference: torch.Tensor) -> bool:
    """Zero up to fp32 rounding, relative to a gradient that is really there."""
    return bool(grad.abs().max() <= 1e-4 * reference.abs().max())


def padded_inputs(kind: str) -> dict[str, torch.Tensor]:
    """Two examples as their processors make them: ``"image"`` pixels, or token ids whose second row is
    padded on the ``"left-padded"`` (decoders) or ``"right-padded"`` (BERT-style encoders) side."""
    generator = torch.Generator().manual_seed(1)
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=generator)}
    ids = torch.randint(3, VOCAB, (2, 10), generator=generator)
    mask = torch.ones(2, 10, dtype=torch.long)
    padding = slice(0, 4) if kind == "left-padded" else slice(6, 10)
    ids[1, padding], mask[1, padding] = 1, 0
    return {"input_ids": ids, "attention_mask": mask}
