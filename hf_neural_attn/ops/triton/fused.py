"""The torch side of the fused kernels: what they accept, one ``torch.autograd.Function``, the launches.

This module imports without triton; it imports the kernels of :mod:`.common` only when one is about to
run. It sees tensors and a few static values (:class:`~hf_neural_attn.ops.terms.FusedInputs`, whose module doc
lists each term's tensors), never a scorer.

Backward returns the gradients of the term's tensors; torch autograd carries them back to whatever produced
them. For the ``"neural"`` term, R comes from the keys *before* they are repeated for grouped-query attention:
head ``i`` reads key/value head ``i // groups``, nothing is repeated.

Numerics: scores, softmax statistics and every accumulation are fp32 whatever the input dtype. In fp32,
products use full fp32 precision unless ``torch.backends.cuda.matmul.allow_tf32`` is set, as torch's own
matmuls do. Rows that the mask hides entirely (left padding) get uniform weights over the keys at or
before their position; the reference spreads them over all keys. Their outputs carry no information on
either path.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..terms import TERMS, FusedInputs

SUPPORTED_ACTIVATIONS = ("gelu", "relu", "silu", "tanh", "sigmoid")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The h hidden units of a tile are unrolled into (BLOCK_M * h, BLOCK_N) fp32 registers; beyond this the
# tile no longer fits and the chunked path is the better choice.
MAX_HIDDEN = 16
MAX_HEAD_DIM = 256

# Tile sizes (BLOCK_M queries, BLOCK_N keys) of the forward kernel and of the two backward kernels; None
# picks them by device (see _block_sizes). Tests set small ones so that short sequences span several tiles
# under the interpreter. Any tiling gives the same result: the kernels mask every position themselves.
BLOCK_SIZES: tuple[int, int] | None = None
BACKWARD_BLOCK_SIZES: tuple[int, int] | None = None

# The kernels' KIND codes (see :mod:`.common`).
QANA, NEURAL_RESIDUAL, NEURAL_REPLACE = 0, 1, 2


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
) -> torch.Tensor:
    """softmax(scores + mask) @ v, the scores given by ``inputs``' term, with the fused kernels.

    Args:
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing heads (grouped-query
            attention); repeated keys (kv_heads == heads) work too.
        attention_mask: additive float mask broadcastable to (batch, heads, q_len, kv_len), or None.
        is_causal: the mask is causal, with queries aligned to the end of the keys. The kernels then skip
            the tiles it hides entirely and mask after the diagonal themselves.

    Returns:
        output (batch, heads, q_len, head_dim). The caller has checked the call with
        :func:`inputs_unsupported_reason` and :func:`mlp_unsupported_reason`.
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads != 0 or value.shape[1] != kv_heads:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of the key/value heads ({kv_heads}, {value.shape[1]})."
        )
    if inputs.term not in TERMS:
        raise ValueError(f"the fused kernels have no score term {inputs.term!r} (they have {list(TERMS)})")
    dtype = query.dtype
    # Under autocast everything arrives in the autocast dtype already; otherwise align on the query's.
    key, value = key.to(dtype), value.to(dtype)
    if inputs.term == "qana":
        U, V, b, c, gate = inputs.tensors
        kind = QANA
        tensors = (U.to(dtype), V, b, c, gate)
    else:
        P, R, w, gate = inputs.tensors
        kind = NEURAL_RESIDUAL if gate is not None else NEURAL_REPLACE
        tensors = (P.to(dtype), R.to(dtype), w, gate)
    meta = _Meta(kind, inputs.activation, float(inputs.term_scaling(scaling)), bool(is_causal), inputs.hidden)
    return _FusedAttention.apply(meta, attention_mask, query, key, value, *tensors)


