"""The query-network score term of the fused kernels (``KIND == 0``; QANA and the relative form of
Neural Attention hand it their inputs).

Per query i the kernel reads U_i (h, D), V_i (h,), b_i (h,), c_i and computes, for key j,

    mlp_ij = sum_l V_il act(U_il . k_j + b_il) + c_i

the h products ``U_il . k_j`` as one matrix product: the (BLOCK_M, h, D) tile of U is flattened to
(BLOCK_M * h, D) rows, so they run on tensor cores like the dot product itself. Gradients: dU, dV, db,
dc (indexed by queries, in the query-block backward kernel) and the term's share of dk (key-block
kernel). The shared kernels in :mod:`.common` call these helpers.

Importing this module needs ``triton``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .utils import activation, load_rows


@triton.jit
def load_query_side(
    U, QV, QB, QC,
    off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok, su, sx, sb, sc,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
):  # fmt: skip
    """U flattened to (BLOCK_M * HID_PAD, BLOCK_D) in the input dtype; V, b (BLOCK_M, HID_PAD) and c
    (BLOCK_M,) in fp32. Padded rows, columns and units load as 0."""
    rl_ok = row_ok[:, None] & l_ok[None, :]
    u = tl.load(
        U + off_z * su[0] + off_h * su[1]
        + offs_m[:, None, None] * su[3] + offs_l[None, :, None] * su[2] + offs_d[None, None, :] * su[4],
        mask=rl_ok[:, :, None] & d_ok[None, None, :],
        other=0.0,
    )  # fmt: skip
    u = tl.reshape(u, (BLOCK_M * HID_PAD, BLOCK_D))
    qv = load_rows(QV, off_z, off_h, offs_m, offs_l, row_ok, l_ok, sx)
    qb = load_rows(QB, off_z, off_h, offs_m, offs_l, row_ok, l_ok, sb)
    qc = tl.load(QC + off_z * sc[0] + off_h * sc[1] + offs_m * sc[2], mask=row_ok, other=0.0).to(tl.float32)
    return u, qv, qb, qc


@triton.jit
def mlp_term(
    u, qv, qb, qc, k,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HID_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """mlp (BLOCK_M, BLOCK_N) of one tile, with the hidden activations ``act`` and their derivatives
    ``dact``, each (BLOCK_M, HID_PAD, BLOCK_N)."""
    hidden = tl.dot(u, tl.trans(k), input_precision=PRECISION)
    hidden = tl.reshape(hidden, (BLOCK_M, HID_PAD, BLOCK_N)) + qb[:, :, None]
    act, dact = activation(hidden, ACT)
    mlp = tl.sum(act * qv[:, :, None], axis=1) + qc[:, None]
    return mlp, act, dact


@triton.jit
def hidden_grad(ds, dact, qv, gate):
    """Gradient of the hidden pre-activations U_il . k_j + b_il, (BLOCK_M, HID_PAD, BLOCK_N)."""
    return (gate * ds)[:, None, :] * qv[:, :, None] * dact


@triton.jit
def accumulate_query_grads(
    du, dqv, db, dc, ds, act, dact, qv, gate, k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HID_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Adds one key tile's share to dU (flattened like u), dV/gate, db and dc/gate."""
    dc += tl.sum(ds, 1)
    dqv += tl.sum(ds[:, None, :] * act, 2)
    dhidden = hidden_grad(ds, dact, qv, gate)
    db += tl.sum(dhidden, 2)
    du += tl.dot(tl.reshape(dhidden, (BLOCK_M * HID_PAD, BLOCK_N)).to(k.dtype), k, input_precision=PRECISION)
    return du, dqv, db, dc


@triton.jit
def accumulate_key_grad(
    dk, ds, dact, qv, gate, u,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HID_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Adds one query tile's share of the term's gradient to dk (BLOCK_N, BLOCK_D)."""
    dhidden = hidden_grad(ds, dact, qv, gate)
    dhidden = tl.reshape(dhidden, (BLOCK_M * HID_PAD, BLOCK_N))
    dk += tl.dot(tl.trans(dhidden).to(u.dtype), u, input_precision=PRECISION)
    return dk


@triton.jit
def store_query_grads(
    DU, DQV, DQB, DQC, du, dqv, db, dc, gate,
    pid_bh, base, offs_m, offs_d, offs_l, row_ok, d_ok, hid_ptrs, hid_ok, M, D, HID,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
):  # fmt: skip
    """Stores dU (B, H, HID, M, D), dV, db (B, H, M, HID) and dc (B, H, M), all contiguous."""
    # DU is (B, H, HID, M, D): unit l of query m sits at ((bh * HID + l) * M + m) * D.
    du3 = tl.reshape(du, (BLOCK_M, HID_PAD, BLOCK_D))
    du_ptrs = ((pid_bh.to(tl.int64) * HID + offs_l[None, :, None]) * M + offs_m[:, None, None]) * D + offs_d[
        None, None, :
    ]
    tl.store(DU + du_ptrs, du3.to(DU.dtype.element_ty), mask=hid_ok[:, :, None] & d_ok[None, None, :])
    tl.store(DQV + hid_ptrs, (dqv * gate).to(DQV.dtype.element_ty), mask=hid_ok)
    tl.store(DQB + hid_ptrs, db.to(DQB.dtype.element_ty), mask=hid_ok)
    tl.store(DQC + base + offs_m, (dc * gate).to(DQC.dtype.element_ty), mask=row_ok)
