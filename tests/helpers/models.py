"""Tiny models built from configs (no downloads), the table of families, and the inputs the tests feed them.

FAMILY_CASES lists every model family the suite builds, as a tiny model, with its input kind and the flags that pick
each contract's families (docs/testing.md, "The tables"); ``family_cases(...)`` turns a filter into pytest params.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers as tf
from torch import nn

import hf_neural_attn

VOCAB = 64


# --- Tiny models -------------------------------------------------------------------------------------------------

# A tiny rotary decoder: 2 layers, 4 query heads sharing 2 key/value heads (grouped-query attention). Llama,
# Mistral, Qwen, Gemma and the standard decoders' configs all take these keys.
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

# A tiny encoder of the same sizes (BERT, RoBERTa), dropout off: the tests compare outputs.
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


def tiny(model_class, config_class, **defaults) -> Callable[..., nn.Module]:
    """A builder of tiny ``model_class`` models: ``build(**overrides)`` makes ``config_class(**defaults,
    **overrides)`` (``attn_implementation`` among them), draws the weights from seed 0 and returns the model in
    eval mode. Under ``with torch.device("meta")`` it builds the model on meta."""

    def build(**overrides) -> nn.Module:
        torch.manual_seed(0)
        return model_class(config_class(**{**defaults, **overrides})).eval()

    return build


tiny_llama = tiny(tf.LlamaForCausalLM, tf.LlamaConfig, **TINY_DECODER)
# GPT-2 configs default to 0.1 dropout on residuals, embeddings and attention; tests that compare train-mode runs
# need them off (the dropout test turns attention dropout back on).
tiny_gpt2 = tiny(
    tf.GPT2LMHeadModel,
    tf.GPT2Config,
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
tiny_vit = tiny(
    tf.ViTForImageClassification,
    tf.ViTConfig,
    image_size=16,
    patch_size=4,
    num_channels=3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    num_labels=3,
)
tiny_bert = tiny(tf.BertForMaskedLM, tf.BertConfig, **BERT_COMMON)

HEAD_DIM = {"head_dim": 8}  # for configs whose default head_dim is not hidden_size / heads
PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


# --- The table of families ---------------------------------------------------------------------------------------

# The kinds of input padded_inputs makes: token ids padded on the left (decoders) or the right (encoders), pixels.
LEFT_PADDED, RIGHT_PADDED, IMAGE = "left-padded", "right-padded", "image"


@dataclass(frozen=True)
class FamilyCase:
    """One model family the suite builds, as a tiny model (2 attention layers, 4 query heads), and the flags the
    tests pick their families by. A new family is one row of FAMILY_CASES."""

    name: str  # the family the patch records (a generic row's name is the model's; the record says "standard")
    build: Callable[..., nn.Module]  # build(**config overrides, attn_implementation=...): see tiny()
    inputs: str  # what padded_inputs makes for it: LEFT_PADDED, RIGHT_PADDED or IMAGE
    causal: bool
    # Which adapter of hf_neural_attn.families serves it: "llama" (Llama and the Llama-likes), "gpt2", "vit",
    # "bert" (BERT and RoBERTa) or "standard" (the probe-checked StandardAttentionFamily: Phi-3, the standard
    # decoders and the generic path).
    adapter: str
    generic: bool = False  # no entry of its own: the generic StandardAttentionFamily serves it, and warns
    core: bool = False  # every contract runs on these: all scorer cases, training, checkpoints, HF usage, paths
    # The four families transformers' common model tests were run against (docs/testing.md): their mirrors run
    # on these (meta device, eager vs SDPA base).
    mirrored: bool = False
    # One model per adapter and per kind of mask or projection the adapters handle (a sliding window through
    # the Llama adapter and through the generic path, Phi-3's fused projection): the contracts about what each
    # attention layer gets and returns (output_attentions, the layers left unscored) run on these.
    sample: bool = False

    @property
    def recorded(self) -> str:
        """The family name the patch record holds."""
        return "standard" if self.generic else self.name


def decoder(model_class, config_class, **config) -> Callable[..., nn.Module]:
    """A builder of tiny decoders of TINY_DECODER's sizes (see tiny())."""
    return tiny(model_class, config_class, **TINY_DECODER, **config)


