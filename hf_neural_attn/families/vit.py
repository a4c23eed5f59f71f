"""ViT: q_proj/k_proj/v_proj, learned absolute positions (no RoPE), bidirectional attention."""

from __future__ import annotations

from transformers.models.vit.modeling_vit import ViTAttention

from .base import ModelFamily, linear_query_geometry


class ViTFamily(ModelFamily):
    name = "vit"
    attention_classes = (ViTAttention,)
    attention_dropout_field = "attention_probs_dropout_prob"

    def geometry(self, module):
        heads = module.num_attention_heads
        return linear_query_geometry(module.q_proj, heads, heads, module.head_dim, module=module)
