"""GPT-2: fused c_attn (Conv1D, weight (hidden, 3*hidden); a bitsandbytes Linear (3*hidden, hidden) when quantized),
learned absolute positions (no RoPE).
Only self-attention is patched; cross-attention modules keep their original scoring."""

from __future__ import annotations

from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.pytorch_utils import Conv1D

from ..compat.internals import gpt2_reordered_attention
from ..placement.quantized import dense_weight
from ..scorers import AttentionGeometry
from .base import ModelFamily, query_weight_std


class GPT2Family(ModelFamily):
    name = "gpt2"
    attention_classes = (GPT2Attention,)
    attention_dropout_field = "attn_pdrop"

    def matches(self, module):
        return super().matches(module) and not module.is_cross_attention

    def original_attention(self, module, implementation, query, key, value, attention_mask, scaling, dropout, **kwargs):
        # GPT-2's eager path has a variant of its own: q.k in fp32 with the scale folded in.
        if implementation == "eager" and module.reorder_and_upcast_attn:
            return gpt2_reordered_attention(module)(query, key, value, attention_mask)
        return super().original_attention(
            module, implementation, query, key, value, attention_mask, scaling, dropout, **kwargs
        )

    def geometry(self, module):
        # Conv1D stores (in, out): the query is the first embed_dim output columns. bitsandbytes replaces c_attn by its
        # own Linear, (out, in): the first embed_dim rows.
        if isinstance(module.c_attn, Conv1D):
            query_weight = module.c_attn.weight[:, : module.embed_dim]
        else:
            query_weight = dense_weight(module.c_attn)[: module.embed_dim]
        return AttentionGeometry(
            hidden_size=module.embed_dim,
            num_heads=module.num_heads,
            num_kv_heads=module.num_heads,
            head_dim=module.head_dim,
            query_bias=True,
            query_weight_std=query_weight_std(module, query_weight),
            dtype=query_weight.dtype,
            device=query_weight.device,
        )
