"""The fused kernels as torch operators, made with ``torch.library.custom_op``: opaque to torch.compile.

* ``torch.ops.hf_neural_attn.fused_attention_forward(query, key, value, attention_mask, term, dropout_seed, kind,
  activation, scaling, is_causal, hidden, dropout_p, dropout_offsets) -> (out, row_max, row_sum)``: the forward kernel.
* ``torch.ops.hf_neural_attn.fused_attention_backward(grad_out, out, row_max, row_sum, <the forward's arguments>)
  -> (dq, dk, dv, dterm)``: the two backward kernels.

``term`` is the score term's tensors, as :func:`.launch.term_tensors` reads them (the query network's U, V, b, c,
gate; the pair MLP's P, R, w and its gate when it has one), ``dterm`` their gradients in the same order; ``kind`` is
the kernels' ``KIND`` code (:data:`.launch.KIND_QUERY_NETWORK`, ``KIND_PAIR_MLP_RESIDUAL``,
``KIND_PAIR_MLP_REPLACE``) and the other arguments are the kernels' static values. Dropout is the blockwise
operators' form (:mod:`hf_neural_attn.ops.blockwise.custom_ops`): its probability, its seed (a 0-d int64 CPU tensor,
:func:`hf_neural_attn.ops.dropout.draw_seed`; None without dropout) and where the call sits in the whole it drops for.

Why opaque operators (``custom_op``) and not ``torch.library.triton_op``: with ``triton_op``, AOTAutograd decomposes
the operator into its kernel launches (``wrap_triton``) and inductor compiles the kernels' source itself. On an H100
(torch 2.11) that compile failed inside inductor's compile worker at the kernels' helper calls, and no fusion is to be
had across a user's kernel anyway. As an opaque operator the compiled graph calls this module's launch code, which
runs the kernels through Triton's own JIT exactly as eager calls do (the path verified on an H100): torch.compile then
needs nothing of the kernels but the fake implementations below. It also keeps the compiled path testable without a
GPU: inductor's CPU code calls the operator, whose kernels run in Triton's interpreter (``TRITON_INTERPRET=1``),
whereas a decomposed ``triton_op`` would hand the interpreter fake tensors. The seed is read on the host inside the
operator (``int(seed)`` of a CPU tensor: no device synchronisation) and passed to the kernels as a value.

Importing this module imports triton and defines the operators; :func:`.fused.fused_attention` imports it on its
first call, so the package imports without triton. Under torch.compile that first import runs rather than being
traced (Dynamo executes imports), so a compiled model defines the operators without a graph break.
"""

import torch
import triton

from .common import backward_key_kernel, backward_query_kernel, forward_kernel
from .launch import KIND_PAIR_MLP_REPLACE, KIND_QUERY_NETWORK, dropout_values, launch_args, on_device, term_tensors


