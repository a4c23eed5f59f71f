"""How scores become attention outputs, behind one function.

Every path computes the same thing, ``softmax(scorer.scores(q, k) + mask) @ v``; they differ in memory
and speed. ``scored_attention`` picks the path named by the scorer's ``impl`` option, so a new path (a
chunked autograd function, a fused kernel) is one entry in ``IMPLEMENTATIONS``. Scorers that are not
softmax attention (``scorer.uses_softmax`` False: NSEA, HEA) compute their output themselves in
``scorer.attend``.
"""

from __future__ import annotations

from typing import Any

import torch

from .chunked import chunked_attention
from .reference import reference_attention

IMPLEMENTATIONS = {
    "reference": reference_attention,
    "chunked": chunked_attention,
}


def repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, kv_heads, seq, dim) -> (batch, kv_heads * groups, seq, dim), each kv head repeated for its
    group of query heads (grouped-query attention)."""
    if groups == 1:
        return states
    return states.repeat_interleave(groups, dim=1)


def scored_attention(
    scorer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
    extras: Any = None,
    is_causal: bool = False,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with ``scorer``'s logits.

    Args:
        query: (batch, heads, q_len, head_dim); key, value: (batch, kv_heads, kv_len, head_dim).
        attention_mask: additive float mask broadcastable to (batch, heads, q_len, kv_len), or None.
        is_causal: whether the mask is causal (lets a path skip blocks the mask hides entirely).
        need_weights: the caller wants the probabilities (``output_attentions``).

    Only the reference path materialises the probabilities, so it also serves calls that need them
    returned or need dropout applied to them, whatever ``impl`` says.

    Returns:
        output (batch, q_len, heads, head_dim), the layout transformers' attention functions return,
        and the attention probabilities (batch, heads, q_len, kv_len) when the path keeps them.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if not scorer.uses_softmax:
        # NSEA, HEA: the weights are not a softmax of logits, so none of the paths below applies.
        output, weights = scorer.attend(
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout if training else 0.0,
            is_causal=is_causal,
            need_weights=need_weights,
        )
        return output.transpose(1, 2).contiguous(), weights
    impl = scorer.config.impl
    if need_weights or (training and dropout > 0):
        impl = "reference"
    output, probs = IMPLEMENTATIONS[impl](
        scorer,
        query,
        key,
        value,
        attention_mask,
        scaling=scaling,
        dropout=dropout,
        training=training,
        extras=extras,
        is_causal=is_causal,
    )
    return output.transpose(1, 2).contiguous(), probs
