"""Llama (and the models that share its attention layout): q_proj/k_proj/v_proj, RoPE from the
decoder's ``position_embeddings``, grouped-query attention.

Llama attention also runs with narrower queries and keys (:mod:`hf_neural_attn.narrow_keys`), whose RoPE tables the
patched module cuts (:meth:`~hf_neural_attn.narrow_keys.NarrowKeyLlamaAttention.rotary_tables`).
"""

from __future__ import annotations

import dataclasses

from transformers.models.llama.modeling_llama import LlamaAttention

from .base import ModelFamily, call_argument, linear_query_geometry, rotation


class LlamaFamily(ModelFamily):
    name = "llama"
    attention_classes = (LlamaAttention,)

    def geometry(self, module):
        config = module.config
        geometry = linear_query_geometry(
            module.q_proj, config.num_attention_heads, config.num_key_value_heads, module.head_dim, module=module
        )
        # Llama's RoPE turns every dimension, p with p + head_dim/2 (rotate_half).
        half = module.head_dim // 2
        return dataclasses.replace(geometry, rope_partner=tuple((p + half) % module.head_dim for p in range(2 * half)))

    def rotary(self, module, args, kwargs):
        cos, sin = call_argument(module, args, kwargs, "position_embeddings")
        # A module patched with narrow keys turns its narrower queries with tables cut to their width: it is a
        # NarrowKeyLlamaAttention (hf_neural_attn.narrow_keys, which imports the families, so is not imported here).
        rotary_tables = getattr(module, "rotary_tables", None)
        if rotary_tables is not None:
            cos, sin = rotary_tables(cos, sin)
        return rotation(module, cos, sin)
