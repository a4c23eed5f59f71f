"""The torch side of the paged kernel (:mod:`.paged_kernel`): what it accepts, and :func:`paged_fused_attention`,
which launches it.

A serving step's queries are the new tokens of several requests end to end (batch 1); each request's keys, values
and (for the pair-MLP term) the key half R of its MLP sit in the blocks of a paged cache that its row of the block
table names, in order. The kernel reads them there, with no gather, and scores each request's queries causally
against its own keys, the fused term (:class:`~hf_neural_attn.ops.terms.FusedInputs`) added as the other kernels
add it. Forward only, for inference: no mask tensor, no dropout, no probabilities, no gradients.

This module imports without triton; :func:`paged_fused_attention` imports the kernel (and triton) on its first call.
"""

from __future__ import annotations

import torch

from ..terms import PAIR_MLP, FusedInputs
from . import launch
from .fused import TERM_OPERANDS, inputs_unsupported_reason, mlp_unsupported_reason


def paged_call_unsupported_reason(
    fused: FusedInputs,
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    key_side_blocks: torch.Tensor | None = None,
) -> str | None:
    """Why the paged kernel cannot serve this call, or None if it can (the machine aside: see
    :func:`hf_neural_attn.ops.triton.paged_kernel_unsupported_reason`, which asks both). Arguments as
    :func:`paged_fused_attention`'s; only shapes, dtypes and devices are read (no device synchronisation)."""
    reason = mlp_unsupported_reason(fused.activation, fused.hidden) or _layout_problem(
        query, key_blocks, value_blocks, block_table, seq_lens, query_start_loc
    )
    if reason is not None:
        return reason
    blocks, block_size, kv_heads, head_dim = key_blocks.shape
    reason = inputs_unsupported_reason(
        dtype=query.dtype, q_len=query.shape[2], kv_len=blocks * block_size, head_dim=query.shape[-1],
        is_causal=False, value_head_dim=value_blocks.shape[-1],
    )  # fmt: skip
    if reason is not None:
        return reason
    return _key_side_problem(fused, query, key_blocks, key_side_blocks)


def _layout_problem(query, key_blocks, value_blocks, block_table, seq_lens, query_start_loc) -> str | None:
    """What is wrong with the query, the cache and the step's index tensors, or None."""
    if query.dim() != 4 or query.shape[0] != 1:
        return (
            f"query must be (1, heads, tokens, head_dim), the step's queries of every request end to end; got shape "
            f"{tuple(query.shape)}"
        )
    if key_blocks.dim() != 4 or value_blocks.shape[:3] != key_blocks.shape[:3]:
        return (
            "key_blocks and value_blocks must be (blocks, block_size, kv_heads, head_dim) with the same first three "
            f"sizes; got {tuple(key_blocks.shape)} and {tuple(value_blocks.shape)}"
        )
    heads, kv_heads = query.shape[1], key_blocks.shape[2]
    if heads % kv_heads != 0 or key_blocks.shape[-1] != query.shape[-1]:
        return (
            f"the cache's blocks {tuple(key_blocks.shape)} do not fit queries {tuple(query.shape)}: their kv_heads "
            "must divide the query heads and their head_dim must be the queries'"
        )
    if key_blocks.dtype != query.dtype or value_blocks.dtype != query.dtype:
        return (
            f"the paged kernel reads the cache in the queries' dtype ({query.dtype}); key_blocks are "
            f"{key_blocks.dtype}, value_blocks {value_blocks.dtype} (a quantized cache is not supported)"
        )
    requests = block_table.shape[0] if block_table.dim() == 2 else -1
    if seq_lens.shape != (requests,) or query_start_loc.shape != (requests + 1,):
        return (
            "block_table must be (requests, max_blocks), seq_lens (requests,) and query_start_loc (requests + 1,); "
            f"got {tuple(block_table.shape)}, {tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}"
        )
    indices = (block_table, seq_lens, query_start_loc)
    if any(t.is_floating_point() or t.is_complex() or t.dtype == torch.bool for t in indices):
        return "block_table, seq_lens and query_start_loc must be integer tensors (vLLM's are int32)"
    tensors = (query, key_blocks, value_blocks, *indices)
    if len({t.device for t in tensors}) != 1:
        devices = [str(t.device) for t in tensors]
        return f"the query, the cache and the step's index tensors must be on one device; got {devices}"
    return None


