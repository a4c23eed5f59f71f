"""Llama (and the models that share its attention layout): q_proj/k_proj/v_proj, RoPE from the
decoder's ``position_embeddings``, grouped-query attention.

Llama attention also runs with narrower queries and keys (QANA's ``key_dim``, a from-scratch option):
:class:`NarrowKeyLlamaAttention` is its forward with the query and key width apart from the value width.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from ..integrations.internals import attn_implementation_of, mark_initialized
from .base import ModelFamily, call_argument, linear_query_geometry, query_weight_std, rotation

KEY_DIM_ATTR = "key_dim"  # on a NarrowKeyLlamaAttention: the width of its queries and keys


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
        if isinstance(module, NarrowKeyLlamaAttention):
            cos, sin = narrow_rotary(cos, sin, module.key_dim)
        return rotation(module, cos, sin)

    def narrow_key_projections(self, module, key_dim):
        if type(module) is not LlamaAttention:
            return super().narrow_key_projections(module, key_dim)
        config = module.config
        projections = {}
        for name, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
            old = getattr(module, name)
            new = nn.Linear(
                old.in_features,
                heads * key_dim,
                bias=old.bias is not None,
                dtype=old.weight.dtype,
                device=old.weight.device,
            )
            if not new.weight.is_meta:
                # A fresh projection at the scale of the one it replaces (the model's init scale when it was
                # trained from scratch); flagged so that transformers' init_weights leaves it alone.
                with torch.no_grad():
                    new.weight.normal_(0.0, query_weight_std(module, old.weight))
                    if new.bias is not None:
                        new.bias.zero_()
                for parameter in new.parameters():
                    mark_initialized(parameter)
            projections[name] = new
        return projections

    def use_narrow_keys(self, module, key_dim, projections):
        for name, projection in projections.items():
            setattr(module, name, projection)
        module.__class__ = NarrowKeyLlamaAttention
        setattr(module, KEY_DIM_ATTR, key_dim)


def narrow_rotary(cos: torch.Tensor, sin: torch.Tensor, key_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE tables (..., head_dim) cut to ``key_dim`` dimensions: every (head_dim / key_dim)-th of its
    frequencies (the nearest below where that is not an integer), in Llama's layout ``[f, f]``.

    Where key_dim divides head_dim this is exactly RoPE at width key_dim with the model's base (and scaling);
    otherwise the frequencies are still the model's, spread over its whole range. Any set of frequencies keeps the
    dot product a function of j - i, which is all the scores need.
    """
    half, narrow = cos.shape[-1] // 2, key_dim // 2
    index = torch.div(torch.arange(narrow, device=cos.device) * half, narrow, rounding_mode="floor")
    cos, sin = cos[..., index], sin[..., index]
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class NarrowKeyLlamaAttention(LlamaAttention):
    """Llama attention whose queries and keys are ``key_dim`` wide and values ``head_dim`` wide.

    The class a Llama attention module patched with QANA's ``key_dim`` takes (its q_proj and k_proj are then
    ``key_dim`` per head). The forward is Llama's with the two widths apart: keys go to the KV cache at
    ``key_dim``, RoPE turns them with :func:`narrow_rotary`, and the dot product is scaled by ``key_dim ** -0.5``.
    """

    key_dim: int

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None, **kwargs
    ):
        # transformers 5.24 renamed the layer's ``past_key_values`` to ``cache``; earlier releases pass the former.
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        query_states = self.q_proj(hidden_states).view(*input_shape, -1, self.key_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.key_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)

        cos, sin = narrow_rotary(*position_embeddings, self.key_dim)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            # A paged cache (continuous batching: its packed calls carry cu_seq_lens_k) holds keys at the model's
            # head_dim, so the narrow keys go in zero-padded and come back cut; other caches take any width.
            paged = kwargs.get("cu_seq_lens_k") is not None
            if paged:
                key_states = F.pad(key_states, (0, self.head_dim - self.key_dim))
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
            if paged:
                key_states = key_states[..., : self.key_dim]

        # A patched model runs attn_implementation "hf_neural_attn": this is its scoring path.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            attn_implementation_of(self.config), eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.key_dim**-0.5,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights
