"""Leaf Triton helpers of the fused kernels: activations, tile loads, masking, softmax backward.

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
def softmax_backward(s, v, do, delta, row_max, row_sum, row_ok, PRECISION: tl.constexpr):
    """The tile's probabilities p, rebuilt from the forward's row statistics, and the gradient of its
    scores ds = p * (dO . v - delta) (softmax backward)."""
    p = tl.exp(s - row_max[:, None]) / row_sum[:, None]
    p = tl.where(row_ok[:, None], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return p, ds
