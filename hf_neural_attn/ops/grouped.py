"""Grouped-query attention without repeating keys: each query head reads the key/value head of its group.

Queries have ``heads`` heads, keys and values ``kv_heads`` (dividing ``heads``); query head ``n`` belongs to
kv head ``n // (heads // kv_heads)``, transformers' ``repeat_kv`` order. Instead of copying every key and value
``groups`` times, the group's query heads are stacked along the query axis, so one matmul per kv head serves
them all.
"""

from __future__ import annotations

import torch


def group_heads(tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, ...) -> (batch, kv_heads, groups, ...), a view."""
    return tensor.unflatten(1, (kv_heads, tensor.shape[1] // kv_heads))


def grouped_matmul(per_head: torch.Tensor, per_kv_head: torch.Tensor) -> torch.Tensor:
    """(batch, heads, m, x) @ (batch, kv_heads, x, y) -> (batch, heads, m, y), each head's rows times its kv
    head's matrix; e.g. ``grouped_matmul(query, key.transpose(-1, -2))`` is every query head's q·k and
    ``grouped_matmul(probs, value)`` the attention output."""
    batch, heads, rows = per_head.shape[:3]
    kv_heads = per_kv_head.shape[1]
    if heads == kv_heads:
        return per_head @ per_kv_head
    stacked = per_head.reshape(batch, kv_heads, -1, per_head.shape[-1]) @ per_kv_head
    return stacked.view(batch, heads, rows, stacked.shape[-1])


def grouped_transposed_matmul(first: torch.Tensor, second: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Σ over each group's heads (and the rows m) of firstᵀ @ second: (batch, heads, m, x) and
    (batch, heads, m, y) -> (batch, kv_heads, x, y); e.g. the gradient of the values from the probabilities and
    the output's gradient."""
    batch, heads = first.shape[:2]
    if heads == kv_heads:
        return first.transpose(-1, -2) @ second
    first = first.reshape(batch, kv_heads, -1, first.shape[-1])
    return first.transpose(-1, -2) @ second.reshape(batch, kv_heads, -1, second.shape[-1])


def repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, kv_heads, seq, dim) -> (batch, kv_heads * groups, seq, dim), each kv head repeated for its
    group of query heads (grouped-query attention), for the scorers that are not softmax attention (NSEA, HEA)."""
    if groups == 1:
        return states
    return states.repeat_interleave(groups, dim=1)
