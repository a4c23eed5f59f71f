"""The blockwise path's loops over query blocks, forward and backward, and their masking: plain functions of
tensors and a term (:class:`.common.BlockwiseTerm`), which the operators of :mod:`.custom_ops` run.

See :mod:`hf_neural_attn.ops.blockwise` for the layout and the passes. ``B`` stands for (batch, kv_heads, groups).
"""

from __future__ import annotations

import torch

from ..dropout import AttentionDropout
from ..grouped import group_heads, grouped_transposed_matmul
from ..masks import apply_mask, block_mask, query_blocks
from ..terms import PAIR_MLP, QUERY_NETWORK
from .common import BlockwiseTerm
from .pair_mlp import PairMLPTerm
from .query_network import QueryNetworkTerm

# Each fused term's blockwise form, by its name in hf_neural_attn.ops.terms.TERMS.
TERM_LAYOUTS: dict[str, type[BlockwiseTerm]] = {QUERY_NETWORK: QueryNetworkTerm, PAIR_MLP: PairMLPTerm}


# ------------------------------------------------------------------------------------------------ layout


def _grouped_mask(mask: torch.Tensor | None, kv_heads: int) -> torch.Tensor | None:
    """A (batch or 1, heads or 1, q or 1, kv) mask as (batch or 1, kv_heads or 1, groups or 1, q or 1, kv)."""
    if mask is None:
        return None
    if mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return group_heads(mask, kv_heads) if mask.shape[1] > 1 else mask.unsqueeze(1)


class _BlockMasker:
    """Masks a block's logits (B, block, kv_end) in place, like :func:`..masks.apply_mask` (blocked logits at the
    dtype's minimum), for one call's mask and blocks."""

    def __init__(self, mask, kv_heads, is_causal, q_len, kv_len, block, device):
        self.mask = _grouped_mask(mask, kv_heads)
        self.is_causal, self.q_len, self.kv_len = is_causal, q_len, kv_len
        # With no mask tensor and is_causal, only the columns from a block's first query position on can be
        # hidden: the (block, block) corner where its queries meet their own keys, the same triangle for
        # every block (queries aligned to the end of the keys, so kv_len >= q_len).
        self.corner = None
        if mask is None and is_causal and kv_len >= q_len:
            self.corner = torch.ones(block, block, dtype=torch.bool, device=device).triu_(1)

    def __call__(self, scores, start, end, kv_end) -> None:
        if self.corner is not None:
            first = start + self.kv_len - self.q_len
            lowest = torch.finfo(scores.dtype).min  # as apply_mask blocks a logit
            scores[..., first:kv_end].masked_fill_(self.corner[: end - start, : kv_end - first], lowest)
            return
        rows_mask = block_mask(self.mask, self.is_causal, start, end, kv_end, self.q_len, self.kv_len, scores.device)
        apply_mask(scores, rows_mask, inplace=True)


# ------------------------------------------------------------------------------------------------ the loops


