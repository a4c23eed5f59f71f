"""The fused attention kernels every scoring term shares (FlashAttention style), and their one tile-score
helper.

Importing this module needs ``triton``; :mod:`.custom_ops`, the torch operators that launch the kernels, imports
it, and :mod:`.fused` imports that on its first call, so the package imports without triton. Set
``TRITON_INTERPRET=1`` *before* this module is imported to run the kernels on CPU tensors through Triton's
interpreter (the tests do).

Three kernels per call, each a grid of (block index, batch * heads) programs:

* ``forward_kernel``: one program per block of queries; walks the key tiles with an online softmax and
  writes the output plus each row's maximum and normaliser (the chunked path keeps the same two numbers,
  for the same reason: rebuilding probabilities from a log-sum-exp would add an error ∝ |lse|).
* ``backward_query_kernel``: one program per block of queries; recomputes each tile's scores and
  probabilities and accumulates every gradient indexed by query: dq, the query-network term's dU, dV, db,
  dc, the pair-MLP term's dP, and per-program partial sums for the gate and the output weights w (summed
  by torch afterwards, so the reduction is deterministic; no atomics anywhere).
* ``backward_key_kernel``: one program per block of keys *per key/value head*; loops over the query heads
  of its group (grouped-query attention without repeating keys) and over the query blocks that can see it,
  accumulating dk, dv and the pair-MLP term's dR.

All three, and the paged kernel of a serving step (:mod:`.paged_kernel`), get a tile's scores from
:func:`tile_scores`, s_ij in fp32 whatever the input dtype (tensor-core products accumulate in fp32), by the score
term ``KIND``:

* ``KIND == 0`` (:mod:`.query_network`): ``scaling * q_i.k_j + gate * (sum_l V_il act(U_il.k_j + b_il) + c_i)``.
* ``KIND == 1`` (:mod:`.pair_mlp`, residual): ``scaling * q_i.k_j + gate * sum_m w_m act(P_im + R_jm)``.
* ``KIND == 2`` (:mod:`.pair_mlp`, replace): ``scaling * sum_m w_m act(P_im + R_jm)``; an unscaled replace form
  (``FusedInputs.replace_scaled`` False) is launched with ``scaling = 1``.

then ``max(s + mask, finfo(float32).min)`` with the additive mask (as the reference clamps), ``-inf`` after
the causal diagonal when ``IS_CAUSAL`` (queries aligned to the end of the keys) and beyond the last key.

Attention dropout (``HAS_DROPOUT``): each tile's probabilities are multiplied by its dropout factors
(:func:`tile_dropout`: 0 where dropped, 1 / (1 - p) where kept) after the softmax's normaliser is taken, in the
forward kernel before the values are summed and in both backward kernels where the probabilities are rebuilt. The
factors are a hash of the call's seed, the probabilities' stream (``batch * heads + head`` in the whole the call drops
for), the query row and the key column (:func:`.utils.dropout_row_hashes`, :func:`.utils.dropout_factors`): the hash
of :mod:`hf_neural_attn.ops.dropout`, so the kernels drop the entries every other path drops for a seed, and no mask
is stored.
The explicit causal ``-inf`` makes skipping whole tiles exact in every kernel, including for rows that
the mask hides entirely: those get uniform weights over the keys at or before their own position.

The kernels take the pointers of both terms (the unused ones are dummies) and branch on ``KIND`` at
compile time. Strides reach the helpers as one tuple per tensor: ``sq, sk, sv, sm`` for q, k, v and the mask
(batch, head, row, column), ``su`` for U (batch, head, unit, query, dim), ``sx, sb, sc`` for V, b, c and
``sp, sr`` for P and R. The kernels take them as 40 scalars and build the tuples (:func:`stride_tuples`): inductor
(torch 2.11) cannot pass tuple arguments to a user's Triton kernel, so ``torch.compile`` of a model on these kernels
failed on a GPU with tuples in the signature.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import pair_mlp, query_network
from .utils import (
    dropout_factors,
    dropout_row_hashes,
    load_key_tile,
    load_row_stats,
    load_rows,
    mask_scores,
    softmax_backward,
)

# The dropout values each kernel takes after its sizes (see launch.launch_args), none of them specialised on: a
# fresh seed every call must not compile a fresh kernel (Triton specialises integers equal to 1 or divisible by 16).
DROPOUT_VALUES = ["seed", "drop_stream_base", "drop_stream_stride", "drop_row_offset", "drop_threshold"]


@triton.jit
def block_dropout_rows(
    seed, off_z, off_h, offs_m, drop_stream_base, drop_stream_stride, drop_row_offset, HAS_DROPOUT: tl.constexpr
):
    """The row hashes (:func:`.utils.dropout_row_hashes`) of query rows ``offs_m`` of batch ``off_z``, head
    ``off_h``, whose probabilities are stream ``off_z * drop_stream_stride + off_h + drop_stream_base`` of the whole
    the call drops for (``ops.dropout.AttentionDropout.streams``); a placeholder without dropout."""
    hashes = offs_m
    if HAS_DROPOUT:
        stream = off_z * drop_stream_stride + off_h + drop_stream_base
        hashes = dropout_row_hashes(seed, stream, offs_m, drop_row_offset)
    return hashes


@triton.jit
def tile_dropout(row_hashes, start_n, drop_threshold, drop_scale, BLOCK_N: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """The dropout factors (BLOCK_M, BLOCK_N) of the key tile starting at ``start_n``
    (:func:`.utils.dropout_factors`); 1 without dropout."""
    factors = 1.0
    if HAS_DROPOUT:
        factors = dropout_factors(row_hashes, start_n + tl.arange(0, BLOCK_N), drop_threshold, drop_scale)
    return factors


@triton.jit
def stride_tuples(
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sm0, sm1, sm2, sm3,
    su0, su1, su2, su3, su4, sx0, sx1, sx2, sx3, sb0, sb1, sb2, sb3, sc0, sc1, sc2,
    sp0, sp1, sp2, sp3, sr0, sr1, sr2, sr3,
):  # fmt: skip
    """The kernels' 40 stride scalars as one tuple per tensor, in the order of launch.launch_args."""
    return (
        (sq0, sq1, sq2, sq3), (sk0, sk1, sk2, sk3), (sv0, sv1, sv2, sv3), (sm0, sm1, sm2, sm3),
        (su0, su1, su2, su3, su4), (sx0, sx1, sx2, sx3), (sb0, sb1, sb2, sb3), (sc0, sc1, sc2),
        (sp0, sp1, sp2, sp3), (sr0, sr1, sr2, sr3),
    )  # fmt: skip