# What each builder's config exercises. Sliding windows are shorter than the test sequences.
tiny_bert_model = tiny(tf.BertModel, tf.BertConfig, **BERT_COMMON)
tiny_roberta = tiny(tf.RobertaModel, tf.RobertaConfig, **BERT_COMMON)
# Llama's attention layout.
tiny_mistral = decoder(tf.MistralForCausalLM, tf.MistralConfig, sliding_window=6)
tiny_qwen2 = decoder(tf.Qwen2ForCausalLM, tf.Qwen2Config)
tiny_qwen3 = decoder(tf.Qwen3ForCausalLM, tf.Qwen3Config, **HEAD_DIM)  # per-head q_norm / k_norm
tiny_gemma = decoder(tf.GemmaForCausalLM, tf.GemmaConfig, **HEAD_DIM)
# The standard attention plumbing. Phi-3: a fused qkv_proj, RoPE on half of each head.
tiny_phi3 = decoder(tf.Phi3ForCausalLM, tf.Phi3Config, rope_parameters=PARTIAL_ROPE)
tiny_olmo = decoder(tf.OlmoForCausalLM, tf.OlmoConfig, clip_qkv=0.5)  # clamps q, k, v
tiny_olmo2 = decoder(tf.Olmo2ForCausalLM, tf.Olmo2Config)  # q_norm over the whole projection
tiny_granite = decoder(tf.GraniteForCausalLM, tf.GraniteConfig, attention_multiplier=0.3)  # its own scaling
tiny_mixtral = decoder(
    tf.MixtralForCausalLM, tf.MixtralConfig, sliding_window=6, num_local_experts=2, num_experts_per_tok=1
)
tiny_qwen3_moe = decoder(
    tf.Qwen3MoeForCausalLM,
    tf.Qwen3MoeConfig,
    **HEAD_DIM,
    num_experts=2,
    num_experts_per_tok=1,
    moe_intermediate_size=32,
)
# Per-head q/k norms, query_pre_attn_scalar, a sliding layer with local RoPE beside a global one.
tiny_gemma3 = decoder(
    tf.Gemma3ForCausalLM,
    tf.Gemma3TextConfig,
    **HEAD_DIM,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention"],
)
tiny_stablelm = decoder(tf.StableLmForCausalLM, tf.StableLmConfig, qk_layernorm=True)  # partial rotary 0.25
tiny_cohere = decoder(tf.CohereForCausalLM, tf.CohereConfig, use_qk_norm=True)  # interleaved RoPE
tiny_smollm3 = decoder(tf.SmolLM3ForCausalLM, tf.SmolLM3Config, no_rope_layers=[1, 0])  # layer 1 is NoPE
tiny_starcoder2 = decoder(tf.Starcoder2ForCausalLM, tf.Starcoder2Config, sliding_window=6)  # biases
tiny_glm = decoder(tf.GlmForCausalLM, tf.GlmConfig)  # partial, interleaved RoPE
tiny_gemma2_no_softcap = decoder(
    tf.Gemma2ForCausalLM, tf.Gemma2Config, **HEAD_DIM, sliding_window=6, attn_logit_softcapping=None
)

