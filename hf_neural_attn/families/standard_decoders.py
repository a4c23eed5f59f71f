"""Decoders with the standard attention plumbing that are tested by name (tests/families/test_families_generic.py).

Each entry only names the family and its attention class (:meth:`.base.ModelFamily.described`, as
:mod:`.llama_like` names its entries); :class:`.standard.StandardAttentionFamily` does the rest and its probe checks
every module before patching. What each one exercises:

* OLMo: plain layout, no biases. OLMo2: ``q_norm`` / ``k_norm`` over the whole projection (before the
  head split).
* Granite: non-standard ``scaling`` (``attention_multiplier``), which reaches the scorer as it is.
* Mixtral and Qwen3-MoE: mixture-of-experts MLPs around standard attention (Qwen3-MoE with per-head
  ``q_norm`` / ``k_norm``), Mixtral with a sliding window.
* Gemma3 (text): per-head ``q_norm`` / ``k_norm``, ``query_pre_attn_scalar`` scaling, sliding-window layers
  with their own local RoPE next to global ones.
* StableLM: partial rotary split off in the forward, optional per-head LayerNorm on q and k.
* Cohere: interleaved RoPE, optional LayerNorm over (heads, head_dim) on q and k.
* SmolLM3: NoPE layers (no RoPE on every fourth layer); QANA's extra rows follow each layer.

QANA's extra query rows are not passed through a query norm (as for Qwen3 in :mod:`.llama_like`).
"""

from __future__ import annotations

from transformers.models.cohere.modeling_cohere import CohereAttention
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.granite.modeling_granite import GraniteAttention
from transformers.models.mixtral.modeling_mixtral import MixtralAttention
from transformers.models.olmo.modeling_olmo import OlmoAttention
from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention
from transformers.models.smollm3.modeling_smollm3 import SmolLM3Attention
from transformers.models.stablelm.modeling_stablelm import StableLmAttention

from .standard import StandardAttentionFamily

STANDARD_DECODERS = [
    StandardAttentionFamily.described("olmo", OlmoAttention),
    StandardAttentionFamily.described("olmo2", Olmo2Attention),
    StandardAttentionFamily.described("granite", GraniteAttention),
    StandardAttentionFamily.described("mixtral", MixtralAttention),
    StandardAttentionFamily.described("qwen3_moe", Qwen3MoeAttention),
    StandardAttentionFamily.described("gemma3", Gemma3Attention),
    StandardAttentionFamily.described("stablelm", StableLmAttention),
    StandardAttentionFamily.described("cohere", CohereAttention),
    StandardAttentionFamily.described("smollm3", SmolLM3Attention),
]