@triton.jit
def load_query_side(
    Q, U, QV, QB, QC, PQ, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok, sq, su, sx, sb, sc, sp,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
):  # fmt: skip
    """Everything indexed by the queries of one block, as one tuple ``(q, u, qv, qb, qc, pq)``: q
    (BLOCK_M, BLOCK_D) in the input dtype, and either the query-network slices u, qv, qb, qc (see
    :func:`.query_network.load_query_side`) or the pair-MLP's P (BLOCK_M, HID_PAD) in fp32 (the other entries are
    placeholders). Padded rows, columns and units load as 0."""
    q = tl.load(
        Q + off_z * sq[0] + off_h * sq[1] + offs_m[:, None] * sq[2] + offs_d[None, :] * sq[3],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if KIND == 0:
        u, qv, qb, qc = query_network.load_query_side(
            U, QV, QB, QC, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok, su, sx, sb, sc,
            BLOCK_M, BLOCK_D, HID_PAD,
        )  # fmt: skip
        pq = qv  # unused by this term
    else:
        pq = load_rows(PQ, off_z, off_h, offs_m, offs_l, row_ok, l_ok, sp)
        u = q
        qv = pq
        qb = pq
        qc = offs_m.to(tl.float32)
    return (q, u, qv, qb, qc, pq)


@triton.jit
def load_key_side(
    K, V, RK, wo, off_z, off_hk, offs_n, offs_d, offs_l, col_ok, d_ok, l_ok, sk, sv, sr, KIND: tl.constexpr
):
    """Everything indexed by the keys of one tile: k and v (BLOCK_N, BLOCK_D) in the input dtype, and the
    pair-MLP's R (BLOCK_N, HID_PAD) in fp32 (a placeholder for the query-network term)."""
    k, v = load_key_tile(K, V, off_z, off_hk, offs_n, offs_d, col_ok, d_ok, sk, sv)
    rk = wo[None, :]
    if KIND != 0:
        rk = load_rows(RK, off_z, off_hk, offs_n, offs_l, col_ok, l_ok, sr)
    return k, v, rk


@triton.jit
def load_gate(GATE, off_h, KIND: tl.constexpr):
    """The head's gate in fp32 (0 for the replace form, which has none)."""
    gate = 0.0
    if KIND != 2:
        gate = tl.load(GATE + off_h).to(tl.float32)
    return gate


@triton.jit
def program_block(H, LEN, D, HID, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr):
    """What a (block, batch * head) program works on: its block index, its (batch * head) index, batch,
    head, the block's row offsets, the head-dim and unit offsets, and which of them are in range (``LEN``
    rows, ``D`` dims, ``HID`` units)."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_z = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, HID_PAD)
    return pid, pid_bh, off_z, off_h, offs, offs_d, offs_l, offs < LEN, offs_d < D, offs_l < HID


@triton.jit
def query_block(
    Q, U, QV, QB, QC, PQ, WO, GATE, sq, su, sx, sb, sc, sp, H, GROUPS, M, D, HID,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
):  # fmt: skip
    """The block of queries of a (query block, batch * head) program, for the forward and the query-block
    backward kernels: its indices and masks, and what :func:`query_operands` loads for it."""
    pid_m, pid_bh, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok = program_block(
        H, M, D, HID, BLOCK_M, BLOCK_D, HID_PAD
    )
    qs, gate, wo = query_operands(
        Q, U, QV, QB, QC, PQ, WO, GATE, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok,
        sq, su, sx, sb, sc, sp, KIND, BLOCK_M, BLOCK_D, HID_PAD,
    )  # fmt: skip
    return pid_m, pid_bh, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok, qs, gate, wo


@triton.jit
def query_operands(
    Q, U, QV, QB, QC, PQ, WO, GATE, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok,
    sq, su, sx, sb, sc, sp, KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
):  # fmt: skip
    """What a block of queries (rows ``offs_m`` of batch ``off_z``, head ``off_h``) scores with: what
    :func:`load_query_side` loads, the head's gate and the output weights w (fp32, zero-padded to HID_PAD)."""
    qs = load_query_side(
        Q, U, QV, QB, QC, PQ, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok, sq, su, sx, sb, sc, sp,
        KIND, BLOCK_M, BLOCK_D, HID_PAD,
    )  # fmt: skip
    gate = load_gate(GATE, off_h, KIND)
    wo = tl.load(WO + offs_l, mask=l_ok, other=0.0).to(tl.float32)
    return qs, gate, wo


@triton.jit
def key_end(pid_m, M, N, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """One past the last key the query block ``pid_m`` visits."""
    hi = N
    if IS_CAUSAL:
        # Keys after the block's last query are hidden from every row of the block: not visited.
        hi = tl.minimum(N, tl.minimum((pid_m + 1) * BLOCK_M, M) + N - M)
    return hi


@triton.jit
def tile_scores(
    qs, k, rk, wo, gate, MASK, off_z, off_h, offs_m, offs_n, row_ok, col_ok, M, N, scaling, sm,
    KIND: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HID_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Masked fp32 scores s (BLOCK_M, BLOCK_N) of one tile, the score term ``mlp`` before its gate/scale,
    and the hidden activations ``act`` and derivatives ``dact``, each (BLOCK_M, HID_PAD, BLOCK_N). The one
    place the forward, both backward and the paged kernel compute scores. ``qs``: what :func:`load_query_side`
    loaded; ``k``, ``rk``: what :func:`load_key_side` loaded."""
    q, u, qv, qb, qc, pq = qs
    if KIND == 0:
        mlp, act, dact = query_network.mlp_term(u, qv, qb, qc, k, ACT, BLOCK_M, BLOCK_N, HID_PAD, PRECISION)
    else:
        mlp, act, dact = pair_mlp.mlp_term(pq, rk, wo, ACT)
    if KIND == 2:
        s = mlp * scaling
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling + gate * mlp
    s = mask_scores(s, MASK, off_z, off_h, offs_m, offs_n, row_ok, col_ok, M, N, sm, HAS_MASK, IS_CAUSAL)
    return s, mlp, act, dact


@triton.jit
def key_tile_scores(
    start_n, K, V, RK, MASK, qs, wo, gate, off_z, off_h, off_hk, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok,
    M, N, scaling, sk, sv, sr, sm, KIND: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HID_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """For a query block's walk over the keys: the key tile starting at ``start_n`` (k, v) and what
    :func:`tile_scores` gives for it."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    k, v, rk = load_key_side(K, V, RK, wo, off_z, off_hk, offs_n, offs_d, offs_l, col_ok, d_ok, l_ok, sk, sv, sr, KIND)
    s, mlp, act, dact = tile_scores(
        qs, k, rk, wo, gate, MASK, off_z, off_h, offs_m, offs_n, row_ok, col_ok, M, N, scaling, sm,
        KIND, ACT, HAS_MASK, IS_CAUSAL, BLOCK_M, BLOCK_N, HID_PAD, PRECISION,
    )  # fmt: skip
    return k, v, s, mlp, act, dact


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, drop, PRECISION: tl.constexpr):
    """One key tile of the forward's online softmax: the rows' running maximum m_i and normaliser l_i (BLOCK_M,)
    and output accumulator acc (BLOCK_M, BLOCK_D), updated with the tile's scores s (BLOCK_M, BLOCK_N) and values v
    (BLOCK_N, BLOCK_D). ``drop``: the tile's dropout factors (:func:`tile_dropout`), or 1.0."""
    # Every visited tile has a finite score in each row (a real key, at worst at the fp32 minimum), so
    # m_new is finite and the -inf entries give exp(-inf) = 0.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    # The normaliser sums the probabilities before dropout; the values see them after (dropout acts on the
    # softmax's output, as the torch paths apply it).
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p * drop
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=DROPOUT_VALUES)
def forward_kernel(
    Q, K, V, MASK, U, QV, QB, QC, PQ, RK, WO, GATE,
    O, ROW_MAX, ROW_SUM,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sm0, sm1, sm2, sm3,
    su0, su1, su2, su3, su4, sx0, sx1, sx2, sx3, sb0, sb1, sb2, sb3, sc0, sc1, sc2,
    sp0, sp1, sp2, sp3, sr0, sr1, sr2, sr3, H, GROUPS, M, N, D, HID, scaling,
    seed, drop_stream_base, drop_stream_stride, drop_row_offset, drop_threshold, drop_scale,
    KIND: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
    PRECISION: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    sq, sk, sv, sm, su, sx, sb, sc, sp, sr = stride_tuples(
        sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sm0, sm1, sm2, sm3,
        su0, su1, su2, su3, su4, sx0, sx1, sx2, sx3, sb0, sb1, sb2, sb3, sc0, sc1, sc2,
        sp0, sp1, sp2, sp3, sr0, sr1, sr2, sr3,
    )  # fmt: skip
    pid_m, pid_bh, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok, qs, gate, wo = query_block(
        Q, U, QV, QB, QC, PQ, WO, GATE, sq, su, sx, sb, sc, sp, H, GROUPS, M, D, HID, KIND, BLOCK_M, BLOCK_D, HID_PAD
    )
    off_hk = off_h // GROUPS
    drop_rows = block_dropout_rows(
        seed, off_z, off_h, offs_m, drop_stream_base, drop_stream_stride, drop_row_offset, HAS_DROPOUT
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = key_end(pid_m, M, N, BLOCK_M, IS_CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        _, v, s, _, _, _ = key_tile_scores(
            start_n, K, V, RK, MASK, qs, wo, gate, off_z, off_h, off_hk, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok,
            M, N, scaling, sk, sv, sr, sm, KIND, ACT, HAS_MASK, IS_CAUSAL, BLOCK_M, BLOCK_N, HID_PAD, PRECISION,
        )  # fmt: skip
        drop = tile_dropout(drop_rows, start_n, drop_threshold, drop_scale, BLOCK_N, HAS_DROPOUT)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, drop, PRECISION)
    out = acc / l_i[:, None]
    base = pid_bh.to(tl.int64) * M
    tl.store(
        O + (base + offs_m[:, None]) * D + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(ROW_MAX + base + offs_m, m_i, mask=row_ok)
    tl.store(ROW_SUM + base + offs_m, l_i, mask=row_ok)


@triton.jit(do_not_specialize=DROPOUT_VALUES)
def backward_query_kernel(
    Q, K, V, MASK, U, QV, QB, QC, PQ, RK, WO, GATE,
    DO, DELTA, ROW_MAX, ROW_SUM,
    DQ, DU, DQV, DQB, DQC, DPQ, DGATE_PARTIAL, DWO_PARTIAL,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sm0, sm1, sm2, sm3,
    su0, su1, su2, su3, su4, sx0, sx1, sx2, sx3, sb0, sb1, sb2, sb3, sc0, sc1, sc2,
    sp0, sp1, sp2, sp3, sr0, sr1, sr2, sr3, H, GROUPS, M, N, D, HID, scaling,
    seed, drop_stream_base, drop_stream_stride, drop_row_offset, drop_threshold, drop_scale,
    KIND: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
    PRECISION: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    sq, sk, sv, sm, su, sx, sb, sc, sp, sr = stride_tuples(
        sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sm0, sm1, sm2, sm3,
        su0, su1, su2, su3, su4, sx0, sx1, sx2, sx3, sb0, sb1, sb2, sb3, sc0, sc1, sc2,
        sp0, sp1, sp2, sp3, sr0, sr1, sr2, sr3,
    )  # fmt: skip
    """Gradients indexed by queries. Outputs are contiguous: DQ (B, H, M, D), DU (B, H, HID, M, D),
    DQV/DQB/DPQ (B, H, M, HID), DQC (B, H, M); partials DGATE_PARTIAL (B * H * blocks,) and
    DWO_PARTIAL (B * H * blocks, HID_PAD)."""
    pid_m, pid_bh, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok, qs, gate, wo = query_block(
        Q, U, QV, QB, QC, PQ, WO, GATE, sq, su, sx, sb, sc, sp, H, GROUPS, M, D, HID, KIND, BLOCK_M, BLOCK_D, HID_PAD
    )
    off_hk = off_h // GROUPS
    qv = qs[2]
    drop_rows = block_dropout_rows(
        seed, off_z, off_h, offs_m, drop_stream_base, drop_stream_stride, drop_row_offset, HAS_DROPOUT
    )
    base = pid_bh.to(tl.int64) * M
    do, delta, row_max, row_sum = load_row_stats(DO, DELTA, ROW_MAX, ROW_SUM, base, offs_m, offs_d, row_ok, d_ok, D)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    du = tl.zeros([BLOCK_M * HID_PAD, BLOCK_D], dtype=tl.float32)
    dhid = tl.zeros([BLOCK_M, HID_PAD], dtype=tl.float32)  # query network: db; pair MLP: dP
    dqv = tl.zeros([BLOCK_M, HID_PAD], dtype=tl.float32)
    ds_rows = tl.zeros([BLOCK_M], dtype=tl.float32)
    dgate = tl.zeros([BLOCK_M], dtype=tl.float32)
    dwo = tl.zeros([HID_PAD], dtype=tl.float32)
    hi = key_end(pid_m, M, N, BLOCK_M, IS_CAUSAL)
    for start_n in range(0, hi, BLOCK_N):
        k, v, s, mlp, act, dact = key_tile_scores(
            start_n, K, V, RK, MASK, qs, wo, gate, off_z, off_h, off_hk, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok,
            M, N, scaling, sk, sv, sr, sm, KIND, ACT, HAS_MASK, IS_CAUSAL, BLOCK_M, BLOCK_N, HID_PAD, PRECISION,
        )  # fmt: skip
        drop = tile_dropout(drop_rows, start_n, drop_threshold, drop_scale, BLOCK_N, HAS_DROPOUT)
        _, ds = softmax_backward(s, v, do, delta, row_max, row_sum, row_ok, drop, HAS_DROPOUT, PRECISION)
        if KIND != 2:
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
            dgate += tl.sum(ds * mlp, 1)
        if KIND == 0:
            du, dqv, dhid, ds_rows = query_network.accumulate_query_grads(
                du, dqv, dhid, ds_rows, ds, act, dact, qv, gate, k, BLOCK_M, BLOCK_N, HID_PAD, PRECISION
            )
        else:
            dwo, dhid = pair_mlp.accumulate_query_grads(dwo, dhid, ds, act, dact, wo, gate, scaling, KIND)

    qd_ok = row_ok[:, None] & d_ok[None, :]
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
        query_network.store_query_grads(
            DU, DQV, DQB, DQC, du, dqv, dhid, ds_rows, gate,
            pid_bh, base, offs_m, offs_d, offs_l, row_ok, d_ok, hid_ptrs, hid_ok, M, D, HID,
            BLOCK_M, BLOCK_D, HID_PAD,
        )  # fmt: skip
    else:
        tl.store(DPQ + hid_ptrs, dhid.to(DPQ.dtype.element_ty), mask=hid_ok)
        tl.store(DWO_PARTIAL + partial * HID_PAD + offs_l, dwo)


@triton.jit(do_not_specialize=DROPOUT_VALUES)
def backward_key_kernel(
    Q, K, V, MASK, U, QV, QB, QC, PQ, RK, WO, GATE,
    DO, DELTA, ROW_MAX, ROW_SUM,
    DK, DV, DRK,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sm0, sm1, sm2, sm3,
    su0, su1, su2, su3, su4, sx0, sx1, sx2, sx3, sb0, sb1, sb2, sb3, sc0, sc1, sc2,
    sp0, sp1, sp2, sp3, sr0, sr1, sr2, sr3, H, GROUPS, M, N, D, HID, scaling,
    seed, drop_stream_base, drop_stream_stride, drop_row_offset, drop_threshold, drop_scale,
    KIND: tl.constexpr, ACT: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HID_PAD: tl.constexpr,
    PRECISION: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    sq, sk, sv, sm, su, sx, sb, sc, sp, sr = stride_tuples(
        sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sm0, sm1, sm2, sm3,
        su0, su1, su2, su3, su4, sx0, sx1, sx2, sx3, sb0, sb1, sb2, sb3, sc0, sc1, sc2,
        sp0, sp1, sp2, sp3, sr0, sr1, sr2, sr3,
    )  # fmt: skip
    """Gradients indexed by keys, one program per (key block, batch * kv head). Outputs are contiguous:
    DK, DV (B, H_kv, N, D) and DRK (B, H_kv, N, HID)."""
    pid_n, pid_bhk, off_z, off_hk, offs_n, offs_d, offs_l, col_ok, d_ok, l_ok = program_block(
        H // GROUPS, N, D, HID, BLOCK_N, BLOCK_D, HID_PAD
    )
    wo = tl.load(WO + offs_l, mask=l_ok, other=0.0).to(tl.float32)
    k, v, rk = load_key_side(K, V, RK, wo, off_z, off_hk, offs_n, offs_d, offs_l, col_ok, d_ok, l_ok, sk, sv, sr, KIND)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    drk = tl.zeros([BLOCK_N, HID_PAD], dtype=tl.float32)
    lo = 0
    if IS_CAUSAL:
        # Queries before this one can see none of the block's keys: their scores are all -inf.
        lo = tl.maximum(0, pid_n * BLOCK_N - (N - M))
    for group in range(GROUPS):
        off_h = off_hk * GROUPS + group
        gate = load_gate(GATE, off_h, KIND)
        base = (off_z * H + off_h) * M
        for start_m in range(lo, M, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < M
            qs = load_query_side(
                Q, U, QV, QB, QC, PQ, off_z, off_h, offs_m, offs_d, offs_l, row_ok, d_ok, l_ok, sq, su, sx, sb, sc,
                sp, KIND, BLOCK_M, BLOCK_D, HID_PAD,
            )  # fmt: skip
            q, u, qv, _, _, _ = qs
            do, delta, row_max, row_sum = load_row_stats(
                DO, DELTA, ROW_MAX, ROW_SUM, base, offs_m, offs_d, row_ok, d_ok, D
            )
            s, _, _, dact = tile_scores(
                qs, k, rk, wo, gate, MASK, off_z, off_h, offs_m, offs_n, row_ok, col_ok, M, N, scaling, sm,
                KIND, ACT, HAS_MASK, IS_CAUSAL, BLOCK_M, BLOCK_N, HID_PAD, PRECISION,
            )  # fmt: skip
            drop_rows = block_dropout_rows(
                seed, off_z, off_h, offs_m, drop_stream_base, drop_stream_stride, drop_row_offset, HAS_DROPOUT
            )
            drop = tile_dropout(drop_rows, pid_n * BLOCK_N, drop_threshold, drop_scale, BLOCK_N, HAS_DROPOUT)
            p, ds = softmax_backward(s, v, do, delta, row_max, row_sum, row_ok, drop, HAS_DROPOUT, PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            if KIND != 2:
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION) * scaling
            if KIND == 0:
                dk = query_network.accumulate_key_grad(dk, ds, dact, qv, gate, u, BLOCK_M, BLOCK_N, HID_PAD, PRECISION)
            else:
                drk = pair_mlp.accumulate_key_grad(drk, ds, dact, wo, gate, scaling, KIND)

    out_base = pid_bhk.to(tl.int64) * N
    kv_ok = col_ok[:, None] & d_ok[None, :]
    tl.store(DK + (out_base + offs_n[:, None]) * D + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + (out_base + offs_n[:, None]) * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_ok)
    if KIND != 0:
        tl.store(
            DRK + (out_base + offs_n[:, None]) * HID + offs_l[None, :],
            drk.to(DRK.dtype.element_ty),
            mask=col_ok[:, None] & l_ok[None, :],
        )
