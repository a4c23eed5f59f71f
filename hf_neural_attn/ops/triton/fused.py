"""The torch side of the fused kernels: what they accept, and :func:`fused_attention`, which runs them.

:func:`fused_attention` calls the torch operator ``torch.ops.hf_neural_attn.fused_attention_forward``, whose
autograd formula calls ``fused_attention_backward`` (both in :mod:`.custom_ops`, which launches the kernels). This
module imports without triton; it imports :mod:`.custom_ops`, and with it triton and the kernels of :mod:`.common`,
on the first call. It sees tensors and a few static values (:class:`~hf_neural_attn.ops.terms.FusedInputs`, whose
module doc lists each term's tensors), never a scorer.

Backward returns the gradients of the term's tensors; torch autograd carries them back to whatever produced
them. For the pair-MLP term, R comes from the keys *before* they are repeated for grouped-query attention:
head ``i`` reads key/value head ``i // groups``, nothing is repeated.

Numerics: scores, softmax statistics and every accumulation are fp32 whatever the input dtype. In fp32,
products use full fp32 precision unless ``torch.backends.cuda.matmul.allow_tf32`` is set, as torch's own
matmuls do. Rows that the mask hides entirely (left padding) get uniform weights over the keys at or
before their position; the reference spreads them over all keys. Their outputs carry no information on
either path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..terms import PAIR_MLP, QUERY_NETWORK, FusedInputs
from .launch import KIND_PAIR_MLP_REPLACE, KIND_PAIR_MLP_RESIDUAL, KIND_QUERY_NETWORK

SUPPORTED_ACTIVATIONS = ("gelu", "relu", "silu", "tanh", "sigmoid")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The h hidden units of a tile are unrolled into (BLOCK_M * h, BLOCK_N) fp32 registers; beyond this the
# tile no longer fits and the chunked path is the better choice.
MAX_HIDDEN = 16
MAX_HEAD_DIM = 256


class KernelDropout(NamedTuple):
    """One call's attention dropout, as the kernels take it: the values of an
    :class:`hf_neural_attn.ops.dropout.AttentionDropout` (its ``seed``, ``p`` and ``offsets()``), which the dispatcher
    hands over (this package sees tensors and values, nothing of the compute paths above it).

    seed: the call's seed, a 0-d int64 CPU tensor in [0, 2**31) (``ops.dropout.draw_seed``).
    p: the dropout probability.
    offsets: where the call sits in the whole it drops for: the part of the batch, the first head, the whole's heads
        (0: the call's own), the first row.
    """

    seed: torch.Tensor
    p: float
    offsets: tuple[int, int, int, int] = (0, 0, 0, 0)


def mlp_unsupported_reason(activation: str, hidden: int) -> str | None:
    """Why a hidden layer of ``hidden`` units with ``activation`` cannot be fused, or None."""
    if activation not in SUPPORTED_ACTIVATIONS:
        return f"activation={activation!r} has no Triton kernel (supported: {list(SUPPORTED_ACTIVATIONS)})"
    if hidden > MAX_HIDDEN:
        return f"h={hidden} hidden units do not fit one tile (at most {MAX_HIDDEN}); use impl='chunked'"
    return None


def inputs_unsupported_reason(
    *,
    dtype: torch.dtype,
    q_len: int,
    kv_len: int,
    head_dim: int,
    is_causal: bool,
    attention_mask: torch.Tensor | None = None,
    value_head_dim: int | None = None,
) -> str | None:
    """Why the kernels cannot serve a call with these shapes and mask, or None (shapes and dtypes only)."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not supported by the Triton kernels (float32, bfloat16, float16 are)"
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim={head_dim} is larger than the kernels' {MAX_HEAD_DIM}"
    if value_head_dim is not None and value_head_dim != head_dim:
        return f"values {value_head_dim} wide and queries {head_dim} wide: the kernels need one head_dim"
    if q_len == 0 or kv_len == 0:
        return "empty query or key sequence"
    if is_causal and kv_len < q_len:
        return (
            f"a causal call needs at least as many keys as queries (queries are aligned to the end of the "
            f"keys), got q_len={q_len}, kv_len={kv_len}"
        )
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool and not attention_mask.is_floating_point():
            return f"the attention mask must be boolean or an additive float tensor, got dtype {attention_mask.dtype}"
        if attention_mask.requires_grad:
            return "the kernels give no gradient to the attention mask, and this one requires grad"
    return None


def fused_attention(
    inputs: FusedInputs,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    is_causal: bool = False,
    dropout: KernelDropout | None = None,
) -> torch.Tensor:
    """softmax(scores + mask) @ v, the scores given by ``inputs``' term, with the fused kernels.

    Args:
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing heads (grouped-query
            attention); repeated keys (kv_heads == heads) work too.
        attention_mask: additive float mask broadcastable to (batch, heads, q_len, kv_len), or None.
        is_causal: the mask is causal, with queries aligned to the end of the keys. The kernels then skip
            the tiles it hides entirely and mask after the diagonal themselves.
        dropout: the call's attention dropout (:class:`KernelDropout`), or None: the kernels drop exactly the
            entries every other path drops for its seed, and regenerate them in backward.

    Returns:
        output (batch, heads, q_len, head_dim). The caller has checked the call with
        :func:`inputs_unsupported_reason` and :func:`mlp_unsupported_reason`.
    """
    # Imported here, not at the top: it imports triton and defines the operators (once, on the first call).
    from .custom_ops import fused_attention_forward

    arguments = operator_arguments(
        inputs, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal, dropout=dropout
    )
    out, _, _ = fused_attention_forward(*arguments)
    return out


def _query_network_operands(tensors: tuple, dtype: torch.dtype) -> tuple[int, list[torch.Tensor]]:
    U, V, b, c, gate = tensors
    return KIND_QUERY_NETWORK, [U.to(dtype), V, b, c, gate]


def _pair_mlp_operands(tensors: tuple, dtype: torch.dtype) -> tuple[int, list[torch.Tensor]]:
    P, R, w, gate = tensors
    kind = KIND_PAIR_MLP_RESIDUAL if gate is not None else KIND_PAIR_MLP_REPLACE
    return kind, [P.to(dtype), R.to(dtype), w, *([] if gate is None else [gate])]


# Each fused term's operands, by its name in hf_neural_attn.ops.terms.TERMS: (its tensors, the query's dtype) ->
# the kernels' KIND code and the operators' ``term`` list (the tensors that multiply the keys cast to that dtype;
# read back by .launch.term_tensors).
TERM_OPERANDS = {QUERY_NETWORK: _query_network_operands, PAIR_MLP: _pair_mlp_operands}


def operator_arguments(
    inputs: FusedInputs,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    is_causal: bool,
    dropout: KernelDropout | None = None,
) -> tuple:
    """The arguments of ``torch.ops.hf_neural_attn.fused_attention_forward`` (:mod:`.custom_ops`) for a call of
    :func:`fused_attention`: query, key, value, mask, the term's tensors as one list (read back by
    :func:`.launch.term_tensors`), the dropout seed (or None), then the kernels' ``KIND`` code, activation, scaling,
    is_causal, hidden width, the dropout probability and the call's place in the whole it drops for. Keys, values and
    the term's tensors that multiply them are cast to the query's dtype."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads != 0 or value.shape[1] != kv_heads:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of the key/value heads ({kv_heads}, {value.shape[1]})."
        )
    dtype = query.dtype
    # Under autocast everything arrives in the autocast dtype already; otherwise align on the query's.
    key, value = key.to(dtype), value.to(dtype)
    kind, term = TERM_OPERANDS[inputs.term](inputs.tensors, dtype)
    scaling = float(inputs.term_scaling(scaling))
    seed, p, offsets = (
        (None, 0.0, [0, 0, 0, 0]) if dropout is None else (dropout.seed, dropout.p, list(dropout.offsets))
    )
    return (
        query, key, value, attention_mask, term, seed, kind, inputs.activation, scaling, bool(is_causal),
        inputs.hidden, p, offsets,
    )  # fmt: skip