FAMILY_CASES = [
    FamilyCase("llama", tiny_llama, LEFT_PADDED, causal=True, adapter="llama", core=True, mirrored=True, sample=True),
    FamilyCase("gpt2", tiny_gpt2, LEFT_PADDED, causal=True, adapter="gpt2", core=True, mirrored=True, sample=True),
    FamilyCase("vit", tiny_vit, IMAGE, causal=False, adapter="vit", core=True, mirrored=True, sample=True),
    FamilyCase("bert", tiny_bert_model, RIGHT_PADDED, causal=False, adapter="bert", mirrored=True, sample=True),
    # BERT's adapter with RoBERTa's classes: BERT stands for both in the sample.
    FamilyCase("roberta", tiny_roberta, RIGHT_PADDED, causal=False, adapter="bert"),
    FamilyCase("mistral", tiny_mistral, LEFT_PADDED, causal=True, adapter="llama", sample=True),
    FamilyCase("qwen2", tiny_qwen2, LEFT_PADDED, causal=True, adapter="llama"),
    FamilyCase("qwen3", tiny_qwen3, LEFT_PADDED, causal=True, adapter="llama"),
    FamilyCase("gemma", tiny_gemma, LEFT_PADDED, causal=True, adapter="llama"),
    FamilyCase("phi3", tiny_phi3, LEFT_PADDED, causal=True, adapter="standard", sample=True),
    FamilyCase("olmo", tiny_olmo, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("olmo2", tiny_olmo2, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("granite", tiny_granite, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("mixtral", tiny_mixtral, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("qwen3_moe", tiny_qwen3_moe, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("gemma3", tiny_gemma3, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("stablelm", tiny_stablelm, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("cohere", tiny_cohere, LEFT_PADDED, causal=True, adapter="standard"),
    FamilyCase("smollm3", tiny_smollm3, LEFT_PADDED, causal=True, adapter="standard"),
    # No entry on purpose: the generic fallback serves these, so it stays under test.
    FamilyCase("starcoder2", tiny_starcoder2, LEFT_PADDED, causal=True, adapter="standard", generic=True, sample=True),
    FamilyCase("glm", tiny_glm, LEFT_PADDED, causal=True, adapter="standard", generic=True),
    FamilyCase("gemma2_no_softcap", tiny_gemma2_no_softcap, LEFT_PADDED, causal=True, adapter="standard", generic=True),
]
_FAMILY_CASE = {case.name: case for case in FAMILY_CASES}


def family_case(name: str) -> FamilyCase:
    """The row of FAMILY_CASES named ``name``."""
    return _FAMILY_CASE[name]


def tiny_model(family: str, **overrides) -> nn.Module:
    """A tiny model of ``family`` (a FAMILY_CASES name), config ``overrides`` applied."""
    return family_case(family).build(**overrides)


def rows_where(table: list, *conditions: Callable[[object], bool], **where) -> list:
    """The rows of ``table`` whose attributes equal ``where`` (e.g. ``core=True``) and that meet ``conditions``."""
    return [
        row
        for row in table
        if all(getattr(row, key) == value for key, value in where.items()) and all(meets(row) for meets in conditions)
    ]


def family_cases(*conditions: Callable[[FamilyCase], bool], **where) -> list:
    """pytest params (id: the name) of the FAMILY_CASES rows picked as ``rows_where`` picks them."""
    return [pytest.param(case, id=case.name) for case in rows_where(FAMILY_CASES, *conditions, **where)]


def family_names(*conditions: Callable[[FamilyCase], bool], **where) -> list[str]:
    """The names of the FAMILY_CASES rows picked as ``rows_where`` picks them."""
    return [case.name for case in rows_where(FAMILY_CASES, *conditions, **where)]


CORE_FAMILIES = tuple(family_names(core=True))


def model_inputs(family: str, batch: int = 2, seq: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """Unpadded inputs for a model of ``family``: (batch, 3, 16, 16) pixels, or (batch, seq) token ids."""
    generator = torch.Generator().manual_seed(seed)
    if family_case(family).inputs == IMAGE:
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=generator)}
    return {"input_ids": torch.randint(2, VOCAB, (batch, seq), generator=generator)}


def padded_inputs(kind: str) -> dict[str, torch.Tensor]:
    """Two examples as their processors make them (``kind``: a FamilyCase's ``inputs``): IMAGE pixels, or (2, 10)
    token ids whose second row is padded on the left (LEFT_PADDED, decoders) or the right (RIGHT_PADDED, BERT-style
    encoders), with their attention mask."""
    generator = torch.Generator().manual_seed(1)
    if kind == IMAGE:
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=generator)}
    ids = torch.randint(3, VOCAB, (2, 10), generator=generator)
    mask = torch.ones(2, 10, dtype=torch.long)
    padding = slice(0, 4) if kind == LEFT_PADDED else slice(6, 10)
    ids[1, padding], mask[1, padding] = 1, 0
    return {"input_ids": ids, "attention_mask": mask}


def tokens(batch: int, seq: int, seed: int = 3) -> torch.Tensor:
    """(batch, seq) random token ids of the tiny vocabulary (0 and 1 left out: pad and special ids)."""
    return torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def training_labels(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Labels for the model's own loss: the input ids (language modelling), or for images the classes 0, 1,
    2, ... of the batch's examples (modulo the number of labels)."""
    if "pixel_values" in inputs:
        return torch.arange(inputs["pixel_values"].shape[0]) % model.config.num_labels
    return inputs["input_ids"]


def training_loss(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs, labels=training_labels(model, inputs)).loss


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


def save_live_patched(model, folder: Path, scorer: str, **options) -> Path:
    """Patch ``model`` with ``scorer``, move the scorers off their function-preserving init (so their terms and
    gradients are live) and save it to ``folder``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the from-scratch options (key_dim, mode="replace") warn
        hf_neural_attn.patch_model(model, scorer, **options)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, parameter in sorted(hf_neural_attn.scorer_parameters(model).items()):
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(folder)
    return Path(folder)


def logits(model, inputs: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    return model(**inputs, **kwargs).logits


def packed_attention_call(model, query_lengths: list[int], key_lengths: list[int], seed: int = 0):
    """A packed call of layer 0's attention of a patched Llama-like ``model``, as continuous batching makes it: per
    request its queries (the last of its keys) and its keys, end to end in one row, no mask. Returns the attention
    module and the call's (query, key, value, keyword arguments): query (1, heads, Σ queries, head_dim), key and value
    (1, kv_heads, Σ keys, head_dim), the cumulative lengths and, for a scorer that reads hidden states, its per-query
    inputs."""
    from hf_neural_attn.record import EXTRAS_KWARG, SCORER_ATTR

    module = model.model.layers[0].self_attn
    scorer = getattr(module, SCORER_ATTR)
    heads, kv_heads, head_dim = model.config.num_attention_heads, model.config.num_key_value_heads, module.head_dim
    cu_q = torch.tensor([0, *torch.tensor(query_lengths).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()])
    queries, keys = int(cu_q[-1]), int(cu_k[-1])
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, queries, head_dim, generator=generator)
    key, value = torch.randn(2, 1, kv_heads, keys, head_dim, generator=generator).unbind(0)
    kwargs = {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k}
    if scorer.needs_hidden_states:
        hidden = torch.randn(1, queries, model.config.hidden_size, generator=generator)
        kwargs[EXTRAS_KWARG] = scorer.query_extras(hidden, None)
    return module, (query, key, value, kwargs)
