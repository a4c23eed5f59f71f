"""Decoders whose attention has Llama's layout: ``q_proj`` / ``k_proj`` / ``v_proj``, RoPE from the decoder's
``position_embeddings`` applied by their modeling module's ``apply_rotary_pos_emb``, grouped-query attention.

The Llama adapter serves them as it is; each entry only names the family and its attention class
(:meth:`.base.ModelFamily.described`, as :mod:`.standard_decoders` names its entries). Qwen3's per-head ``q_norm``
applies to the model's own query (``s``); QANA's extra rows are not normalised. Mistral's and Qwen2's sliding
windows come with the mask transformers builds.
"""

from __future__ import annotations

from transformers.models.gemma.modeling_gemma import GemmaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from .llama import LlamaFamily

LLAMA_LIKE = [
    LlamaFamily.described("mistral", MistralAttention),
    LlamaFamily.described("qwen2", Qwen2Attention),
    LlamaFamily.described("qwen3", Qwen3Attention),
    LlamaFamily.described("gemma", GemmaAttention),
]
