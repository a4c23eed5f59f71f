"""Fused Triton kernels for the QANA and Neural Attention scorers (FlashAttention style).

Importing this module needs ``triton``; :mod:`hf_neural_attn.ops.triton_fused` imports it only when a
kernel is about to run, so the package imports without triton. Set ``TRITON_INTERPRET=1`` *before* this
module is imported to run the kernels on CPU tensors through Triton's interpreter (the tests do).

Three kernels per call, each a grid of (block index, batch * heads) programs:

* ``_forward_kernel``: one program per block of queries; walks the key tiles with an online softmax and
  writes the output plus each row's maximum and normaliser (the chunked path keeps the same two numbers,
  for the same reason: rebuilding probabilities from a log-sum-exp would add an error ∝ |lse|).
* ``_backward_query_kernel``: one program per block of queries; recomputes each tile's scores and
  probabilities and accumulates every gradient indexed by query: dq, QANA's dU, dV, db, dc, Neural
  Attention's dP, and per-program partial sums for the gate and the output weights w (summed by torch
  afterwards, so the reduction is deterministic; no atomics anywhere).
* ``_backward_key_kernel``: one program per block of keys *per key/value head*; loops over the query heads
  of its group (grouped-query attention without repeating keys) and over the query blocks that can see it,
  accumulating dk, dv and Neural Attention's dR.

Scores of one tile, s_ij (fp32 whatever the input dtype; tensor-core products accumulate in fp32):

* QANA (``KIND == 0``): ``scaling * q_i.k_j + gate * (sum_l V_il act(U_il.k_j + b_il) + c_i)``. The h
  products ``U_il . k_j`` are one matrix product: the (BLOCK_M, h, D) tile of U is flattened to
  (BLOCK_M * h, D) rows, so they run on tensor cores like the dot product itself.
* Neural Attention residual (``KIND == 1``): ``scaling * q_i.k_j + gate * sum_m w_m act(P_im + R_jm)``.
* Neural Attention replace (``KIND == 2``): ``scaling * sum_m w_m act(P_im + R_jm)``.

then ``max(s + mask, finfo(float32).min)`` with the additive mask (as the reference clamps), ``-inf`` after
the causal diagonal when ``IS_CAUSAL`` (queries aligned to the end of the keys) and beyond the last key.
The explicit causal ``-inf`` makes skipping whole tiles exact in every kernel, including for rows that
the mask hides entirely: those get uniform weights over the keys at or before their own position.
"""

from __future__ import annotations

import triton
import triton.language as tl

QANA, NEURAL_RESIDUAL, NEURAL_REPLACE = 0, 1, 2
ACTIVATION_CODES = {"gelu": 0, "relu": 1, "silu": 2, "tanh": 3, "sigmoid": 4}

