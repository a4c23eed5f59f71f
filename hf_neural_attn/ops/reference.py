"""Reference attention: materialise the full (batch, heads, q_len, kv_len) score matrix.

Simple and exact, the oracle every faster path is tested against. Memory grows as q_len * kv_len * h
per head (the scorers' MLP activations are kept for backward), so it suits tests and short sequences.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def reference_attention(
    scorer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    dropout: float,
    training: bool,
    extras: Any,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scorer.scores(q, k) + mask) @ v.

    Args:
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, heads, kv_len, head_dim), already repeated for grouped-query attention.
        attention_mask: additive float (batch or 1, 1, q_len, kv_len) with large negatives where
            attention is not allowed, or None for full attention. It carries the causal structure too, so
            ``is_causal`` (a hint other paths use to skip work) is not needed here.

    Returns:
        output (batch, heads, q_len, head_dim) and probabilities (batch, heads, q_len, kv_len).
    """
    scores = scorer.scores(query, key, extras, scaling)
    # Softmax in at least fp32 (half-precision scores are upcast, as transformers' eager path does;
    # fp64 stays fp64, so this path can serve as a float64 oracle).
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(softmax_dtype)
    if attention_mask is not None:
        # Clamped so a row masked with -inf everywhere gives uniform weights, not NaN, like the finite
        # masks transformers builds.
        scores = (scores + attention_mask).clamp(min=torch.finfo(softmax_dtype).min)
    probs = F.softmax(scores, dim=-1).to(value.dtype)
    probs = F.dropout(probs, p=dropout, training=training)
    return torch.matmul(probs, value), probs
