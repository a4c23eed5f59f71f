"""Attention dropout as a function of position: the same entries dropped on every path, and no n² mask kept.

Dropout on attention probabilities drops each (query row, key column) entry of each head with probability p and
scales the kept ones by 1 / (1 - p), after the softmax (what transformers' eager attention and ``F.dropout`` do).
The blockwise paths compute the probabilities a block of queries at a time and again in backward, so instead of
drawing and storing a mask they regenerate it: whether an entry is kept is a hash of

    (the call's seed, the stream: batch * heads + head, the query row, the key column)

(counter-based, like FlashAttention's Philox offsets). One seed is drawn per call from torch's default generator
(:func:`draw_seed`), so ``torch.manual_seed`` reproduces a run, activation checkpointing's recompute (which
restores the RNG state) draws the same seed, and two calls draw different ones. The reference path uses the same
function, so for one seed every path drops exactly the same entries.

The hash is 32-bit integer arithmetic on int32 tensors (multiplications wrap modulo 2^32, the shifts are made
logical with a mask): a full 32-bit finaliser (``lowbias32``) per (batch, head) and per row, then one
xorshift-multiply round per entry, the only part whose cost grows as n². An entry is kept when its hash, read as a
signed 32-bit number, is at least ``-2^31 + round(p * 2^32)``: the keep rate is 1 - p to within 2^-32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GOLDEN = -1640531527  # 0x9E3779B9 as int32: spreads consecutive rows apart before the row round
_COLUMN_STEP = 0x2C1B3C6D  # odd: consecutive columns land far apart before the entry round


@torch.compiler.disable  # drawn in eager code: a compiled graph would draw from its own generator
def draw_seed() -> int:
    """One seed for a call's dropout masks, from torch's default (CPU) generator."""
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` on int32 ``x``, in place: a bijection of the 32-bit words that spreads every input bit."""
    x.bitwise_xor_(x.bitwise_right_shift(16).bitwise_and_(0xFFFF))
    x.mul_(0x7FEB352D)
    x.bitwise_xor_(x.bitwise_right_shift(15).bitwise_and_(0x1FFFF))
    x.mul_(-2073254261)  # 0x846CA68B
    x.bitwise_xor_(x.bitwise_right_shift(16).bitwise_and_(0xFFFF))
    return x


def keep_mask(
    seed: int, p: float, streams: torch.Tensor, row_start: int, row_end: int, col_end: int
) -> torch.Tensor:
    """Which entries of rows ``row_start:row_end`` and columns ``:col_end`` dropout keeps.

    Args:
        seed: the call's seed (:func:`draw_seed`).
        p: the dropout probability.
        streams: int32 ``batch * heads + head`` of each (batch, head) the probabilities have, in their layout with
            the row and column axes of size 1 (e.g. (batch, heads, 1, 1)).
        row_start, row_end, col_end: the block's query rows and key columns, positions within the call.

    Returns:
        A boolean tensor of shape ``streams.shape[:-2] + (row_end - row_start, col_end)``, True where kept.
    """
    device = streams.device
    keys = _mix(_mix(streams.to(torch.int32).bitwise_xor(seed)))  # (…, 1, 1): one key per (batch, head)
    rows = torch.arange(row_start, row_end, dtype=torch.int32, device=device).mul_(_GOLDEN)
    row_hashes = _mix(keys + rows[:, None])  # (…, rows, 1): every row its own random start
    columns = torch.arange(col_end, dtype=torch.int32, device=device).mul_(_COLUMN_STEP)
    # Per entry one xorshift-multiply round (6 passes over the block: the cost that matters) on the row's start
    # plus an odd multiple of the column; the top bits decide. Read as int32, they are uniform over
    # [-2^31, 2^31), so "kept" is one signed comparison.
    entries = row_hashes + columns  # (…, rows, columns)
    entries.bitwise_xor_(entries.bitwise_right_shift(15).bitwise_and_(0x1FFFF))
    entries.mul_(-2073254261)  # 0x846CA68B
    return entries >= -(1 << 31) + round(p * (1 << 32))


def head_streams(batch: int, heads: int, device) -> torch.Tensor:
    """(batch, heads, 1, 1) int32 ``batch * heads + head``: the streams of probabilities laid out as
    (batch, heads, q, kv)."""
    return torch.arange(batch * heads, dtype=torch.int32, device=device).view(batch, heads, 1, 1)


@dataclass(frozen=True)
class AttentionDropout:
    """One call's attention dropout: probability ``p`` and the ``seed`` its masks are a function of.

    ``streams`` of a path's layout (:func:`head_streams`, regrouped as the path lays its heads out) say which
    (batch, head) each slice of probabilities belongs to; :meth:`kept` is then the same for every path.
    """

    p: float
    seed: int
    # Added to the streams of a call split into parts of the batch (ops: one sequence at a time), so that a part's
    # first sequence draws what it draws in the whole batch.
    batch_offset: int = 0

    @classmethod
    def for_call(cls, p: float, training: bool) -> AttentionDropout | None:
        """The dropout of a call with probability ``p`` in ``training`` mode, with a fresh seed; None when no entry
        is dropped (eval mode, or ``p`` 0), as transformers' eager attention does."""
        return cls(float(p), draw_seed()) if training and p > 0 else None

    def streams(self, batch: int, heads: int, device) -> torch.Tensor:
        """(batch, heads, 1, 1) int32 streams of probabilities laid out as (batch, heads, q, kv) (:func:`head_streams`
        shifted by the part of the batch this call is)."""
        return head_streams(batch, heads, device).add_(self.batch_offset * heads)

    def for_sequence(self, index: int) -> AttentionDropout:
        """This dropout for sequence ``index`` of the batch alone."""
        return AttentionDropout(self.p, self.seed, self.batch_offset + index)

    def kept(self, probs: torch.Tensor, streams: torch.Tensor, row_start: int) -> torch.Tensor:
        """``probs`` (a block of rows from ``row_start``, every column from 0) with the dropped entries zeroed and
        the kept ones scaled by 1 / (1 - p): a new tensor."""
        rows, columns = probs.shape[-2], probs.shape[-1]
        return probs * self.factors(streams, row_start, row_start + rows, columns, probs.dtype)

    def factors(
        self, streams: torch.Tensor, row_start: int, row_end: int, col_end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """A block's dropout as factors in ``dtype``: 1 / (1 - p) where kept, 0 where dropped."""
        keep = keep_mask(self.seed, self.p, streams, row_start, row_end, col_end)
        return keep.to(dtype).mul_(1.0 / (1.0 - self.p))