# torch.finfo(torch.float32).min: where the reference clamps masked scores.
FLOAT32_MIN: tl.constexpr = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _activation(x, ACT: tl.constexpr):
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
def _load_query_side(
    Q, U, QV, QB, QC, PQ,
    off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok,
    sqz, sqh, sqm, sqd,
    suz, suh, sul, sum_, sud,
    svz, svh, svm, svl,
    sbz, sbh, sbm, sbl,
    scz, sch, scm,
    spz, sph, spm, spl,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
):  # fmt: skip
    """Everything indexed by the queries of one block: q (BLOCK_M, BLOCK_D) in the input dtype, and either
    QANA's U flattened to (BLOCK_M * HID_PAD, BLOCK_D), V, b (BLOCK_M, HID_PAD) and c (BLOCK_M,) or Neural
    Attention's P (BLOCK_M, HID_PAD), the small ones in fp32. Padded rows, columns and units load as 0."""
    q = tl.load(
        Q + off_z * sqz + off_h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    rl_ok = row_ok[:, None] & l_ok[None, :]
    if KIND == 0:
        u = tl.load(
            U + off_z * suz + off_h * suh
            + offs_m[:, None, None] * sum_ + offs_l[None, :, None] * sul + offs_d[None, None, :] * sud,
            mask=rl_ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
        )  # fmt: skip
        u = tl.reshape(u, (BLOCK_M * HID_PAD, BLOCK_D))
        qv = tl.load(
            QV + off_z * svz + off_h * svh + offs_m[:, None] * svm + offs_l[None, :] * svl, mask=rl_ok, other=0.0
        ).to(tl.float32)
        qb = tl.load(
            QB + off_z * sbz + off_h * sbh + offs_m[:, None] * sbm + offs_l[None, :] * sbl, mask=rl_ok, other=0.0
        ).to(tl.float32)
        qc = tl.load(QC + off_z * scz + off_h * sch + offs_m * scm, mask=row_ok, other=0.0).to(tl.float32)
        pq = qv  # unused for QANA
    else:
        pq = tl.load(
            PQ + off_z * spz + off_h * sph + offs_m[:, None] * spm + offs_l[None, :] * spl, mask=rl_ok, other=0.0
        ).to(tl.float32)
        u = q
        qv = pq
        qb = pq
        qc = offs_m.to(tl.float32)
    return q, u, qv, qb, qc, pq


@triton.jit
def _tile_scores(
    q, k, u, qv, qb, qc, pq, rk, wo, gate,
    MASK, off_z, off_h, offs_m, offs_n, row_ok, col_ok, M, N, scaling,
    smz, smh, smm, smn,
    KIND: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HID_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Masked fp32 scores s (BLOCK_M, BLOCK_N) of one tile, the MLP term ``mlp`` before its gate/scale,
    and the hidden activations ``act`` and derivatives ``dact``, each (BLOCK_M, HID_PAD, BLOCK_N)."""
    if KIND == 0:
        hidden = tl.dot(u, tl.trans(k), input_precision=PRECISION)
        hidden = tl.reshape(hidden, (BLOCK_M, HID_PAD, BLOCK_N)) + qb[:, :, None]
        act, dact = _activation(hidden, ACT)
        mlp = tl.sum(act * qv[:, :, None], axis=1) + qc[:, None]
    else:
        hidden = pq[:, :, None] + tl.trans(rk)[None, :, :]
        act, dact = _activation(hidden, ACT)
        mlp = tl.sum(act * wo[None, :, None], axis=1)
    if KIND == 2:
        s = mlp * scaling
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling + gate * mlp
    if HAS_MASK:
        bias = tl.load(
            # int64 rows: n x n masks pass 2**31 elements from n = 46341 on.
            MASK + off_z * smz + off_h * smh + offs_m[:, None].to(tl.int64) * smm + offs_n[None, :] * smn,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        s = tl.maximum(s + bias, FLOAT32_MIN)
    if IS_CAUSAL:
        s = tl.where(offs_n[None, :] <= offs_m[:, None] + (N - M), s, float("-inf"))
    s = tl.where(col_ok[None, :], s, float("-inf"))
    return s, mlp, act, dact


@triton.jit
def _forward_kernel(
    Q, K, V, MASK, U, QV, QB, QC, PQ, RK, WO, GATE,
    O, ROW_MAX, ROW_SUM,
    sqz, sqh, sqm, sqd,
    skz, skh, skn, skd,
    svz_, svh_, svn_, svd_,
    smz, smh, smm, smn,
    suz, suh, sul, sum_, sud,
    sxz, sxh, sxm, sxl,
    sbz, sbh, sbm, sbl,
    scz, sch, scm,
    spz, sph, spm, spl,
    srz, srh, srn, srl,
    H, GROUPS, M, N, D, HID, scaling,
    KIND: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_z = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_hk = off_h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, HID_PAD)
    row_ok = offs_m < M
    d_ok = offs_d < D
    l_ok = offs_l < HID
    q, u, qv, qb, qc, pq = _load_query_side(
        Q, U, QV, QB, QC, PQ, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok,
        sqz, sqh, sqm, sqd, suz, suh, sul, sum_, sud, sxz, sxh, sxm, sxl, sbz, sbh, sbm, sbl,
        scz, sch, scm, spz, sph, spm, spl,
        KIND, BLOCK_M, BLOCK_D, HID_PAD,
    )  # fmt: skip
    gate = 0.0
    if KIND != 2:
        gate = tl.load(GATE + off_h).to(tl.float32)
    wo = tl.load(WO + offs_l, mask=l_ok, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = N
    if IS_CAUSAL:
        # Keys after the block's last query are hidden from every row of the block: not visited.
        hi = tl.minimum(N, tl.minimum((pid_m + 1) * BLOCK_M, M) + N - M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        kv_ok = col_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + off_z * skz + off_hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_ok, other=0.0
        )
        v = tl.load(
            V + off_z * svz_ + off_hk * svh_ + offs_n[:, None] * svn_ + offs_d[None, :] * svd_, mask=kv_ok, other=0.0
        )
        rk = wo[None, :]
        if KIND != 0:
            rk = tl.load(
                RK + off_z * srz + off_hk * srh + offs_n[:, None] * srn + offs_l[None, :] * srl,
                mask=col_ok[:, None] & l_ok[None, :],
                other=0.0,
            ).to(tl.float32)
        s, _, _, _ = _tile_scores(
            q, k, u, qv, qb, qc, pq, rk, wo, gate, MASK, off_z, off_h, offs_m, offs_n, row_ok, col_ok, M, N,
            scaling, smz, smh, smm, smn, KIND, ACT, HAS_MASK, IS_CAUSAL, BLOCK_M, BLOCK_N, HID_PAD, PRECISION,
        )  # fmt: skip
        # Every visited tile has a finite score in each row (a real key, at worst at the fp32 minimum), so
        # m_new is finite and the -inf entries give exp(-inf) = 0.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    base = pid_bh.to(tl.int64) * M
    tl.store(
        O + (base + offs_m[:, None]) * D + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(ROW_MAX + base + offs_m, m_i, mask=row_ok)
    tl.store(ROW_SUM + base + offs_m, l_i, mask=row_ok)


@triton.jit
def _backward_query_kernel(
    Q, K, V, MASK, U, QV, QB, QC, PQ, RK, WO, GATE,
    DO, DELTA, ROW_MAX, ROW_SUM,
    DQ, DU, DQV, DQB, DQC, DPQ, DGATE_PARTIAL, DWO_PARTIAL,
    sqz, sqh, sqm, sqd,
    skz, skh, skn, skd,
    svz_, svh_, svn_, svd_,
    smz, smh, smm, smn,
    suz, suh, sul, sum_, sud,
    sxz, sxh, sxm, sxl,
    sbz, sbh, sbm, sbl,
    scz, sch, scm,
    spz, sph, spm, spl,
    srz, srh, srn, srl,
    H, GROUPS, M, N, D, HID, scaling,
    KIND: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Gradients indexed by queries. Outputs are contiguous: DQ (B, H, M, D), DU (B, H, HID, M, D),
    DQV/DQB/DPQ (B, H, M, HID), DQC (B, H, M); partials DGATE_PARTIAL (B * H * blocks,) and
    DWO_PARTIAL (B * H * blocks, HID_PAD)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_z = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_hk = off_h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, HID_PAD)
    row_ok = offs_m < M
    d_ok = offs_d < D
    l_ok = offs_l < HID
    q, u, qv, qb, qc, pq = _load_query_side(
        Q, U, QV, QB, QC, PQ, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok,
        sqz, sqh, sqm, sqd, suz, suh, sul, sum_, sud, sxz, sxh, sxm, sxl, sbz, sbh, sbm, sbl,
        scz, sch, scm, spz, sph, spm, spl,
        KIND, BLOCK_M, BLOCK_D, HID_PAD,
    )  # fmt: skip
    gate = 0.0
    if KIND != 2:
        gate = tl.load(GATE + off_h).to(tl.float32)
    wo = tl.load(WO + offs_l, mask=l_ok, other=0.0).to(tl.float32)
    base = pid_bh.to(tl.int64) * M
    qd_ok = row_ok[:, None] & d_ok[None, :]
    do = tl.load(DO + (base + offs_m[:, None]) * D + offs_d[None, :], mask=qd_ok, other=0.0)
    delta = tl.load(DELTA + base + offs_m, mask=row_ok, other=0.0)
    row_max = tl.load(ROW_MAX + base + offs_m, mask=row_ok, other=0.0)
    row_sum = tl.load(ROW_SUM + base + offs_m, mask=row_ok, other=1.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    du = tl.zeros([BLOCK_M * HID_PAD, BLOCK_D], dtype=tl.float32)
    dhid = tl.zeros([BLOCK_M, HID_PAD], dtype=tl.float32)  # QANA: db; Neural: dP
    dqv = tl.zeros([BLOCK_M, HID_PAD], dtype=tl.float32)
    ds_rows = tl.zeros([BLOCK_M], dtype=tl.float32)
    dgate = tl.zeros([BLOCK_M], dtype=tl.float32)
    dwo = tl.zeros([HID_PAD], dtype=tl.float32)
    hi = N
    if IS_CAUSAL:
        hi = tl.minimum(N, tl.minimum((pid_m + 1) * BLOCK_M, M) + N - M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        kv_ok = col_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + off_z * skz + off_hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_ok, other=0.0
        )
        v = tl.load(
            V + off_z * svz_ + off_hk * svh_ + offs_n[:, None] * svn_ + offs_d[None, :] * svd_, mask=kv_ok, other=0.0
        )
        rk = wo[None, :]
        if KIND != 0:
            rk = tl.load(
                RK + off_z * srz + off_hk * srh + offs_n[:, None] * srn + offs_l[None, :] * srl,
                mask=col_ok[:, None] & l_ok[None, :],
                other=0.0,
            ).to(tl.float32)
        s, mlp, act, dact = _tile_scores(
            q, k, u, qv, qb, qc, pq, rk, wo, gate, MASK, off_z, off_h, offs_m, offs_n, row_ok, col_ok, M, N,
            scaling, smz, smh, smm, smn, KIND, ACT, HAS_MASK, IS_CAUSAL, BLOCK_M, BLOCK_N, HID_PAD, PRECISION,
        )  # fmt: skip
        p = tl.exp(s - row_max[:, None]) / row_sum[:, None]
        p = tl.where(row_ok[:, None], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])  # gradient of the scores, softmax backward
        if KIND != 2:
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
            dgate += tl.sum(ds * mlp, 1)
        if KIND == 0:
            ds_rows += tl.sum(ds, 1)
            dqv += tl.sum(ds[:, None, :] * act, 2)
            dhidden = (gate * ds)[:, None, :] * qv[:, :, None] * dact
            dhid += tl.sum(dhidden, 2)
            du += tl.dot(tl.reshape(dhidden, (BLOCK_M * HID_PAD, BLOCK_N)).to(k.dtype), k, input_precision=PRECISION)
        else:
            dmlp = ds * scaling
            if KIND == 1:
                dmlp = ds * gate
            dwo += tl.sum(tl.sum(dmlp[:, None, :] * act, 2), 0)
            dhid += tl.sum(dmlp[:, None, :] * wo[None, :, None] * dact, 2)

    if KIND != 2:
        tl.store(
            DQ + (base + offs_m[:, None]) * D + offs_d[None, :], (dq * scaling).to(DQ.dtype.element_ty), mask=qd_ok
        )
    hid_ptrs = (base + offs_m[:, None]) * HID + offs_l[None, :]
    hid_ok = row_ok[:, None] & l_ok[None, :]
    partial = pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m
    if KIND != 2:
        tl.store(DGATE_PARTIAL + partial, tl.sum(dgate, 0))
    if KIND == 0:
        # DU is (B, H, HID, M, D): unit l of query m sits at ((bh * HID + l) * M + m) * D.
        du3 = tl.reshape(du, (BLOCK_M, HID_PAD, BLOCK_D))
        du_ptrs = ((pid_bh.to(tl.int64) * HID + offs_l[None, :, None]) * M + offs_m[:, None, None]) * D + offs_d[
            None, None, :
        ]
        tl.store(DU + du_ptrs, du3.to(DU.dtype.element_ty), mask=hid_ok[:, :, None] & d_ok[None, None, :])
        tl.store(DQV + hid_ptrs, (dqv * gate).to(DQV.dtype.element_ty), mask=hid_ok)
        tl.store(DQB + hid_ptrs, dhid.to(DQB.dtype.element_ty), mask=hid_ok)
        tl.store(DQC + base + offs_m, (ds_rows * gate).to(DQC.dtype.element_ty), mask=row_ok)
    else:
        tl.store(DPQ + hid_ptrs, dhid.to(DPQ.dtype.element_ty), mask=hid_ok)
        tl.store(DWO_PARTIAL + partial * HID_PAD + offs_l, dwo)


@triton.jit
def _backward_key_kernel(
    Q, K, V, MASK, U, QV, QB, QC, PQ, RK, WO, GATE,
    DO, DELTA, ROW_MAX, ROW_SUM,
    DK, DV, DRK,
    sqz, sqh, sqm, sqd,
    skz, skh, skn, skd,
    svz_, svh_, svn_, svd_,
    smz, smh, smm, smn,
    suz, suh, sul, sum_, sud,
    sxz, sxh, sxm, sxl,
    sbz, sbh, sbm, sbl,
    scz, sch, scm,
    spz, sph, spm, spl,
    srz, srh, srn, srl,
    H, GROUPS, M, N, D, HID, scaling,
    KIND: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Gradients indexed by keys, one program per (key block, batch * kv head). Outputs are contiguous:
    DK, DV (B, H_kv, N, D) and DRK (B, H_kv, N, HID)."""
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    h_kv = H // GROUPS
    off_z = (pid_bhk // h_kv).to(tl.int64)
    off_hk = (pid_bhk % h_kv).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, HID_PAD)
    col_ok = offs_n < N
    d_ok = offs_d < D
    l_ok = offs_l < HID
    kv_ok = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + off_z * skz + off_hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_ok, other=0.0)
    v = tl.load(
        V + off_z * svz_ + off_hk * svh_ + offs_n[:, None] * svn_ + offs_d[None, :] * svd_, mask=kv_ok, other=0.0
    )
    wo = tl.load(WO + offs_l, mask=l_ok, other=0.0).to(tl.float32)
    rk = wo[None, :]
    if KIND != 0:
        rk = tl.load(
            RK + off_z * srz + off_hk * srh + offs_n[:, None] * srn + offs_l[None, :] * srl,
            mask=col_ok[:, None] & l_ok[None, :],
            other=0.0,
        ).to(tl.float32)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    drk = tl.zeros([BLOCK_N, HID_PAD], dtype=tl.float32)
    lo = 0
    if IS_CAUSAL:
        # Queries before this one can see none of the block's keys: their scores are all -inf.
        lo = tl.maximum(0, pid_n * BLOCK_N - (N - M))
    for group in range(GROUPS):
        off_h = off_hk * GROUPS + group
        gate = 0.0
        if KIND != 2:
            gate = tl.load(GATE + off_h).to(tl.float32)
        base = (off_z * H + off_h) * M
        for start_m in range(lo, M, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < M
            q, u, qv, qb, qc, pq = _load_query_side(
                Q, U, QV, QB, QC, PQ, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok,
                sqz, sqh, sqm, sqd, suz, suh, sul, sum_, sud, sxz, sxh, sxm, sxl, sbz, sbh, sbm, sbl,
                scz, sch, scm, spz, sph, spm, spl,
                KIND, BLOCK_M, BLOCK_D, HID_PAD,
            )  # fmt: skip
            do = tl.load(
                DO + (base + offs_m[:, None]) * D + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
            )
            delta = tl.load(DELTA + base + offs_m, mask=row_ok, other=0.0)
            row_max = tl.load(ROW_MAX + base + offs_m, mask=row_ok, other=0.0)
            row_sum = tl.load(ROW_SUM + base + offs_m, mask=row_ok, other=1.0)
            s, _, _, dact = _tile_scores(
                q, k, u, qv, qb, qc, pq, rk, wo, gate, MASK, off_z, off_h, offs_m, offs_n, row_ok, col_ok, M, N,
                scaling, smz, smh, smm, smn, KIND, ACT, HAS_MASK, IS_CAUSAL, BLOCK_M, BLOCK_N, HID_PAD, PRECISION,
            )  # fmt: skip
            p = tl.exp(s - row_max[:, None]) / row_sum[:, None]
            p = tl.where(row_ok[:, None], p, 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            if KIND != 2:
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION) * scaling
            if KIND == 0:
                dhidden = (gate * ds)[:, None, :] * qv[:, :, None] * dact
                dhidden = tl.reshape(dhidden, (BLOCK_M * HID_PAD, BLOCK_N))
                dk += tl.dot(tl.trans(dhidden).to(u.dtype), u, input_precision=PRECISION)
            else:
                dmlp = ds * scaling
                if KIND == 1:
                    dmlp = ds * gate
                drk += tl.trans(tl.sum(dmlp[:, None, :] * wo[None, :, None] * dact, 0))

    out_base = pid_bhk.to(tl.int64) * N
    tl.store(DK + (out_base + offs_n[:, None]) * D + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + (out_base + offs_n[:, None]) * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_ok)
    if KIND != 0:
        tl.store(
            DRK + (out_base + offs_n[:, None]) * HID + offs_l[None, :],
            drk.to(DRK.dtype.element_ty),
            mask=col_ok[:, None] & l_ok[None, :],
        )
