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
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scorer.scores(q, k) + mask) @ v.

    Args:
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, heads, kv_len, head_dim), already repeated for grouped-query attention.
        attention_mask: additive float (batch or 1, 1, q_len, kv_len) with large negatives where
            attention is not allowed, or None for full attention.

    Returns:
        output (batch, heads, q_len, head_dim) and probabilities (batch, heads, q_len, kv_len).
    """
    scores = scorer.scores(query, key, extras, scaling)
    if attention_mask is not None:
        scores = scores + attention_mask
    # Softmax in fp32 as transformers' eager path does, then back to the value dtype.
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    probs = F.dropout(probs, p=dropout, training=training)
    return torch.matmul(probs, value), probs