def _key_side_problem(fused, query, key_blocks, key_side_blocks) -> str | None:
    """What is wrong with ``key_side_blocks`` for this term, or None."""
    if fused.term != PAIR_MLP:
        if key_side_blocks is not None:
            return f"key_side_blocks is the pair-MLP term's R; the {fused.term!r} term reads none, pass None"
        return None
    expected = (*key_blocks.shape[:3], fused.hidden)
    if key_side_blocks is None or key_side_blocks.shape != expected:
        got = None if key_side_blocks is None else tuple(key_side_blocks.shape)
        return (
            f"the {PAIR_MLP!r} term reads R per key from key_side_blocks, paged as the keys are: expected shape "
            f"{expected} (blocks, block_size, kv_heads, h), got {got}"
        )
    if key_side_blocks.dtype != query.dtype or key_side_blocks.device != query.device:
        return (
            f"key_side_blocks must be in the queries' dtype and on their device ({query.dtype}, {query.device}); "
            f"got {key_side_blocks.dtype} on {key_side_blocks.device}"
        )
    return None


def paged_fused_attention(
    fused: FusedInputs,
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scaling: float,
    key_side_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scores) @ v of each request of a serving step over its paged keys, causally, the scores given by
    ``fused``'s term; one kernel launch, no gather.

    Args:
        fused: the term of the step's queries, as ``Scorer.fused_inputs`` builds it for ``query``: the query
            network's U (1, heads, h, tokens, head_dim), V, b (1, heads, tokens, h), c (1, heads, tokens, 1), gate
            (heads,); or the pair MLP's P (1, heads, tokens, h), w (h,) and gate (heads,) or None (replace form).
            The pair MLP's R in ``fused`` is ignored: the kernel reads R from ``key_side_blocks``.
        query: (1, heads, tokens, head_dim), the step's queries of every request end to end, any strides.
        key_blocks, value_blocks: (blocks, block_size, kv_heads, head_dim), any strides (vLLM's CPU layout is a
            transposed view), in the query's dtype; kv_heads divides heads (grouped-query attention).
        block_table: (requests, max_blocks) integer: each request's cache blocks in order.
        seq_lens: (requests,) integer: each request's number of keys, cached ones and this step's.
        query_start_loc: (requests + 1,) integer: cumulative query counts. Request r's q_len queries are its last
            keys (query i sits at key position seq_lens[r] - q_len + i) and attend causally; q_len <= seq_lens[r].
        scaling: the model's dot-product scale (an unscaled replace form runs with 1, as the other kernels do).
        key_side_blocks: the pair-MLP term's R per key, (blocks, block_size, kv_heads, h), paged as the keys are;
            None for the query-network term.

    Returns:
        output (1, heads, tokens, head_dim), contiguous, in the query's dtype; rows after ``query_start_loc[-1]``
        are 0.

    Raises:
        ValueError: naming what :func:`paged_call_unsupported_reason` finds wrong. The caller asks
            :func:`hf_neural_attn.ops.triton.paged_kernel_unsupported_reason` first.
    """
    reason = paged_call_unsupported_reason(
        fused, query, key_blocks, value_blocks, block_table, seq_lens, query_start_loc, key_side_blocks
    )
    if reason is not None:
        raise ValueError(f"paged_fused_attention cannot serve this call: {reason}")
    # Imported here, not at the top: it imports triton (this module imports without it).
    from .paged_kernel import paged_forward_kernel

    tensors = fused.tensors
    if fused.term == PAIR_MLP:
        P, _, w, gate = tensors
        tensors = (P, key_side_blocks.transpose(1, 2), w, gate)  # R indexed as the keys below
    kind, term = TERM_OPERANDS[fused.term](tensors, query.dtype)
    # The cache as a batch of blocks, (blocks, kv_heads, block_size, ·): the kernels' key layout (see .paged_kernel).
    keys, values = key_blocks.transpose(1, 2), value_blocks.transpose(1, 2)
    pointers, strides = launch.pointers_and_strides(query, keys, values, None, term, kind)
    _, heads, tokens, head_dim = query.shape
    requests = block_table.shape[0]
    # Tiles sized for the step's mean query count: a decoding step (one query per request) gets 16-row tiles.
    constexprs, num_warps = launch.tile_constexprs(
        query, kind, fused.activation, fused.hidden, backward=False, q_len=-(-tokens // max(requests, 1))
    )
    output = query.new_zeros(1, heads, tokens, head_dim)
    if requests == 0 or tokens == 0:
        return output
    sizes = (
        *block_table.stride(), heads, heads // key_blocks.shape[2], requests, tokens, head_dim, fused.hidden,
        key_blocks.shape[1], float(fused.term_scaling(scaling)),
    )  # fmt: skip
    grid = (tokens // constexprs["BLOCK_M"] + requests, heads)
    with launch.on_device(query):
        paged_forward_kernel[grid](
            *pointers, output, block_table, seq_lens.contiguous(), query_start_loc.contiguous(), *strides, *sizes,
            **constexprs,
            num_warps=num_warps,
        )  # fmt: skip
    return output