def _grouped_streams(dropout: AttentionDropout, query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The dropout streams (``batch * heads + head``) of query heads grouped as (batch, kv_heads, groups, 1, 1)."""
    return group_heads(dropout.streams(query.shape[0], query.shape[1], query.device), kv_heads)


def _sum_over_groups(blocks: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Σ over groups and rows of blocksᵀ @ other: blocks (B, block, n) and other (B, block, d) ->
    (batch, kv_heads, n, d)."""
    return grouped_transposed_matmul(blocks.flatten(1, 2), other.flatten(1, 2), blocks.shape[1])


def forward_blocks(
    state: BlockwiseTerm,
    mask: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool,
    rows_seeing_all: list[int],
    block: int,
    dropout: AttentionDropout | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(scores + mask) @ v a block of ``block`` queries at a time, ``state`` the call's term.

    Returns:
        output (batch, heads, q_len, value_dim), contiguous, in the values' dtype, and each query row's score
        maximum and softmax normaliser (batch, kv_heads, groups, q_len) in the stats dtype, from which
        :func:`backward_blocks` rebuilds the probabilities.
    """
    q_len, kv_heads, kv_len = query.shape[2], key.shape[1], key.shape[2]
    grouped_value = value.unsqueeze(2)
    mask_block = _BlockMasker(mask, kv_heads, is_causal, q_len, kv_len, block, query.device)
    shape = state.scaled_query.shape[:-1]  # (B, q)
    output = torch.empty(*shape, value.shape[-1], dtype=value.dtype, device=value.device)
    row_max = torch.empty(shape, dtype=state.stats_dtype, device=query.device)
    row_sum = torch.empty_like(row_max)
    streams = _grouped_streams(dropout, query, kv_heads) if dropout is not None else None
    for start, end, kv_end in query_blocks(q_len, kv_len, is_causal, block, rows_seeing_all):
        rows = slice(start, end)
        scores = state.scores(rows, kv_end, keep_z=False)[0]
        mask_block(scores, start, end, kv_end)
        block_max = scores.amax(dim=-1, keepdim=True)
        exps = scores.sub_(block_max).exp_()
        block_sum = exps.sum(dim=-1, keepdim=True)
        if dropout is not None:  # after the normaliser is taken: dropout acts on the probabilities
            exps.mul_(dropout.factors(streams, start, end, kv_end, exps.dtype))
        # Normalise the (block, d) output rather than the (block, kv_end) weights.
        output[..., rows, :] = (exps.to(value.dtype) @ grouped_value[..., :kv_end, :]) / block_sum
        row_max[..., rows], row_sum[..., rows] = block_max.squeeze(-1), block_sum.squeeze(-1)
    return output.flatten(1, 2), row_max, row_sum


def backward_blocks(
    state: BlockwiseTerm,
    tensors: tuple[torch.Tensor | None, ...],
    grad_output: torch.Tensor,
    output: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    mask: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scaling: float,
    is_causal: bool,
    rows_seeing_all: list[int],
    block: int,
    dropout: AttentionDropout | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """The gradients of query, key, value (each in its own dtype and shape) and of ``tensors``, the term's (in
    :class:`~..terms.FusedInputs` order; :meth:`~.common.BlockwiseTerm.tensor_grads`, None where a gradient is
    zero), from that of the output (batch, heads, q_len, value_dim) and what :func:`forward_blocks` returned; the
    other arguments are the forward's."""
    q_len, kv_heads, kv_len = query.shape[2], key.shape[1], key.shape[2]
    stats_dtype = row_max.dtype
    mask_block = _BlockMasker(mask, kv_heads, is_causal, q_len, kv_len, block, query.device)
    grad_output = group_heads(grad_output, kv_heads).to(stats_dtype)
    output = group_heads(output, kv_heads)
    # rowsum(P * dP) per query row is dO . O: the softmax backward's correction, without a pass over P. With
    # dropout, O is the dropped output and dP carries the dropout factors, and it still holds.
    streams = _grouped_streams(dropout, query, kv_heads) if dropout is not None else None
    correction = (grad_output * output.to(stats_dtype)).sum(-1, keepdim=True)
    key_f, value_f = key.to(stats_dtype), value.to(stats_dtype)
    scaled_query = state.scaled_query.to(stats_dtype)
    gated = state.gate is not None

    grad_key, grad_value = state.zeros(key_f.shape), state.zeros(value_f.shape)
    grad_query = state.per_row(scaled_query.shape) if gated else state.zeros(scaled_query.shape)
    grad_weights = state.per_row(state.unit_weights.shape)  # (B, q, h)
    state.begin_backward()

    for start, end, kv_end in query_blocks(q_len, kv_len, is_causal, block, rows_seeing_all):
        rows = slice(start, end)
        # Z is evaluated once per block, for the probabilities and for every gradient below.
        scores, z, activated = state.scores(rows, kv_end)
        mask_block(scores, start, end, kv_end)
        probs = scores.sub_(row_max[..., rows, None]).exp_().div_(row_sum[..., rows, None])
        grad_block = grad_output[..., rows, :]
        grad_probs = grad_block @ value_f[..., :kv_end, :].unsqueeze(2).transpose(-1, -2)
        if dropout is None:
            grad_value[..., :kv_end, :] += _sum_over_groups(probs, grad_block)
        else:  # the forward's mask, regenerated: O = (P * F) V, F the dropout factors
            factors = dropout.factors(streams, start, end, kv_end, stats_dtype)
            grad_value[..., :kv_end, :] += _sum_over_groups(probs * factors, grad_block)
            grad_probs.mul_(factors)
            del factors
        grad_scores = grad_probs.sub_(correction[..., rows, :]).mul_(probs)  # (B, block, kv_end)
        del probs, scores
        keys = key_f[..., :kv_end, :]
        if gated:  # the dot product's gradients (scaled_query already carries the scaling)
            grad_query[..., rows, :] = grad_scores @ keys.unsqueeze(2)
            grad_key[..., :kv_end, :] += _sum_over_groups(grad_scores, scaled_query[..., rows, :])
        # Σ_j dS_ij act(Z)_ilj per query row: a (1, kv_end) x (kv_end, h) product per row.
        flat_activated = activated.view(-1, state.hidden, kv_end).transpose(1, 2)
        row_shape = grad_weights[..., rows, :].shape
        grad_weights[..., rows, :] = torch.bmm(grad_scores.view(-1, 1, kv_end), flat_activated).view(row_shape)
        grad_scores = grad_scores.unsqueeze(-2)  # against the h unit planes
        weights = state.unit_weights[..., rows, :, None].to(stats_dtype)  # (B, block, h, 1)
        # dZ = act'(Z) * weight * dS: one contiguous product, then the derivative in place (faster than
        # the derivative against a broadcast dS).
        grad_units = torch.mul(grad_scores, weights, out=state.buffer("grad_units", z.shape, stats_dtype))
        grad_units = state.activation_backward(grad_units, z, activated)
        del z, activated, grad_scores
        state.add_unit_grads(rows, kv_end, grad_units, grad_key)
        del grad_units

    grad_query = (grad_query * scaling).flatten(1, 2).to(query.dtype)
    return grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype), state.tensor_grads(grad_weights, tensors)
