"""BERT and RoBERTa encoders: ``query`` / ``key`` / ``value`` projections, learned absolute positions (no
RoPE), bidirectional attention over padded batches. Self-attention is patched; the cross-attention modules of
encoder-decoder setups (their own classes) keep the model's original implementation."""

from __future__ import annotations

from transformers.models.bert.modeling_bert import BertCrossAttention, BertSelfAttention
from transformers.models.roberta.modeling_roberta import RobertaCrossAttention, RobertaSelfAttention

from .base import ModelFamily, linear_query_geometry


class BertFamily(ModelFamily):
    name = "bert"
    attention_classes = (BertSelfAttention,)
    attention_dropout_field = "attention_probs_dropout_prob"
    cross_attention_classes = (BertCrossAttention,)

    def reads_shared_config(self, module):
        return isinstance(module, self.attention_classes + self.cross_attention_classes)

    def geometry(self, module):
        heads = module.num_attention_heads
        return linear_query_geometry(module.query, heads, heads, module.attention_head_size, module=module)


class RobertaFamily(BertFamily):
    name = "roberta"
    attention_classes = (RobertaSelfAttention,)
    cross_attention_classes = (RobertaCrossAttention,)