@dataclass(frozen=True)
class _Meta:
    kind: int  # QANA, NEURAL_RESIDUAL or NEURAL_REPLACE
    activation: str
    scaling: float
    is_causal: bool
    hidden: int


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block_sizes(hid_pad: int, device: torch.device, backward: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the forward kernel or the two backward kernels.

    Not tuned by timing (no GPU has run these kernels yet). Chosen, for bf16 and head_dim 64 on sm_90, as
    the candidates ptxas compiled with the fewest register spills: a tile keeps BLOCK_M x h x BLOCK_N fp32
    hidden activations and their derivatives in registers, so wider h gets smaller tiles. At h = 4 that is
    no spill in the QANA forward and 100-260 bytes per thread in the backward kernels; at h = 8 the
    backward kernels still spill about 1.5 KB.
    """
    override = BACKWARD_BLOCK_SIZES if backward else BLOCK_SIZES
    if override is not None:
        return (*override, 4)
    if device.type != "cuda":
        return 16, 16, 4  # the interpreter: one numpy op per tile op, so fewer, larger tiles are faster
    if not backward:
        return (64, 64, 8) if hid_pad <= 2 else (64, 32, 4) if hid_pad <= 4 else (64, 32, 8)
    return (64, 32, 8) if hid_pad <= 4 else (32, 32, 4)


def _strides(tensor: torch.Tensor | None, count: int) -> tuple[int, ...]:
    return tuple(tensor.stride()[:count]) if tensor is not None else (0,) * count


def _launch_args(meta: _Meta, mask, q, k, v, tensors, backward: bool):
    """Pointer and stride arguments shared by the three kernels, in their order, plus the constexprs."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if meta.kind == QANA:
        U, QV, QB, QC, gate = tensors
        P = R = None
        w = QV  # any tensor: the query-network kernels never read w
    else:
        P, R, w, gate = tensors
        U = QV = QB = QC = None
    if mask is not None:
        mask = mask.expand(batch, heads, q_len, kv_len)  # broadcast dimensions get stride 0, no copy
    dummy = q
    pointers = [q, k, v, mask, U, QV, QB, QC, P, R, w, gate]
    pointers = [dummy if t is None else t for t in pointers]
    # One tuple per tensor: sq, sk, sv, sm, su, sx, sb, sc, sp, sr in the kernels.
    strides = (
        _strides(q, 4), _strides(k, 4), _strides(v, 4), _strides(mask, 4), _strides(U, 5),
        _strides(QV, 4), _strides(QB, 4), _strides(QC, 3), _strides(P, 4), _strides(R, 4),
    )  # fmt: skip
    sizes = (heads, heads // kv_heads, q_len, kv_len, head_dim, meta.hidden, meta.scaling)
    interpreting = q.device.type != "cuda"
    hid_pad = _next_power_of_2(meta.hidden)
    block_m, block_n, num_warps = _block_sizes(hid_pad, q.device, backward)
    block_d = _next_power_of_2(head_dim) if interpreting else max(16, _next_power_of_2(head_dim))
    fp32_products = q.dtype == torch.float32 and (interpreting or not torch.backends.cuda.matmul.allow_tf32)
    from .utils import ACTIVATION_CODES

    constexprs = {
        "KIND": meta.kind,
        "ACT": ACTIVATION_CODES[meta.activation],
        "HAS_MASK": mask is not None,
        "IS_CAUSAL": meta.is_causal,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "HID_PAD": hid_pad,
        "PRECISION": "ieee" if fp32_products else "tf32",
    }
    return pointers, strides, sizes, constexprs, num_warps


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta: _Meta, mask, q, k, v, *tensors):
        from .common import forward_kernel

        pointers, strides, sizes, constexprs, num_warps = _launch_args(meta, mask, q, k, v, tensors, False)
        batch, heads, q_len, head_dim = q.shape
        out = torch.empty(batch, heads, q_len, head_dim, dtype=v.dtype, device=q.device)
        row_max = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
        row_sum = torch.empty_like(row_max)
        grid = (math.ceil(q_len / constexprs["BLOCK_M"]), batch * heads)
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            forward_kernel[grid](
                *pointers, out, row_max, row_sum, *strides, *sizes, **constexprs, num_warps=num_warps, num_stages=2
            )
        ctx.meta = meta
        ctx.save_for_backward(mask, q, k, v, out, row_max, row_sum, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from .common import backward_key_kernel, backward_query_kernel

        meta: _Meta = ctx.meta
        mask, q, k, v, out, row_max, row_sum, *tensors = ctx.saved_tensors
        pointers, strides, sizes, constexprs, num_warps = _launch_args(meta, mask, q, k, v, tensors, True)
        batch, heads, q_len, head_dim = q.shape
        kv_heads, kv_len = k.shape[1], k.shape[2]
        hidden, device = meta.hidden, q.device
        grad_out = grad_out.contiguous()
        # rowsum(P * dP) = dO . O per query row (FlashAttention's "delta"), in fp32.
        delta = (grad_out.float() * out.float()).sum(-1).contiguous()
        stats = (grad_out, delta, row_max, row_sum)

        block_m, block_n = constexprs["BLOCK_M"], constexprs["BLOCK_N"]
        query_blocks = math.ceil(q_len / block_m)
        dq = torch.empty(batch, heads, q_len, head_dim, dtype=q.dtype, device=device)
        dk = torch.empty(batch, kv_heads, kv_len, head_dim, dtype=k.dtype, device=device)
        dv = torch.empty(batch, kv_heads, kv_len, head_dim, dtype=v.dtype, device=device)
        dgate_partial = torch.zeros(batch * heads * query_blocks, dtype=torch.float32, device=device)
        dw_partial = torch.zeros(
            batch * heads * query_blocks, constexprs["HID_PAD"], dtype=torch.float32, device=device
        )
        if meta.kind == QANA:
            U, QV, QB, QC, gate = tensors
            dU = torch.empty(batch, heads, hidden, q_len, head_dim, dtype=U.dtype, device=device)
            dQV = torch.empty(batch, heads, q_len, hidden, dtype=QV.dtype, device=device)
            dQB = torch.empty(batch, heads, q_len, hidden, dtype=QB.dtype, device=device)
            dQC = torch.empty(batch, heads, q_len, 1, dtype=QC.dtype, device=device)
            dP = dR = q  # unused by the query-network kernels
        else:
            P, R, w, gate = tensors
            dP = torch.empty(batch, heads, q_len, hidden, dtype=P.dtype, device=device)
            dR = torch.empty(batch, kv_heads, kv_len, hidden, dtype=R.dtype, device=device)
            dU = dQV = dQB = dQC = q  # unused by the pair-MLP kernels

        launch = dict(**constexprs, num_warps=num_warps, num_stages=2)
        with torch.cuda.device(device) if q.is_cuda else contextlib.nullcontext():
            backward_query_kernel[(query_blocks, batch * heads)](
                *pointers, *stats, dq, dU, dQV, dQB, dQC, dP, dgate_partial, dw_partial, *strides, *sizes, **launch
            )
            backward_key_kernel[(math.ceil(kv_len / block_n), batch * kv_heads)](
                *pointers, *stats, dk, dv, dR, *strides, *sizes, **launch
            )
        # Per-program partial sums, reduced here in a fixed order: deterministic, unlike atomics.
        dgate = None if gate is None else dgate_partial.view(batch, heads, query_blocks).sum((0, 2)).to(gate.dtype)
        if meta.kind == QANA:
            grads = (dU, dQV, dQB, dQC, dgate)
        else:
            dw = dw_partial[:, :hidden].sum(0).to(w.dtype)
            grads = (dP, dR, dw, dgate)
        dq = None if meta.kind == NEURAL_REPLACE else dq
        return None, None, dq, dk, dv, *grads
