"""Llama (and the models that share its attention layout): q_proj/k_proj/v_proj, RoPE from the
decoder's ``position_embeddings``, grouped-query attention."""

from __future__ import annotations

from transformers.models.llama.modeling_llama import LlamaAttention

from .base import ModelFamily, call_argument, linear_query_geometry, rotation


class LlamaFamily(ModelFamily):
    name = "llama"
    attention_classes = (LlamaAttention,)

    def geometry(self, module):
        config = module.config
        return linear_query_geometry(
            module.q_proj, config.num_attention_heads, config.num_key_value_heads, module.head_dim, module=module
        )

    def rotary(self, module, args, kwargs):
        cos, sin = call_argument(module, args, kwargs, "position_embeddings")
        return rotation(module, cos, sin)
