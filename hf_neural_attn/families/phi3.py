"""Phi-3: one fused ``qkv_proj`` (queries are its first ``num_attention_heads * head_dim`` rows, then keys,
then values), RoPE from the decoder's ``position_embeddings``, possibly partial (``partial_rotary_factor`` in
``rope_parameters``: Phi-3's ``apply_rotary_pos_emb`` turns the first ``cos.shape[-1]`` dimensions and passes
the rest through). Otherwise the standard plumbing, checked by the probe of :mod:`.standard`."""

from __future__ import annotations

from transformers.models.phi3.modeling_phi3 import Phi3Attention

from .standard import StandardAttentionFamily


class Phi3Family(StandardAttentionFamily):
    name = "phi3"
    attention_classes = (Phi3Attention,)

    def query_projection(self, module):
        return module.qkv_proj, module.config.num_attention_heads * module.head_dim
