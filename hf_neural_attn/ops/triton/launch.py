"""The kernels' launch arguments, from the torch operators' arguments (:mod:`.custom_ops`): the tile sizes, the
pointers and strides in the kernels' order, their sizes and constexprs.

This module imports without triton (the activation codes of :mod:`.utils` are read when a launch is prepared).
"""

from __future__ import annotations

import contextlib

import torch

# Tile sizes (BLOCK_M queries, BLOCK_N keys) of the forward kernel and of the two backward kernels; None
# picks them by device (see _block_sizes). Tests set small ones so that short sequences span several tiles
# under the interpreter. Any tiling gives the same result: the kernels mask every position themselves.
BLOCK_SIZES: tuple[int, int] | None = None
BACKWARD_BLOCK_SIZES: tuple[int, int] | None = None

# The kernels' KIND codes (see :mod:`.common`): the query-network term, the pair MLP with a gate, its replace form.
KIND_QUERY_NETWORK, KIND_PAIR_MLP_RESIDUAL, KIND_PAIR_MLP_REPLACE = 0, 1, 2


def term_tensors(kind: int, term: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """The operators' ``term`` list as the kernels' eight term pointers (U, V, b, c, P, R, w, gate), None where
    the term has no such tensor: ``term`` is the query network's [U, V, b, c, gate], or the pair MLP's [P, R, w]
    followed by its gate when it has one (not the replace form)."""
    if kind == KIND_QUERY_NETWORK:
        U, V, b, c, gate = term
        return U, V, b, c, None, None, None, gate
    P, R, w, *gate = term
    return None, None, None, None, P, R, w, (gate[0] if gate else None)


def on_device(tensor: torch.Tensor):
    """A launch's device context: Triton launches on the current CUDA device, made the tensor's one here."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# The fewest query rows of a CUDA tile: tl.dot needs at least 16 rows.
MIN_TILE_ROWS = 16


def _block_sizes(hid_pad: int, device: torch.device, backward: bool, q_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the forward kernel or the two backward kernels, for ``q_len`` queries.

    Not tuned by timing (one GPU session ran them, at these tiles). Chosen, for bf16 and head_dim 64 on sm_90, as
    the candidates ptxas compiled with the fewest register spills: a tile keeps BLOCK_M x h x BLOCK_N fp32
    hidden activations and their derivatives in registers, so wider h gets smaller tiles. At h = 4 that is
    no spill in the query-network forward and 100-260 bytes per thread in the backward kernels; at h = 8 the
    backward kernels still spill about 1.5 KB.

    A forward call of fewer queries than a tile (a decoding step: one query against its cache) gets a tile of as
    few rows as ``tl.dot`` takes (:data:`MIN_TILE_ROWS`) and wider key tiles, rather than 64 rows of which one is
    real.
    """
    override = BACKWARD_BLOCK_SIZES if backward else BLOCK_SIZES
    if override is not None:
        return (*override, 4)
    if device.type != "cuda":
        return 16, 16, 4  # the interpreter: one numpy op per tile op, so fewer, larger tiles are faster
    if not backward:
        if q_len <= MIN_TILE_ROWS:
            return (MIN_TILE_ROWS, 64, 4) if hid_pad <= 4 else (MIN_TILE_ROWS, 32, 4)
        return (64, 64, 8) if hid_pad <= 2 else (64, 32, 4) if hid_pad <= 4 else (64, 32, 8)
    return (64, 32, 8) if hid_pad <= 4 else (32, 32, 4)


def _strides(tensor: torch.Tensor | None, count: int) -> tuple[int, ...]:
    return tuple(tensor.stride()[:count]) if tensor is not None else (0,) * count


# The kernels' dropout values of a call without dropout (HAS_DROPOUT False: never read).
NO_DROPOUT = (0, 0, 0, 0, 0, 1.0)


def dropout_values(
    dropout_seed: torch.Tensor | None, dropout_p: float, dropout_offsets: list[int], heads: int
) -> tuple[int, int, int, int, int, float] | None:
    """The kernels' dropout values, after their sizes: seed, stream base and stride, row offset, keep threshold and
    scale, for a call of ``batch`` x ``heads`` probabilities whose dropout has probability ``dropout_p``, seed
    ``dropout_seed`` (a 0-d int64 CPU tensor, read here: no device synchronisation) and place ``dropout_offsets``
    (``ops.dropout.AttentionDropout.offsets``: part of the batch, first head, the whole's heads or 0, first row),
    for a call of ``heads`` query heads.

    The kernels hash exactly what ``ops.dropout.keep_mask`` hashes: stream ``(batch_offset + b) * total_heads +
    head_offset + h`` is ``b * stride + h + base``; an entry is kept when its hash is at least ``round(p * 2**32)``
    (capped to a uint32, with scale 0 for p = 1, which keeps nothing). None without dropout (no seed)."""
    if dropout_seed is None:
        return None
    batch_offset, head_offset, total_heads, row_offset = dropout_offsets
    total_heads = total_heads or heads
    # ops.dropout.keep_threshold's round(p * 2**32) (this package imports nothing of the compute paths above it).
    threshold = min(round(dropout_p * (1 << 32)), (1 << 32) - 1)
    scale = 1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0
    return int(dropout_seed), batch_offset * total_heads + head_offset, total_heads, row_offset, threshold, scale


def launch_args(
    q, k, v, mask, term, kind, activation, scaling, is_causal, hidden, *, backward: bool, dropout: tuple | None = None
):
    """The arguments the three kernels share, from the operators' own: pointers and strides, in the kernels'
    order, sizes and dropout values (``dropout``: what :func:`dropout_values` returns, or None), constexprs, and the
    launch's number of warps."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if mask is not None:
        mask = mask.expand(batch, heads, q_len, kv_len)  # broadcast dimensions get stride 0, no copy
    pointers, strides = pointers_and_strides(q, k, v, mask, term, kind)
    sizes = (heads, heads // kv_heads, q_len, kv_len, head_dim, hidden, scaling)
    sizes += dropout if dropout is not None else NO_DROPOUT
    constexprs, num_warps = tile_constexprs(q, kind, activation, hidden, backward=backward, q_len=q_len)
    constexprs.update(HAS_MASK=mask is not None, IS_CAUSAL=is_causal, HAS_DROPOUT=dropout is not None)
    return pointers, strides, sizes, constexprs, num_warps


def pointers_and_strides(q, k, v, mask, term, kind) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """The kernels' twelve pointers (Q, K, V, MASK, U, QV, QB, QC, PQ, RK, WO, GATE; a dummy where the call has no
    such tensor) and their 40 strides, flat, tensor by tensor: the kernels rebuild ``sq, sk, sv, sm, su, sx, sb, sc,
    sp, sr`` (:func:`.common.stride_tuples`; inductor passes no tuples). ``k``, ``v`` and the term's R are indexed
    (batch, kv head, row, dim): the paged kernel passes its cache as a batch of blocks (:mod:`.paged`)."""
    U, QV, QB, QC, P, R, w, gate = term_tensors(kind, term)
    if w is None:
        w = QV  # any tensor of at least h numbers: the kernels load w, and the query-network term never uses it
    dummy = q
    pointers = [q, k, v, mask, U, QV, QB, QC, P, R, w, gate]
    pointers = [dummy if t is None else t for t in pointers]
    strides = (
        *_strides(q, 4), *_strides(k, 4), *_strides(v, 4), *_strides(mask, 4), *_strides(U, 5),
        *_strides(QV, 4), *_strides(QB, 4), *_strides(QC, 3), *_strides(P, 4), *_strides(R, 4),
    )  # fmt: skip
    return pointers, strides


def tile_constexprs(q, kind, activation, hidden, *, backward: bool, q_len: int) -> tuple[dict, int]:
    """The constexprs every kernel takes that follow from the term, the query's dtype and device and the tiles
    (KIND, ACT, BLOCK_M, BLOCK_N, BLOCK_D, HID_PAD, PRECISION), for tiles of ``q_len`` queries, and the launch's
    number of warps."""
    interpreting = q.device.type != "cuda"
    hid_pad = _next_power_of_2(hidden)
    block_m, block_n, num_warps = _block_sizes(hid_pad, q.device, backward, q_len)
    head_dim = q.shape[-1]
    block_d = _next_power_of_2(head_dim) if interpreting else max(16, _next_power_of_2(head_dim))
    fp32_products = q.dtype == torch.float32 and (interpreting or not torch.backends.cuda.matmul.allow_tf32)
    from .utils import ACTIVATION_CODES

    constexprs = {
        "KIND": kind,
        "ACT": ACTIVATION_CODES[activation],
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "HID_PAD": hid_pad,
        "PRECISION": "ieee" if fp32_products else "tf32",
    }
    return constexprs, num_warps
