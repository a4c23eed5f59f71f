"""The blockwise path as torch operators, made with ``torch.library.custom_op``, so that torch.compile takes it whole.

* ``torch.ops.hf_neural_attn.blockwise_attention_forward(query, key, value, attention_mask, term_tensors,
  dropout_seed, term, absent_term_tensors, activation, scaling, is_causal, rows_seeing_all, block, dropout_p,
  dropout_offsets) -> (out, row_max, row_sum)``: :func:`.loops.forward_blocks`.
* ``torch.ops.hf_neural_attn.blockwise_attention_backward(grad_out, out, row_max, row_sum, <the forward's
  arguments>) -> (dq, dk, dv, dterm)``: :func:`.loops.backward_blocks`.

The loops run in Python over query blocks; inside a compiled model Dynamo would unroll them block by block (minutes
of compiling at 512 tokens) or, kept out of the graph, break it. As operators they are one node each in the
graph, whatever the length, and the forward's registered autograd calls the backward operator, so AOTAutograd
puts that in the backward graph. This is the pattern of the Triton kernels' operators
(:mod:`hf_neural_attn.ops.triton.custom_ops`).

The arguments are what a schema can carry, in place of the autograd function's objects it replaced: ``term`` is the
term's name (a key of :data:`.loops.TERM_LAYOUTS`), ``term_tensors`` its tensors in
:class:`~hf_neural_attn.ops.terms.FusedInputs` order without the absent ones (a list of tensors cannot hold None),
``absent_term_tensors`` the positions of those (the pair MLP's gate in its replace form); dropout is its
probability, its seed (a 0-d int64 tensor, :func:`..dropout.draw_seed`; None without dropout) and where the call
sits in the whole it drops for (``AttentionDropout.offsets``: the part of the batch, of the heads, of the rows).
``dterm`` has a gradient for each of ``term_tensors``: zeros where the gradient is zero (the query network's ``c``,
which the softmax cancels), as an operator cannot return None in a list.

Every output is contiguous, and the fake implementations say so: inductor plans the tensors around an operator from
its fake's layout.
"""

import torch

from ..dropout import AttentionDropout
from .loops import TERM_LAYOUTS, backward_blocks, forward_blocks


def _stats_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype of the scores and the softmax statistics: at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(query.dtype, torch.float32)


def _call(term, term_tensors, absent_term_tensors, activation, scaling, query, key, dropout_p, dropout_seed, offsets):
    """The term of one call (a :class:`.common.BlockwiseTerm`), its tensors with None at the absent positions, and
    its dropout (None without a seed), from the operators' arguments."""
    present = iter(term_tensors)
    count = len(term_tensors) + len(absent_term_tensors)
    tensors = tuple(None if index in absent_term_tensors else next(present) for index in range(count))
    state = TERM_LAYOUTS[term](activation, scaling, tensors, query, key, _stats_dtype(query))
    dropout = AttentionDropout.at_offsets(dropout_p, dropout_seed, offsets) if dropout_seed is not None else None
    return state, tensors, dropout


