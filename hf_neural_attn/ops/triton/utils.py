"""Leaf Triton helpers of the fused kernels: activations, tile loads, masking, attention dropout, softmax backward.

Importing this module needs ``triton``. Nothing here knows which scoring function a kernel computes.
"""

from __future__ import annotations

import triton
import triton.language as tl

ACTIVATION_CODES = {"gelu": 0, "relu": 1, "silu": 2, "tanh": 3, "sigmoid": 4}

# torch.finfo(torch.float32).min: where the reference clamps masked scores.
FLOAT32_MIN: tl.constexpr = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def activation(x, ACT: tl.constexpr):
    """act(x) and act'(x), in fp32. gelu is the erf form (torch's default)."""
    if ACT == 0:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        y = x * cdf
        dy = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif ACT == 1:
        y = tl.maximum(x, 0.0)
        dy = tl.where(x > 0.0, 1.0, 0.0)  # torch's relu backward gives 0 at x == 0
    elif ACT == 2:
        sig = tl.sigmoid(x)
        y = x * sig
        dy = sig * (1.0 + x * (1.0 - sig))
    elif ACT == 3:
        y = 2.0 * tl.sigmoid(2.0 * x) - 1.0  # tanh; core tl has no tanh that also runs in the interpreter
        dy = 1.0 - y * y
    else:
        y = tl.sigmoid(x)
        dy = y * (1.0 - y)
    return y, dy


@triton.jit
def load_rows(PTR, off_z, off_h, offs_m, offs_l, row_ok, l_ok, stride):
    """A (BLOCK_M, HID_PAD) tile of a (batch, heads, rows, units) tensor with strides ``stride``, in fp32;
    padding loads as 0."""
    return tl.load(
        PTR + off_z * stride[0] + off_h * stride[1] + offs_m[:, None] * stride[2] + offs_l[None, :] * stride[3],
        mask=row_ok[:, None] & l_ok[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def load_key_tile(K, V, off_z, off_hk, offs_n, offs_d, col_ok, d_ok, sk, sv):
    """The (BLOCK_N, BLOCK_D) key and value tiles of key/value head ``off_hk``, in the input dtype."""
    kv_ok = col_ok[:, None] & d_ok[None, :]
    k = tl.load(
        K + off_z * sk[0] + off_hk * sk[1] + offs_n[:, None] * sk[2] + offs_d[None, :] * sk[3], mask=kv_ok, other=0.0
    )
    v = tl.load(
        V + off_z * sv[0] + off_hk * sv[1] + offs_n[:, None] * sv[2] + offs_d[None, :] * sv[3], mask=kv_ok, other=0.0
    )
    return k, v


@triton.jit
def mask_scores(
    s, MASK, off_z, off_h, offs_m, offs_n, row_ok, col_ok, M, N, sm, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr
):
    """``max(s + mask, finfo(float32).min)`` with the additive mask (as the reference clamps), ``-inf``
    after the causal diagonal when ``IS_CAUSAL`` (queries aligned to the end of the keys) and beyond the
    last key."""
    if HAS_MASK:
        bias = tl.load(
            # int64 rows: n x n masks pass 2**31 elements from n = 46341 on.
            MASK + off_z * sm[0] + off_h * sm[1] + offs_m[:, None].to(tl.int64) * sm[2] + offs_n[None, :] * sm[3],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        s = tl.maximum(s + bias, FLOAT32_MIN)
    if IS_CAUSAL:
        s = tl.where(offs_n[None, :] <= offs_m[:, None] + (N - M), s, float("-inf"))
    s = tl.where(col_ok[None, :], s, float("-inf"))
    return s


@triton.jit
def load_row_stats(DO, DELTA, ROW_MAX, ROW_SUM, base, offs_m, offs_d, row_ok, d_ok, D):
    """What the backward kernels read per query row: dO (BLOCK_M, BLOCK_D), delta = dO . O, and the
    forward's row maximum and normaliser."""
    do = tl.load(DO + (base + offs_m[:, None]) * D + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    delta = tl.load(DELTA + base + offs_m, mask=row_ok, other=0.0)
    row_max = tl.load(ROW_MAX + base + offs_m, mask=row_ok, other=0.0)
    row_sum = tl.load(ROW_SUM + base + offs_m, mask=row_ok, other=1.0)
    return do, delta, row_max, row_sum


@triton.jit
def softmax_backward(
    s, v, do, delta, row_max, row_sum, row_ok, drop, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr
):
    """The tile's probabilities p, rebuilt from the forward's row statistics, and the gradient of its
    scores ds = p * (dO . v - delta) (softmax backward).

    With ``HAS_DROPOUT``, ``drop`` is the tile's dropout factors (:func:`dropout_factors`): the forward's output is
    (p * drop) @ v, so the gradient reaching p is (dO . v) * drop, and ``delta`` = dO . O (O the dropped output)
    is still rowsum(p * that gradient). p is returned as the probabilities the values saw (p * drop)."""
    p = tl.exp(s - row_max[:, None]) / row_sum[:, None]
    p = tl.where(row_ok[:, None], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if HAS_DROPOUT:
        dp = dp * drop
    ds = p * (dp - delta[:, None])
    if HAS_DROPOUT:
        p = p * drop
    return p, ds


# The dropout hash of hf_neural_attn.ops.dropout (its module doc has the design), in uint32 arithmetic: the torch
# version carries 32-bit words in int64 and masks every product back to 32 bits; Triton's unsigned multiplication
# wraps modulo 2**32, which is the same arithmetic. tests/ops/test_triton.py checks that the two keep the same
# entries.
@triton.jit
def mix32(x):
    """``lowbias32`` on uint32 words: a bijection that spreads every input bit."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def dropout_row_hashes(seed, stream, offs_m, row_offset):
    """Each query row's hash (BLOCK_M,) uint32, for the probabilities of ``stream`` (``batch * heads + head`` in
    the whole the call drops for): ``ops.dropout.keep_mask``'s ``row_hashes``. ``offs_m`` are the rows' positions in
    the call, ``row_offset`` the call's first row in that whole."""
    key = mix32(mix32((stream ^ seed).to(tl.uint32)))
    rows = (offs_m + row_offset).to(tl.uint32)
    return mix32(key + rows * 0x9E3779B9)


@triton.jit
def dropout_factors(row_hashes, offs_n, threshold, scale):
    """A tile's dropout as fp32 factors (BLOCK_M, BLOCK_N): ``scale`` = 1 / (1 - p) where the entry is kept (its
    hash at least ``threshold`` = round(p * 2**32), capped at 2**32 - 1 with ``scale`` 0 for p = 1), else 0."""
    columns = mix32(offs_n.to(tl.uint32) + 0x632BE5AB)
    entries = row_hashes[:, None] ^ columns[None, :]
    entries ^= entries >> 15
    entries *= 0x846CA68B
    # uint32 against uint32 whatever integer type the launch gave the threshold (it depends on the value).
    return tl.where(entries >= threshold.to(tl.uint32), scale, 0.0)
