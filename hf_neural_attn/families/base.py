"""How a model family hands its attention over to a scorer.

A family adapter answers four questions about one attention module: is it a self-attention module we
can patch, what geometry do its queries and keys have, where are the hidden states in its forward call,
and how does it rotate queries (RoPE), if it does. Everything else (q, k, v projections, the KV cache,
masks) stays the model's own: the patch only swaps the attention function through transformers'
``AttentionInterface``, and every supported attention forward passes its ``**kwargs`` on to it.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..scorers import AttentionGeometry


class ModelFamily:
    """Base adapter. Subclasses name ``attention_classes`` and implement :meth:`geometry`."""

    name: ClassVar[str]
    attention_classes: ClassVar[tuple[type[nn.Module], ...]]

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is a self-attention module of this family (the ones that get a scorer)."""
        return isinstance(module, self.attention_classes)

    def reads_shared_config(self, module: nn.Module) -> bool:
        """Whether ``module`` picks its attention function from the model's config. Those a patch does not
        score (cross-attention, say) must still be routed to the model's original implementation."""
        return isinstance(module, self.attention_classes)

    def original_attention(
        self, module: nn.Module, implementation: str, query, key, value, attention_mask, scaling, dropout, **kwargs
    ):
        """Run the model's own attention (``"eager"`` or ``"sdpa"``) for a module the patch does not score.

        Attention maps can only come from the eager path, so it also serves ``output_attentions`` calls.
        """
        if implementation == "eager" or kwargs.get("output_attentions"):
            eager = sys.modules[type(module).__module__].eager_attention_forward
            return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if attention_mask is not None and attention_mask.dtype not in (torch.bool, query.dtype):
            # SDPA wants the mask in the query dtype (autocast); clamp so the large negative stays finite.
            attention_mask = attention_mask.clamp(min=torch.finfo(query.dtype).min).to(query.dtype)
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    def geometry(self, module: nn.Module) -> AttentionGeometry:
        raise NotImplementedError

    def hidden_states(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        """The (batch, seq, hidden) input of the attention module's forward call."""
        return call_argument(module, args, kwargs, "hidden_states")

    def rotary(self, module: nn.Module, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A function applying this call's RoPE at the query positions to a (batch, n, seq, head_dim)
        tensor, or None for models without rotary embeddings."""
        return None


def call_argument(module: nn.Module, args: tuple, kwargs: dict, name: str):
    """The value of parameter ``name`` in a call ``module(*args, **kwargs)``, however it was passed."""
    if name in kwargs:
        return kwargs[name]
    position = _forward_parameters(type(module)).index(name)
    return args[position] if position < len(args) else None


@functools.cache
def _forward_parameters(module_class: type[nn.Module]) -> list[str]:
    # Looked up on every forward of every patched layer, so computed once per class.
    return [name for name in inspect.signature(module_class.forward).parameters if name != "self"]


def linear_query_geometry(query_proj: nn.Linear, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionGeometry:
    """Geometry of an attention module whose queries come from a separate ``nn.Linear``."""
    weight = query_proj.weight
    return AttentionGeometry(
        hidden_size=query_proj.in_features,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        query_bias=query_proj.bias is not None,
        query_weight_std=float(weight.detach().float().std()),
        dtype=weight.dtype,
        device=weight.device,
    )
