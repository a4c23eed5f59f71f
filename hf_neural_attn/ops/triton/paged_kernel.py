"""The paged forward kernel: the fused score terms inside a kernel that walks each request's block table itself.

A serving step (vLLM's) holds the new tokens of several requests end to end, and each request's keys in blocks of a
paged cache. :func:`paged_forward_kernel` reads the keys from their blocks directly (no gather into a packed tensor):
one program per (query tile of one request, query head) walks its request's keys tile by tile, looks each key's block
up in the block table, and computes the tile's scores with :func:`.common.tile_scores`, the one place every kernel
computes scores, before the same online softmax as :func:`.common.forward_kernel`. Forward only: no mask tensor, no
dropout, no row statistics.

Addresses: the cache is indexed as the other kernels index keys, (batch, kv head, row, dim), with the cache's blocks as
the batch (the torch side passes ``key_blocks.transpose(1, 2)``, a view). A key tile's "batch index" is then a column
of block ids, one per key (looked up in the block table), and its "rows" are the keys' slots in their blocks, so
:func:`.common.load_key_side` loads keys, values and the pair-MLP's R of a paged tile unchanged (the block column
broadcasts against the dims). The key tile need not divide the block size: each key finds its own block.

Programs: request r's query tiles are numbered from ``query_start_loc[r] // BLOCK_M + r`` on (the numbers of
vLLM's unified attention kernel), which leaves each request at least ``cdiv(q_len, BLOCK_M)`` numbers before the
next request's first. The grid is ``tokens // BLOCK_M + requests`` numbers by query heads, known from the shapes
alone (no device synchronisation); a program finds its request by binary search (:func:`tile_request`) and exits
when its tile lies past its request's queries.

Importing this module needs ``triton``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import key_end, load_key_side, online_softmax_step, query_operands, stride_tuples, tile_scores


@triton.jit
def tile_request(QUERY_START, tile, REQUESTS, BLOCK_M: tl.constexpr):
    """The request whose queries the program numbered ``tile`` covers, its first query row (QUERY_START[r]) and
    the tile's first row within that request: the last request r whose first number, ``QUERY_START[r] // BLOCK_M +
    r``, is at most ``tile`` (the numbers increase with r)."""
    lo = tl.full([], 0, tl.int32)  # a tensor even when the loop does not run (one request)
    hi = lo + REQUESTS  # the request is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(QUERY_START + mid) // BLOCK_M + mid <= tile:
            lo = mid
        else:
            hi = mid
    q_start = tl.load(QUERY_START + lo)
    return lo, q_start, (tile - (q_start // BLOCK_M + lo)) * BLOCK_M


@triton.jit
def paged_key_tile(
    start_n, K, V, RK, BLOCK_TABLE, table_row, s_block, n_keys, PAGE, wo, off_hk, offs_d, offs_l, d_ok, l_ok,
    sk, sv, sr, KIND: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The key tile starting at key ``start_n`` of a request with ``n_keys`` keys, read from the blocks its row of
    the block table names (at ``table_row``, stride ``s_block``): the keys' positions ``offs_n``, which of them
    exist, and k, v, R as :func:`.common.load_key_side` loads them."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    col_ok = offs_n < n_keys
    # int64: block * the block stride passes 2**31 in a cache of a few GB.
    block = tl.load(BLOCK_TABLE + table_row + (offs_n // PAGE) * s_block, mask=col_ok, other=0).to(tl.int64)
    k, v, rk = load_key_side(
        K, V, RK, wo, block[:, None], off_hk, offs_n % PAGE, offs_d, offs_l, col_ok, d_ok, l_ok, sk, sv, sr, KIND
    )
    return offs_n, col_ok, k, v, rk


@triton.jit
def paged_forward_kernel(
    Q, K, V, MASK, U, QV, QB, QC, PQ, RK, WO, GATE,
    OUT, BLOCK_TABLE, SEQ_LENS, QUERY_START,
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sm0, sm1, sm2, sm3,
    su0, su1, su2, su3, su4, sx0, sx1, sx2, sx3, sb0, sb1, sb2, sb3, sc0, sc1, sc2,
    sp0, sp1, sp2, sp3, sr0, sr1, sr2, sr3, s_request, s_block, H, GROUPS, REQUESTS, TOKENS, D, HID, PAGE, scaling,
    KIND: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HID_PAD: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Causal attention of each request's queries (the last of its keys) over its paged keys, fused score term
    ``KIND`` added. Q, U, QV, QB, QC, PQ: the step's queries and their term, batch 1, tokens as rows; K, V, RK: the
    cache as (blocks, kv heads, PAGE, ·) with strides sk, sv, sr; MASK is unused (a dummy, strides sm 0). OUT: (1, H,
    TOKENS, D) contiguous. BLOCK_TABLE (REQUESTS, ·) with strides ``s_request, s_block``; SEQ_LENS (REQUESTS,)
    and QUERY_START (REQUESTS + 1,) contiguous. Grid: (TOKENS // BLOCK_M + REQUESTS, H)."""
    sq, sk, sv, sm, su, sx, sb, sc, sp, sr = stride_tuples(
        sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sm0, sm1, sm2, sm3,
        su0, su1, su2, su3, su4, sx0, sx1, sx2, sx3, sb0, sb1, sb2, sb3, sc0, sc1, sc2,
        sp0, sp1, sp2, sp3, sr0, sr1, sr2, sr3,
    )  # fmt: skip
    request, q_start, first_row = tile_request(QUERY_START, tl.program_id(0), REQUESTS, BLOCK_M)
    q_len = tl.load(QUERY_START + request + 1) - q_start
    if first_row >= q_len:
        return
    n_keys = tl.load(SEQ_LENS + request)
    off_h = tl.program_id(1).to(tl.int64)
    offs_m = first_row + tl.arange(0, BLOCK_M)  # within the request: its query i is its key n_keys - q_len + i
    offs_d = tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, HID_PAD)
    row_ok, d_ok, l_ok = offs_m < q_len, offs_d < D, offs_l < HID
    rows = q_start + offs_m  # the queries' rows among the step's tokens
    qs, gate, wo = query_operands(
        Q, U, QV, QB, QC, PQ, WO, GATE, 0, off_h, rows, offs_d, offs_l, row_ok, d_ok, l_ok, sq, su, sx, sb, sc, sp,
        KIND, BLOCK_M, BLOCK_D, HID_PAD,
    )  # fmt: skip
    off_hk = off_h // GROUPS
    table_row = request.to(tl.int64) * s_request
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = key_end(first_row // BLOCK_M, q_len, n_keys, BLOCK_M, True)
    for start_n in range(0, hi, BLOCK_N):
        offs_n, col_ok, k, v, rk = paged_key_tile(
            start_n, K, V, RK, BLOCK_TABLE, table_row, s_block, n_keys, PAGE, wo, off_hk, offs_d, offs_l, d_ok, l_ok,
            sk, sv, sr, KIND, BLOCK_N,
        )  # fmt: skip
        # Causal within the request (rows offs_m of q_len, columns offs_n of n_keys); no mask tensor.
        s, _, _, _ = tile_scores(
            qs, k, rk, wo, gate, MASK, 0, off_h, offs_m, offs_n, row_ok, col_ok, q_len, n_keys, scaling, sm,
            KIND, ACT, False, True, BLOCK_M, BLOCK_N, HID_PAD, PRECISION,
        )  # fmt: skip
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, 1.0, PRECISION)
    out = acc / l_i[:, None]
    tl.store(
        OUT + (off_h * TOKENS + rows[:, None].to(tl.int64)) * D + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
