"""Blockwise attention for the pair-MLP score terms, in plain torch: the fused kernels' math, one query block
at a time, with a hand-written backward.

It serves the scorers that hand the fused paths a :class:`~hf_neural_attn.ops.terms.FusedInputs`, on any device,
and is what ``impl="chunked"`` runs for them. The generic chunked path (:mod:`..chunked`) recomputes a block's scores
through the scorer's own autograd graph; that costs the scorer's layout and a second evaluation of every pair
activation in backward.

Layout, as in :mod:`..triton`: this module is the entry (:func:`blockwise_attention`); :mod:`.custom_ops` the torch
operators it calls (forward and backward, the forward's autograd registered), which torch.compile keeps whole in
its graphs; :mod:`.loops` the loops over query blocks that the operators run, and the masking; :mod:`.common` what
every term shares (:class:`.common.BlockwiseTerm`: the activations, the call's buffers, a block's logits); one file
per term (:mod:`.query_network`, :mod:`.pair_mlp`), each a ``BlockwiseTerm`` registered in
:data:`.loops.TERM_LAYOUTS` under its name in :data:`hf_neural_attn.ops.terms.TERMS`. Nothing here branches on the
term.

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
from ..terms import FusedInputs
from .common import ACTIVATIONS
from .custom_ops import blockwise_attention_forward

# Query rows per block, with every head at once: the fastest block size of those measured on a CPU
# (docs/benchmarks.md, "block size").
QUERY_BLOCK = 64


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
    # The operator's schema takes tensors, lists and plain values (see .custom_ops): the term's tensors without
    # its absent ones, and the dropout as its probability, seed and place in its whole.
    output, _, _ = blockwise_attention_forward(
        query, key, value, attention_mask,
        [tensor for tensor in inputs.tensors if tensor is not None],
        dropout.seed if dropout is not None else None,
        inputs.term,
        [index for index, tensor in enumerate(inputs.tensors) if tensor is None],
        inputs.activation,
        float(inputs.term_scaling(scaling)),
        bool(is_causal),
        [int(row) for row in rows_seeing_all],
        int(block),
        dropout.p if dropout is not None else 0.0,
        dropout.offsets() if dropout is not None else [0, 0, 0, 0],
    )  # fmt: skip
    return output
