"""Chunked attention: O(n · block) memory for any scorer, on any device, through the scorer's own autograd.

``impl="chunked"`` runs this path for scorers without a fused form; those with one (QANA, one-layer Neural
Attention) get the blockwise pair-MLP path (:mod:`.blockwise`) instead, which computes the same thing with a
hand-written backward. The dispatcher in :mod:`hf_neural_attn.ops.dispatch` makes that choice.

The reference path keeps every (query, key) activation of the scoring MLP for backward:
batch × heads × n × n × h numbers per patched layer. Here queries are processed in blocks of
``QUERY_BLOCK``; forward keeps only the inputs and two numbers per query row, the row maximum and the
softmax normaliser. Backward recomputes one block's scores at a time, rebuilds its probabilities
exactly as forward made them, and backpropagates the softmax gradient ``dS = P ⊙ (dP − rowsum(P ⊙ dP))``
through the scorer, whose own autograd does the rest. Peak memory is one block's scores instead of all
of them.

A block holds whole rows, so no online softmax is needed. Saving the maximum and the normaliser rather
than their log-sum-exp keeps fp32 results as accurate as the reference: rebuilding P as exp(s − lse)
would add an error proportional to |lse|.

Under a causal mask, the keys after a block's last query are masked for the whole block and are not
scored at all; a purely causal call (no mask tensor) masks each block's diagonal here.

Queries that may attend to no key (left-padding rows) under an additive mask get uniform weights over every
key, as on the reference path: the blocks holding them score every key (``rows_seeing_all``, see
:func:`.masks.query_blocks`).

Inside a ``torch.compile``'d model the backward above cannot be traced (it runs the scorer's autograd inside an
autograd function's backward), and it calls arbitrary scorer code, so it cannot be an opaque operator either, as
the blockwise path is. There each block is instead one ``torch.utils.checkpoint`` region
(:func:`_checkpointed_blocks`): forward keeps the block's inputs only and backward recomputes the block, the same
memory as here, with no graph break. Dynamo unrolls the blocks, so compiling takes longer the longer the sequence
(one block of :data:`QUERY_BLOCK` queries more every 128 tokens; docs/scorers.md has the times measured).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from .dropout import AttentionDropout
from .grouped import grouped_matmul, grouped_transposed_matmul
from .masks import apply_mask, block_mask, query_blocks

QUERY_BLOCK = 128


def chunked_attention(
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
) -> tuple[torch.Tensor, None]:
    """Same contract as :func:`~hf_neural_attn.ops.reference.reference_attention`, without returning the
    probabilities (the dispatcher sends calls that need them to the reference path). Dropout regenerates each
    block's mask in backward (:mod:`.dropout`), the same entries the reference drops."""
    if torch.compiler.is_compiling():
        output = _checkpointed_blocks(
            scorer, query, key, value, attention_mask, scaling=scaling, dropout=dropout, extras=extras,
            is_causal=is_causal, rows_seeing_all=rows_seeing_all,
        )  # fmt: skip
        return output, None
    # Keys and values keep their kv heads: the scorers score each query head against its group's kv head.
    named = list(scorer.named_parameters())
    names, parameters = tuple(name for name, _ in named), tuple(parameter for _, parameter in named)
    extras_tensors = tuple(extras) if extras is not None else ()
    output = _BlockwiseAttention.apply(
        scorer,
        names,
        type(extras) if extras is not None else None,
        len(extras_tensors),
        scaling,
        is_causal,
        rows_seeing_all,
        dropout,
        attention_mask,
        query,
        key,
        value,
        *extras_tensors,
        *parameters,
    )
    return output, None


def _block_scores(score, query, key, extras, mask, is_causal, start, end, kv_end, scaling) -> torch.Tensor:
    """Masked logits of queries ``start:end`` against keys ``:kv_end``, in at least fp32."""
    block_extras = extras.query_block(start, end) if extras is not None else None
    scores = score(query[:, :, start:end], key[:, :, :kv_end], block_extras, scaling)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    rows = block_mask(mask, is_causal, start, end, kv_end, query.shape[-2], key.shape[-2], query.device)
    return apply_mask(scores, rows)


def _block_attention(scores, value, kv_end, dropout, streams, start):
    """A block's output (batch, heads, block, value_dim) from its masked logits (batch, heads, block, kv_end), with
    the row maximum and normaliser (batch, heads, block, 1) of its softmax; differentiable (the maximum is a
    constant shift, which the softmax cancels)."""
    block_max = scores.detach().amax(dim=-1, keepdim=True)
    exps = torch.exp(scores - block_max)
    block_sum = exps.sum(dim=-1, keepdim=True)
    probs = (exps / block_sum).to(value.dtype)
    if dropout is not None:
        probs = dropout.kept(probs, streams, start)
    return grouped_matmul(probs, value[:, :, :kv_end]), block_max, block_sum


