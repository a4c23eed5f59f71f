"""Blockwise attention for the pair-MLP score terms, in plain torch: the fused kernels' math, one query block
at a time, with a hand-written backward.

It serves the scorers that hand the fused paths a :class:`~hf_neural_attn.ops.terms.FusedInputs`, on any device,
and is what ``impl="chunked"`` runs for them. The generic chunked path (:mod:`..chunked`) recomputes a block's scores
through the scorer's own autograd graph; that costs the scorer's layout and a second evaluation of every pair
activation in backward.

Layout, as in :mod:`..triton`: this module is the entry (:func:`blockwise_attention`), the autograd function and its
loops over query blocks, and the masking; :mod:`.common` what every term shares (:class:`.common.BlockwiseTerm`: the
activations, the call's buffers, a block's logits); one file per term (:mod:`.query_network`, :mod:`.pair_mlp`), each
a ``BlockwiseTerm`` registered in :data:`TERM_LAYOUTS` under its name in :data:`hf_neural_attn.ops.terms.TERMS`.
Nothing here branches on the term.

On a CPU this path is bound by its matrix products and by the elementwise passes over the block's h
hidden-unit planes (each the size of the block's score matrix), so it is laid out to make few passes:

* a block's hidden layer is Z (batch, kv_heads, groups, block, h, kv_end), contiguous: each query row's h unit
  planes are adjacent, so the output layer (row i's own weights times its (h, kv_end) planes) is one batched
  matrix-vector product that also adds the dot product, and the softmax passes read and write one plane;
* each term computes Z in as few products as its form allows (its own module doc says how);
* backward evaluates each pre-activation plane once and uses it both to rebuild the probabilities and for
  the gradients; dZ is one product ``dS · weight`` with the activation's derivative applied in place
  (:data:`.common.ACTIVATIONS`);
* the softmax gradient uses ``rowsum(P ⊙ dP) = dO · O`` (one (n, d) product instead of a pass over the block),
  and forward normalises the (block, d) output rather than the (block, kv_end) weights;
* grouped-query attention reads each key/value head once for its group of query heads: queries are viewed
  as (batch, kv_heads, groups, ...) and keys broadcast over the groups, nothing is repeated;
* a purely causal call needs no mask tensor: each block masks the (block, block) corner where its queries
  meet their own keys, the only part of it the causal mask hides.

Blocks are :data:`QUERY_BLOCK` query rows: larger blocks make every pass over the unit planes bigger, smaller ones
make more calls (the sizes measured are in docs/benchmarks.md).

Numerics match the reference path to fp32 rounding: scores and softmax statistics in fp32 (fp64 stays fp64),
the row maximum and normaliser saved rather than their log-sum-exp (see :mod:`..chunked`).
"""

from __future__ import annotations

import torch

from ..dropout import AttentionDropout
from ..grouped import group_heads, grouped_transposed_matmul
from ..masks import apply_mask, block_mask, query_blocks
from ..terms import PAIR_MLP, QUERY_NETWORK, FusedInputs
from .common import ACTIVATIONS, BlockwiseTerm
from .pair_mlp import PairMLPTerm
from .query_network import QueryNetworkTerm

# Query rows per block, with every head at once: the fastest block size of those measured on a CPU
# (docs/benchmarks.md, "block size").
QUERY_BLOCK = 64

# Each fused term's blockwise form, by its name in hf_neural_attn.ops.terms.TERMS.
TERM_LAYOUTS: dict[str, type[BlockwiseTerm]] = {QUERY_NETWORK: QueryNetworkTerm, PAIR_MLP: PairMLPTerm}


def blockwise_unsupported_reason(activation: str | None) -> str | None:
    """Why this path cannot serve a fused term with hidden-layer ``activation``, or None."""
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} has no derivative here (known: {sorted(ACTIVATIONS)})"
    return None


def blockwise_attention(
    inputs: FusedInputs,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    is_causal: bool,
    dropout: AttentionDropout | None = None,
    block: int | None = None,
    rows_seeing_all: tuple[int, ...] = (),
) -> torch.Tensor:
    """softmax(scores + mask) @ v, the scores given by ``inputs``' term, a query block at a time.

    Args:
        inputs: the scorer's fused term and its tensors, see :mod:`hf_neural_attn.ops.terms`; gradients flow back
            through them to the scorer.
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing heads (not repeated).
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            (batch, heads, q_len, kv_len).
        is_causal: causal, queries aligned to the end of the keys. Keys after a block's last query are never
            scored; with ``attention_mask`` None the block masks its diagonal itself.
        dropout: the call's attention dropout (:class:`..dropout.AttentionDropout`), or None; each block's mask is
            regenerated in backward.
        block: queries per block; default :data:`QUERY_BLOCK`.
        rows_seeing_all: query rows an additive mask hides every key from; their blocks score every key
            (:func:`..masks.query_blocks`).

    Returns:
        output (batch, heads, q_len, value_dim).
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads or value.shape[1] != kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of the key/value heads ({kv_heads}).")
    block = QUERY_BLOCK if block is None else block
    scaling = inputs.term_scaling(scaling)
    return _BlockwisePairAttention.apply(
        TERM_LAYOUTS[inputs.term], inputs.activation, float(scaling), (bool(is_causal), tuple(rows_seeing_all)),
        int(block), dropout, attention_mask, query, key, value, *inputs.tensors,
    )  # fmt: skip


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


class _BlockwisePairAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, activation, scaling, causality, block, dropout, mask, query, key, value, *tensors):
        is_causal, rows_seeing_all = causality
        q_len, kv_heads, kv_len = query.shape[2], key.shape[1], key.shape[2]
        stats_dtype = torch.promote_types(query.dtype, torch.float32)
        grouped_value = value.unsqueeze(2)
        mask_block = _BlockMasker(mask, kv_heads, is_causal, q_len, kv_len, block, query.device)
        state = layout(activation, scaling, tensors, query, key, stats_dtype)
        shape = state.scaled_query.shape[:-1]  # (B, q)
        output = torch.empty(*shape, value.shape[-1], dtype=value.dtype, device=value.device)
        row_max = torch.empty(shape, dtype=stats_dtype, device=query.device)
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
        ctx.meta = (layout, activation, scaling, causality, block, dropout)
        ctx.save_for_backward(mask, query, key, value, output, row_max, row_sum, *tensors)
        return output.flatten(1, 2)

    @staticmethod
    def backward(ctx, grad_output):
        mask, query, key, value, output, row_max, row_sum, *tensors = ctx.saved_tensors
        layout, activation, scaling, (is_causal, rows_seeing_all), block, dropout = ctx.meta
        q_len, kv_heads, kv_len = query.shape[2], key.shape[1], key.shape[2]
        stats_dtype = row_max.dtype
        mask_block = _BlockMasker(mask, kv_heads, is_causal, q_len, kv_len, block, query.device)
        state = layout(activation, scaling, tensors, query, key, stats_dtype)
        grad_output = group_heads(grad_output, kv_heads).to(stats_dtype)
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

        needs = ctx.needs_input_grad
        grads = [
            (grad_query * scaling).flatten(1, 2).to(query.dtype) if needs[7] else None,
            grad_key.to(key.dtype) if needs[8] else None,
            grad_value.to(value.dtype) if needs[9] else None,
        ]
        term_grads = state.tensor_grads(grad_weights, tensors)
        # forward's arguments: layout, activation, scaling, causality, block, dropout, mask, query, key, value,
        # *tensors
        term_grads = [g if needs[10 + i] else None for i, g in enumerate(term_grads)]
        return (None, None, None, None, None, None, None, *grads, *term_grads)