def _forward_outputs(query: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward operator's outputs, uninitialised: out (batch, heads, q_len, head_dim) in the values' dtype,
    row_max and row_sum (batch, heads, q_len) in fp32, contiguous, on the query's device."""
    batch, heads, q_len, head_dim = query.shape
    out = query.new_empty(batch, heads, q_len, head_dim, dtype=value.dtype)
    row_max = query.new_empty(batch, heads, q_len, dtype=torch.float32)
    return out, row_max, torch.empty_like(row_max)


def _launch_args(query, key, value, attention_mask, term, dropout_seed, static, *, backward: bool):
    """:func:`.launch.launch_args` from the operators' arguments (``static``: kind, activation, scaling, is_causal,
    hidden, dropout_p, dropout_offsets)."""
    kind, activation, scaling, is_causal, hidden, dropout_p, dropout_offsets = static
    dropout = dropout_values(dropout_seed, dropout_p, dropout_offsets, query.shape[1])
    return launch_args(
        query, key, value, attention_mask, term, kind, activation, scaling, is_causal, hidden, backward=backward,
        dropout=dropout,
    )  # fmt: skip


@torch.library.custom_op("hf_neural_attn::fused_attention_forward", mutates_args=())
def fused_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    term: list[torch.Tensor],
    dropout_seed: torch.Tensor | None,
    kind: int,
    activation: str,
    scaling: float,
    is_causal: bool,
    hidden: int,
    dropout_p: float,
    dropout_offsets: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(scores + mask) @ v, with dropout on the probabilities when ``dropout_seed`` is given, and each query
    row's score maximum and softmax normaliser (before dropout), which the backward kernels rebuild the
    probabilities from.

    Args:
        query: (batch, heads, q_len, head_dim); key, value: (batch, kv_heads, kv_len, head_dim), all of one dtype.
        attention_mask: additive float mask broadcastable to (batch, heads, q_len, kv_len), or None.

    Returns:
        out (batch, heads, q_len, head_dim) in the values' dtype; row_max, row_sum (batch, heads, q_len), fp32.
    """
    static = (kind, activation, scaling, is_causal, hidden, dropout_p, dropout_offsets)
    pointers, strides, sizes, constexprs, num_warps = _launch_args(
        query, key, value, attention_mask, term, dropout_seed, static, backward=False
    )
    out, row_max, row_sum = _forward_outputs(query, value)
    batch, heads, q_len, _ = query.shape
    grid = (triton.cdiv(q_len, constexprs["BLOCK_M"]), batch * heads)
    with on_device(query):
        forward_kernel[grid](
            *pointers, out, row_max, row_sum, *strides, *sizes, **constexprs, num_warps=num_warps, num_stages=2
        )
    return out, row_max, row_sum


@fused_attention_forward.register_fake
def _fused_attention_forward_fake(query, key, value, attention_mask, term, dropout_seed, *static):
    return _forward_outputs(query, value)


@torch.library.custom_op("hf_neural_attn::fused_attention_backward", mutates_args=())
def fused_attention_backward(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    term: list[torch.Tensor],
    dropout_seed: torch.Tensor | None,
    kind: int,
    activation: str,
    scaling: float,
    is_causal: bool,
    hidden: int,
    dropout_p: float,
    dropout_offsets: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The gradients of query, key, value and the term's tensors, from that of ``out`` and what the forward
    operator returned (the other arguments are the forward's; the dropout masks are regenerated from the seed).

    Returns:
        dq, dk, dv, each shaped and typed like its tensor (dq is zero for the replace form, whose scores do not read
        the queries), and dterm, the gradients of ``term``'s tensors in its order.
    """
    static = (kind, activation, scaling, is_causal, hidden, dropout_p, dropout_offsets)
    pointers, strides, sizes, constexprs, num_warps = _launch_args(
        query, key, value, attention_mask, term, dropout_seed, static, backward=True
    )
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    device = query.device
    grad_out = grad_out.contiguous()
    # rowsum(P * dP) = dO . O per query row (FlashAttention's "delta"), in fp32. With dropout O is the dropped
    # output and dP carries the dropout factors, and it still holds.
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    stats = (grad_out, delta, row_max, row_sum)

    block_m, block_n = constexprs["BLOCK_M"], constexprs["BLOCK_N"]
    query_blocks = triton.cdiv(q_len, block_m)
    # The replace form's kernels write no dq: zeros, so that the operator returns no uninitialised memory.
    new_dq = torch.zeros if kind == KIND_PAIR_MLP_REPLACE else torch.empty
    dq = new_dq(batch, heads, q_len, head_dim, dtype=query.dtype, device=device)
    dk = torch.empty(batch, kv_heads, kv_len, head_dim, dtype=key.dtype, device=device)
    dv = torch.empty(batch, kv_heads, kv_len, head_dim, dtype=value.dtype, device=device)
    dgate_partial = torch.zeros(batch * heads * query_blocks, dtype=torch.float32, device=device)
    dw_partial = torch.zeros(batch * heads * query_blocks, constexprs["HID_PAD"], dtype=torch.float32, device=device)
    U, QV, QB, QC, P, R, w, gate = term_tensors(kind, term)
    if kind == KIND_QUERY_NETWORK:
        dU = torch.empty(batch, heads, hidden, q_len, head_dim, dtype=U.dtype, device=device)
        dQV = torch.empty(batch, heads, q_len, hidden, dtype=QV.dtype, device=device)
        dQB = torch.empty(batch, heads, q_len, hidden, dtype=QB.dtype, device=device)
        dQC = torch.empty(batch, heads, q_len, 1, dtype=QC.dtype, device=device)
        dP = dR = query  # unused by the query-network kernels
    else:
        dP = torch.empty(batch, heads, q_len, hidden, dtype=P.dtype, device=device)
        dR = torch.empty(batch, kv_heads, kv_len, hidden, dtype=R.dtype, device=device)
        dU = dQV = dQB = dQC = query  # unused by the pair-MLP kernels

    launch = dict(**constexprs, num_warps=num_warps, num_stages=2)
    with on_device(query):
        backward_query_kernel[(query_blocks, batch * heads)](
            *pointers, *stats, dq, dU, dQV, dQB, dQC, dP, dgate_partial, dw_partial, *strides, *sizes, **launch
        )
        backward_key_kernel[(triton.cdiv(kv_len, block_n), batch * kv_heads)](
            *pointers, *stats, dk, dv, dR, *strides, *sizes, **launch
        )
    # Per-program partial sums, reduced here in a fixed order: deterministic, unlike atomics.
    dgate = [] if gate is None else [dgate_partial.view(batch, heads, query_blocks).sum((0, 2)).to(gate.dtype)]
    if kind == KIND_QUERY_NETWORK:
        dterm = [dU, dQV, dQB, dQC, *dgate]
    else:
        dterm = [dP, dR, dw_partial[:, :hidden].sum(0).to(w.dtype), *dgate]
    return dq, dk, dv, dterm


@fused_attention_backward.register_fake
def _fused_attention_backward_fake(grad_out, out, row_max, row_sum, query, key, value, mask, term, *rest):
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query, key, value))
    return dq, dk, dv, [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in term]


def _save_for_backward(ctx, inputs, output):
    query, key, value, attention_mask, term, dropout_seed, *static = inputs
    out, row_max, row_sum = output
    ctx.mark_non_differentiable(row_max, row_sum)
    ctx.save_for_backward(query, key, value, attention_mask, dropout_seed, out, row_max, row_sum, *term)
    ctx.static = static  # kind, activation, scaling, is_causal, hidden, dropout_p, dropout_offsets


def _backward(ctx, grad_out, _grad_row_max, _grad_row_sum):
    query, key, value, attention_mask, dropout_seed, out, row_max, row_sum, *term = ctx.saved_tensors
    kind = ctx.static[0]
    dq, dk, dv, dterm = fused_attention_backward(
        grad_out, out, row_max, row_sum, query, key, value, attention_mask, term, dropout_seed, *ctx.static
    )
    # The replace form's scores do not read the queries. The mask gets no gradient: the dispatcher refuses a mask
    # that requires one (.fused.inputs_unsupported_reason); neither do the seed and the static arguments (values, and
    # a list of four ints, which torch.library reads as one value: None).
    return (None if kind == KIND_PAIR_MLP_REPLACE else dq, dk, dv, None, dterm, None, *(None for _ in ctx.static))


fused_attention_forward.register_autograd(_backward, setup_context=_save_for_backward)