def _checkpointed_blocks(
    scorer, query, key, value, attention_mask, *, scaling, dropout, extras, is_causal, rows_seeing_all
) -> torch.Tensor:
    """The chunked path as torch.compile takes it: each block of queries a ``torch.utils.checkpoint`` region, whose
    backward recomputes the block through the scorer's own autograd. Returns output (batch, heads, q_len,
    value_dim)."""
    streams = dropout.streams(query.shape[0], query.shape[1], query.device) if dropout is not None else None

    def block_output(query, key, value, start, end, kv_end):
        scores = _block_scores(scorer, query, key, extras, attention_mask, is_causal, start, end, kv_end, scaling)
        return _block_attention(scores, value, kv_end, dropout, streams, start)[0]

    blocks = query_blocks(query.shape[-2], key.shape[-2], is_causal, QUERY_BLOCK, rows_seeing_all)
    outputs = [
        checkpoint(block_output, query, key, value, start, end, kv_end, use_reentrant=False)
        for start, end, kv_end in blocks
    ]
    return torch.cat(outputs, dim=2)


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, scorer, names, extras_type, num_extras, scaling, is_causal, rows_seeing_all, dropout, attention_mask,
        query, key, value, *tensors,
    ):  # fmt: skip
        extras = extras_type._make(tensors[:num_extras]) if extras_type is not None else None
        q_len, kv_len = query.shape[-2], key.shape[-2]
        output = torch.empty(*query.shape[:-1], value.shape[-1], dtype=value.dtype, device=value.device)
        stats_dtype = torch.promote_types(query.dtype, torch.float32)
        row_max = torch.empty(query.shape[:-1], dtype=stats_dtype, device=query.device)
        row_sum = torch.empty_like(row_max)
        streams = dropout.streams(query.shape[0], query.shape[1], query.device) if dropout is not None else None
        for start, end, kv_end in query_blocks(q_len, kv_len, is_causal, QUERY_BLOCK, rows_seeing_all):
            scores = _block_scores(scorer, query, key, extras, attention_mask, is_causal, start, end, kv_end, scaling)
            output[:, :, start:end], block_max, block_sum = _block_attention(
                scores, value, kv_end, dropout, streams, start
            )
            row_max[:, :, start:end], row_sum[:, :, start:end] = block_max.squeeze(-1), block_sum.squeeze(-1)
        device = query.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.scorer, ctx.names, ctx.extras_type, ctx.num_extras = scorer, names, extras_type, num_extras
        ctx.scaling, ctx.is_causal, ctx.rows_seeing_all, ctx.dropout = scaling, is_causal, rows_seeing_all, dropout
        ctx.save_for_backward(attention_mask, query, key, value, row_max, row_sum, *tensors)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        attention_mask, query, key, value, row_max, row_sum, *tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad  # aligned with forward's arguments after ctx
        first_tensor = 12  # index of *tensors among forward's arguments
        device, autocast_enabled, autocast_dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast_enabled):
            query_leaf = query.detach().requires_grad_(needs[9])
            key_leaf = key.detach().requires_grad_(needs[10])
            # Optional extras (QANA's basis without u_rank) are None and stay None.
            leaves = [
                t.detach().requires_grad_(needs[first_tensor + i]) if t is not None else None
                for i, t in enumerate(tensors)
            ]
            extras = ctx.extras_type._make(leaves[: ctx.num_extras]) if ctx.extras_type is not None else None
            parameters = dict(zip(ctx.names, leaves[ctx.num_extras :]))

            def score(*args):
                return functional_call(ctx.scorer, parameters, args)

            grad_value = torch.zeros_like(value, dtype=row_max.dtype)
            dropout = ctx.dropout
            streams = dropout.streams(query.shape[0], query.shape[1], query.device) if dropout is not None else None
            blocks = query_blocks(query.shape[-2], key.shape[-2], ctx.is_causal, QUERY_BLOCK, ctx.rows_seeing_all)
            for start, end, kv_end in blocks:
                scores = _block_scores(
                    score, query_leaf, key_leaf, extras, attention_mask, ctx.is_causal, start, end, kv_end, ctx.scaling
                )
                with torch.no_grad():
                    rows = slice(start, end)
                    probs = torch.exp(scores - row_max[:, :, rows, None]) / row_sum[:, :, rows, None]
                    grad_block = grad_output[:, :, rows].to(probs.dtype)
                    grad_probs = grouped_matmul(grad_block, value[:, :, :kv_end].transpose(-1, -2).to(probs.dtype))
                    dropped = probs
                    if dropout is not None:  # the forward's mask, regenerated: O = (P * F) V, F the factors
                        factors = dropout.factors(streams, start, end, kv_end, probs.dtype)
                        dropped = probs * factors
                        grad_probs.mul_(factors)
                    grad_value[:, :, :kv_end] += grouped_transposed_matmul(dropped, grad_block, value.shape[1])
                    grad_scores = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))
                if scores.requires_grad:
                    torch.autograd.backward(scores, grad_scores)
        return (
            None, None, None, None, None, None, None, None, None,
            query_leaf.grad,
            key_leaf.grad,
            grad_value.to(value.dtype) if needs[11] else None,
            *(leaf.grad if leaf is not None else None for leaf in leaves),
        )  # fmt: skip
