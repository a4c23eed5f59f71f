"""Context parallelism's compute: this process's slice of the queries scored against every process's keys.

torch's ``context_parallel`` (what accelerate's ``cp_size`` runs) shards the sequence over the processes and swaps
``scaled_dot_product_attention`` for a ring version; the scorers never call SDPA, so each process would score its
queries against its own keys only. :func:`attention_across_ranks` gathers every process's keys and values (with
their gradients) and scores this process's queries against all of them, causal under torch's load-balanced
(head-tail) split or the plain one, through the scorer's own attention (``attend``). Whether a block is open, and
what a patched model refuses under one, is ``hf_neural_attn.parallel.context``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..compat.tensors import is_dtensor

CONTEXT_PARALLEL_HELP = 'docs/api.md ("Tensor, context and sequence parallelism")'


@dataclasses.dataclass(frozen=True)
class ContextShards:
    """torch's context parallelism as one call sees it: the ``mesh`` the sequence is split over (this process's
    place in it), and whether the split is torch's load-balanced one (``load_balanced``: the sequence cut into
    ``2 * size`` chunks, process ``r`` holding chunks ``r`` and ``2 * size - 1 - r``) or contiguous."""

    mesh: Any
    load_balanced: bool

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()


def attention_across_ranks(
    shards: ContextShards,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    extras: Any,
    *,
    is_causal: bool,
    need_weights: bool,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, int], torch.Tensor],
) -> torch.Tensor:
    """This process's queries scored against the keys of every process: the full sequence's attention output for
    them, with gradients to every process's keys and values.

    Args:
        query: (batch, heads, local_len, head_dim), this process's slice of the sequence; key, value: (batch,
            kv_heads, local_len, head_dim), likewise.
        attention_mask: the call's mask, which must say no more than causal (or, for a module that is not causal,
            nothing): torch's context parallelism has no padding or window masks.
        extras: the scorer's per-query inputs for these queries (``query_block`` gives a slice), or None.
        attend: ``attend(query_rows, keys, values, extras_rows, first_position)`` scores a block of queries, whose
            first sits at ``first_position`` of the sequence, against the keys given, causal aligned to the end of
            the keys when the module is causal, and returns (batch, rows, heads, head_dim).

    Returns:
        (batch, local_len, heads, head_dim).

    Raises:
        ValueError: what cannot be made right (named): a padding or window mask, a KV cache, DTensor inputs
            (torch's module-wrapper form of context parallelism), the attention probabilities.
    """
    group = shards.mesh.get_group()
    _check_context_call(query, key, attention_mask, is_causal, need_weights, group)
    keys = _GatherSequence.apply(key, group, shards.size, shards.rank)
    values = _GatherSequence.apply(value, group, shards.size, shards.rank)
    local_len = query.shape[-2]
    if shards.load_balanced:
        # Process r holds chunks r and 2W-1-r: the chunks of the sequence in order, then each of ours with its place.
        chunk = local_len // 2
        size, rank = shards.size, shards.rank
        parts = [
            (keys[c], values[c], 0) if c < size else (keys[2 * size - 1 - c], values[2 * size - 1 - c], chunk)
            for c in range(2 * size)
        ]
        keys = torch.cat([k[..., start : start + chunk, :] for k, _, start in parts], dim=-2)
        values = torch.cat([v[..., start : start + chunk, :] for _, v, start in parts], dim=-2)
        blocks = [(0, chunk, rank * chunk), (chunk, 2 * chunk, (2 * size - 1 - rank) * chunk)]
    else:
        keys, values = torch.cat(keys, dim=-2), torch.cat(values, dim=-2)
        blocks = [(0, local_len, shards.rank * local_len)]
    outputs = []
    for start, end, position in blocks:
        # A causal block sees the keys up to its own last position; a bidirectional one every key.
        seen = position + (end - start) if is_causal else keys.shape[-2]
        block_extras = extras.query_block(start, end) if extras is not None else None
        outputs.append(attend(query[:, :, start:end], keys[:, :, :seen], values[:, :, :seen], block_extras, position))
    return torch.cat(outputs, dim=1)


def _check_context_call(query, key, attention_mask, is_causal: bool, need_weights: bool, group) -> None:
    if is_dtensor(query) or is_dtensor(key):
        raise ValueError(
            "hf_neural_attn got DTensor queries or keys: torch's module-wrapper form of context parallelism, which it "
            "does not support. Use torch's context_parallel context manager (what accelerate's cp_size runs) "
            f"({CONTEXT_PARALLEL_HELP})."
        )
    if need_weights:
        raise ValueError(
            "hf_neural_attn does not return attention probabilities under context parallelism (each process holds "
            "a slice of the rows). Ask for them without context parallelism."
        )
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if q_len != kv_len:
        raise ValueError(
            f"hf_neural_attn under context parallelism scores a sequence's own slice ({q_len} queries, {kv_len} keys "
            "here: a KV cache?). Generate without context parallelism."
        )
    # Every process must refuse together: one whose slice has no padding would otherwise wait in the gather below
    # for one that refused. (The other refusals above depend on the call's shapes and flags, the same everywhere.)
    says_more = torch.tensor([0 if _plain_mask(attention_mask, q_len, kv_len, is_causal) else 1])
    torch.distributed.all_reduce(says_more, group=group)
    if says_more.item():
        raise ValueError(
            "hf_neural_attn under context parallelism scores full causal (or, for encoders, full) attention only: "
            "this call's mask says more (padding, a sliding window or packed sequences), which torch's context "
            "parallelism cannot split. Pass no attention_mask (accelerate's cp_size removes it), or run without "
            f"context parallelism ({CONTEXT_PARALLEL_HELP})."
        )


def _plain_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, is_causal: bool) -> bool:
    """Whether a slice's mask says no more than causal (or, not causal, nothing): what the scorers can split."""
    if attention_mask is None:
        return True
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    expected = torch.ones(q_len, kv_len, dtype=torch.bool, device=allowed.device)
    return bool((allowed == (expected.tril() if is_causal else expected)).all())


class _GatherSequence(torch.autograd.Function):
    """Every process's slice of a (batch, heads, local_len, dim) tensor, as a tuple in process order; the backward
    sums each slice's gradient over the processes (whose queries read it) and keeps this process's."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, size: int, rank: int):
        ctx.group, ctx.rank = group, rank
        slices = [torch.empty_like(tensor) for _ in range(size)]
        torch.distributed.all_gather(slices, tensor.contiguous(), group=group)
        return tuple(slices)

    @staticmethod
    def backward(ctx, *grads):
        # autograd hands zeros for a slice no query read (materialised gradients, its default)
        whole = torch.stack(grads).contiguous()
        torch.distributed.all_reduce(whole, group=ctx.group)
        return whole[ctx.rank], None, None, None