@torch.library.custom_op("hf_neural_attn::blockwise_attention_forward", mutates_args=())
def blockwise_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    term_tensors: list[torch.Tensor],
    dropout_seed: torch.Tensor | None,
    term: str,
    absent_term_tensors: list[int],
    activation: str,
    scaling: float,
    is_causal: bool,
    rows_seeing_all: list[int],
    block: int,
    dropout_p: float,
    dropout_offsets: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(scores + mask) @ v, and each query row's score maximum and softmax normaliser, which the backward
    operator rebuilds the probabilities from.

    Args:
        query: (batch, heads, q_len, head_dim); key, value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing
            heads.
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            (batch, heads, q_len, kv_len).
        the rest: see the module doc and :func:`hf_neural_attn.ops.blockwise.blockwise_attention`.

    Returns:
        out (batch, heads, q_len, value_dim) in the values' dtype; row_max, row_sum (batch, kv_heads, groups, q_len)
        in the stats dtype (at least fp32).
    """
    state, _, dropout = _call(
        term, term_tensors, absent_term_tensors, activation, scaling, query, key, dropout_p, dropout_seed,
        dropout_offsets,
    )  # fmt: skip
    return forward_blocks(
        state, attention_mask, query, key, value, is_causal=is_causal, rows_seeing_all=rows_seeing_all, block=block,
        dropout=dropout,
    )  # fmt: skip


@blockwise_attention_forward.register_fake
def _blockwise_attention_forward_fake(query, key, value, attention_mask, term_tensors, dropout_seed, *static):
    batch, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    out = query.new_empty(batch, heads, q_len, value.shape[-1], dtype=value.dtype)
    row_max = query.new_empty(batch, kv_heads, heads // kv_heads, q_len, dtype=_stats_dtype(query))
    return out, row_max, torch.empty_like(row_max)


@torch.library.custom_op("hf_neural_attn::blockwise_attention_backward", mutates_args=())
def blockwise_attention_backward(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    term_tensors: list[torch.Tensor],
    dropout_seed: torch.Tensor | None,
    term: str,
    absent_term_tensors: list[int],
    activation: str,
    scaling: float,
    is_causal: bool,
    rows_seeing_all: list[int],
    block: int,
    dropout_p: float,
    dropout_offsets: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The gradients of query, key, value and ``term_tensors`` from that of ``out`` and what the forward operator
    returned (the other arguments are the forward's).

    Returns:
        dq, dk, dv, each shaped and typed like its tensor (dq is zero for the pair MLP's replace form, whose scores
        do not read the queries), and dterm, the gradients of ``term_tensors`` in its order; all contiguous.
    """
    state, tensors, dropout = _call(
        term, term_tensors, absent_term_tensors, activation, scaling, query, key, dropout_p, dropout_seed,
        dropout_offsets,
    )  # fmt: skip
    grad_query, grad_key, grad_value, grad_tensors = backward_blocks(
        state, tensors, grad_out, out, row_max, row_sum, attention_mask, query, key, value, scaling=scaling,
        is_causal=is_causal, rows_seeing_all=rows_seeing_all, block=block, dropout=dropout,
    )  # fmt: skip
    grad_term = [
        torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device) if grad is None else grad.contiguous()
        for tensor, grad in zip(tensors, grad_tensors, strict=True)
        if tensor is not None
    ]
    return grad_query.contiguous(), grad_key.contiguous(), grad_value.contiguous(), grad_term


@blockwise_attention_backward.register_fake
def _blockwise_attention_backward_fake(grad_out, out, row_max, row_sum, query, key, value, mask, term_tensors, *rest):
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query, key, value))
    return dq, dk, dv, [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in term_tensors]


def _save_for_backward(ctx, inputs, output):
    query, key, value, attention_mask, term_tensors, dropout_seed, *static = inputs
    out, row_max, row_sum = output
    ctx.mark_non_differentiable(row_max, row_sum)
    ctx.save_for_backward(query, key, value, attention_mask, dropout_seed, out, row_max, row_sum, *term_tensors)
    ctx.static = static  # term, absent_term_tensors, activation, scaling, is_causal, rows_seeing_all, block, p, offsets


def _backward(ctx, grad_out, _grad_row_max, _grad_row_sum):
    query, key, value, attention_mask, dropout_seed, out, row_max, row_sum, *term_tensors = ctx.saved_tensors
    grad_query, grad_key, grad_value, grad_term = blockwise_attention_backward(
        grad_out, out, row_max, row_sum, query, key, value, attention_mask, term_tensors, dropout_seed, *ctx.static
    )
    needs_query, needs_key, needs_value, _, needs_term = ctx.needs_input_grad[:5]
    # The mask and the seed get no gradient; neither do the static arguments.
    return (
        grad_query if needs_query else None,
        grad_key if needs_key else None,
        grad_value if needs_value else None,
        None,
        [grad if needs else None for grad, needs in zip(grad_term, needs_term, strict=True)],
        None,
        *(_no_gradient(argument) for argument in ctx.static),
    )


def _no_gradient(argument):
    """The "no gradient" of a static argument in the structure torch.library expects back: it reads an empty list
    as a list of tensors (so its gradient is an empty list) and any other value, a list of ints included, as one
    value (None)."""
    return [] if isinstance(argument, list) and not argument else None


blockwise_attention_forward.register_autograd(_backward, setup_context=_save_for_backward)
