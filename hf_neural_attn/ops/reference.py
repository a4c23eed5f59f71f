"""Reference attention: materialise the full (batch, heads, q_len, kv_len) score matrix.

Simple and exact, the oracle every faster path is tested against. Memory grows as q_len * kv_len * h
per head (the scorers' MLP activations are kept for backward), so it suits tests and short sequences.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .dropout import AttentionDropout
from .grouped import grouped_matmul
from .masks import apply_mask, block_mask


def reference_attention(
    scorer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    dropout: AttentionDropout | None,
    extras: Any,
    is_causal: bool = False,
    rows_seeing_all: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scorer.scores(q, k) + mask) @ v.

    Args:
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing heads; not repeated for
            grouped-query attention (each query head reads its group's kv head, :mod:`.grouped`).
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            (batch, heads, q_len, kv_len), see :mod:`.masks`.
        is_causal: with ``attention_mask`` None, the call is causal (queries aligned to the end of the keys)
            and the mask is built here; with a mask, that mask says everything.
        dropout: the call's attention dropout (:class:`.dropout.AttentionDropout`), or None.
        rows_seeing_all: see :func:`.masks.query_blocks`; this path scores every key of every row anyway.

    Returns:
        output (batch, heads, q_len, head_dim) and probabilities (batch, heads, q_len, kv_len), after dropout as
        transformers' eager attention returns them.
    """
    q_len, kv_len = query.shape[-2], key.shape[-2]
    scores = scorer.scores(query, key, extras, scaling)
    # Softmax in at least fp32 (half-precision scores are upcast, as transformers' eager path does;
    # fp64 stays fp64, so this path can serve as a float64 oracle).
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    mask = block_mask(attention_mask, is_causal, 0, q_len, kv_len, q_len, kv_len, query.device)
    scores = apply_mask(scores.to(softmax_dtype), mask)
    probs = F.softmax(scores, dim=-1).to(value.dtype)
    if dropout is not None:
        probs = dropout.kept(probs, dropout.streams(probs.shape[0], probs.shape[1], probs.device), 0)
    return grouped_matmul(probs, value), probs
