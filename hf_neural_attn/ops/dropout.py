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

The seed is a 0-d tensor drawn with ``torch.randint``, an op like any other, so a ``torch.compile``'d model draws
it inside its graph (no graph break) and hands it to the blockwise operator as a tensor. Inductor then draws it
from its own random stream unless ``torch._inductor.config.fallback_random`` is True: with the flag, compiled and
eager models draw the same seeds and drop the same entries; without it a compiled run is still reproducible under
``torch.manual_seed`` but drops other entries than the eager one (as inductor's own dropout does).

The hash is 32-bit arithmetic carried in int64 tensors: every value is a 32-bit word in [0, 2^32), each
multiplication is by a constant below 2^31 in magnitude and is masked back to 32 bits, so no step overflows a signed
64-bit integer. That keeps the arithmetic defined in every backend: torch.compile's C++ and Triton code treat signed
overflow as undefined behaviour, and an int32 version that relied on wrapping compiled to other masks (and, on one
thread, to a crash). A full 32-bit finaliser (``lowbias32``) runs per (batch, head), per row and per column; each
entry is then one xorshift-multiply round on its row's hash xor its column's, the only part whose cost grows as n².
Hashing the columns apart (rather than stepping through them) leaves no correlation between entries at any distance
in a row. An entry is kept when its hash is at least ``round(p * 2^32)``: the keep rate is 1 - p to within 2^-32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_WORD = 0xFFFFFFFF  # the low 32 bits
# lowbias32's multipliers, each below 2^31 in magnitude (0x846CA68B taken as its negative twin, the same residue mod
# 2^32), so a 32-bit word times either fits in int64.
_MULTIPLY_1 = 0x7FEB352D
_MULTIPLY_2 = 0x846CA68B - (1 << 32)
_ROW_STEP = 0x9E3779B9  # the golden ratio's word: spreads consecutive rows apart before their finaliser
_COLUMN_OFFSET = 0x632BE5AB  # keeps column 0's hash away from row hashes' inputs


def draw_seed() -> torch.Tensor:
    """One seed for a call's dropout masks: a 0-d int64 tensor in [0, 2^31 - 1) from torch's default (CPU)
    generator. A tensor rather than a Python int, so that a compiled graph draws it without a graph break (see
    the module doc for which generator then draws it)."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` on int64 ``x`` holding 32-bit words, in place: a bijection of the words that spreads every
    input bit."""
    x.bitwise_xor_(x.bitwise_right_shift(16))
    x.mul_(_MULTIPLY_1).bitwise_and_(_WORD)
    x.bitwise_xor_(x.bitwise_right_shift(15))
    x.mul_(_MULTIPLY_2).bitwise_and_(_WORD)
    x.bitwise_xor_(x.bitwise_right_shift(16))
    return x


def keep_threshold(p: float) -> int:
    """The smallest entry hash that is kept: ``round(p * 2^32)`` (2^32 for p = 1: nothing is kept)."""
    return round(p * (1 << 32))


def keep_mask(
    seed: torch.Tensor | int, p: float, streams: torch.Tensor, row_start: int, row_end: int, col_end: int
) -> torch.Tensor:
    """Which entries of rows ``row_start:row_end`` and columns ``:col_end`` dropout keeps.

    Args:
        seed: the call's seed (:func:`draw_seed`: a 0-d int64 tensor; a Python int works too), in [0, 2^31).
        p: the dropout probability.
        streams: integer ``batch * heads + head`` of each (batch, head) the probabilities have, in their layout
            with the row and column axes of size 1 (e.g. (batch, heads, 1, 1)).
        row_start, row_end, col_end: the block's query rows and key columns, positions within the call.

    Returns:
        A boolean tensor of shape ``streams.shape[:-2] + (row_end - row_start, col_end)``, True where kept.
    """
    device = streams.device
    keys = _mix(_mix(streams.to(torch.int64).bitwise_xor(seed)))  # (…, 1, 1): one key per (batch, head)
    rows = torch.arange(row_start, row_end, dtype=torch.int64, device=device).mul_(_ROW_STEP)
    row_hashes = _mix(keys.add(rows[:, None]).bitwise_and_(_WORD))  # (…, rows, 1): every row its own start
    column_hashes = _mix(torch.arange(col_end, dtype=torch.int64, device=device).add_(_COLUMN_OFFSET))
    # Per entry one xorshift-multiply round (5 passes over the block: the cost that matters) on the row's hash xor
    # the column's; the top bits decide.
    entries = row_hashes.bitwise_xor(column_hashes)  # (…, rows, columns)
    entries.bitwise_xor_(entries.bitwise_right_shift(15))
    entries.mul_(_MULTIPLY_2).bitwise_and_(_WORD)
    return entries >= keep_threshold(p)


DEFAULT_SOURCE = "the attention dropout probability"


def check_probability(p, source: str = DEFAULT_SOURCE) -> float:
    """``p`` as a float when it is a probability, in [0, 1]; else a ``ValueError`` naming ``source`` (e.g.
    ``"config.attention_dropout"``). NaN is refused: it would drop nothing and say nothing."""
    try:
        value = float(p)
    except (TypeError, ValueError):
        value = None
    if value is None or not 0.0 <= value <= 1.0:  # NaN fails both comparisons
        raise ValueError(f"{source} must be a probability in [0, 1], got {p!r}. Set it to a value in that range.")
    return value


def head_streams(batch: int, heads: int, device) -> torch.Tensor:
    """(batch, heads, 1, 1) int32 ``batch * heads + head``: the streams of probabilities laid out as
    (batch, heads, q, kv)."""
    return torch.arange(batch * heads, dtype=torch.int32, device=device).view(batch, heads, 1, 1)


@dataclass(frozen=True)
class DropoutPlacement:
    """Where one call's probabilities sit in an attention computed in parts (tensor parallelism: this process's heads;
    context parallelism: a block of the sequence's queries), so that each part drops what the whole computed at once
    would: the whole's ``seed`` (drawn once, :func:`draw_seed`), this part's first head ``head_offset`` of
    ``total_heads``, and its first query row ``row_offset`` (key columns are the whole's already)."""

    seed: torch.Tensor
    head_offset: int = 0
    total_heads: int | None = None
    row_offset: int = 0


@dataclass(frozen=True)
class AttentionDropout:
    """One call's attention dropout: probability ``p`` and the ``seed`` its masks are a function of.

    ``streams`` of a path's layout (:func:`head_streams`, regrouped as the path lays its heads out) say which
    (batch, head) each slice of probabilities belongs to; :meth:`kept` is then the same for every path.
    """

    p: float
    # A 0-d int64 tensor (draw_seed), which the blockwise operator takes; the masks alone (keep_mask) take an int too.
    seed: torch.Tensor
    # Added to the streams of a call split into parts of the batch (ops: one sequence at a time), so that a part's
    # first sequence draws what it draws in the whole batch.
    batch_offset: int = 0
    # Where this call sits in a whole computed in parts (DropoutPlacement): its heads among the whole's, its rows.
    head_offset: int = 0
    total_heads: int | None = None
    row_offset: int = 0

    @classmethod
    def for_call(
        cls, p: float, training: bool, source: str = DEFAULT_SOURCE, placement: DropoutPlacement | None = None
    ) -> AttentionDropout | None:
        """The dropout of a call with probability ``p`` in ``training`` mode, with a fresh seed (or the ``placement``'s:
        a part of a larger attention); None when no entry is dropped (eval mode, or ``p`` 0), as transformers' eager
        attention does. ``p`` is checked in training mode (:func:`check_probability`, naming ``source``), where the
        unpatched attention would refuse it too."""
        if not training:
            return None
        p = check_probability(p, source)
        if p == 0:
            return None
        if placement is None:
            return cls(p, draw_seed())
        return cls(p, placement.seed, 0, placement.head_offset, placement.total_heads, placement.row_offset)

    def offsets(self) -> list[int]:
        """Where the call sits in its whole, as a torch operator's schema carries it (the blockwise path's): the part
        of the batch, the first head, the heads of the whole (0: the call's own), the first row. :meth:`at_offsets`
        reads it back."""
        return [self.batch_offset, self.head_offset, self.total_heads or 0, self.row_offset]

    @classmethod
    def at_offsets(cls, p: float, seed: torch.Tensor, offsets: list[int]) -> AttentionDropout:
        """The dropout of probability ``p`` and ``seed`` at the place :meth:`offsets` describes."""
        batch_offset, head_offset, total_heads, row_offset = offsets
        return cls(p, seed, batch_offset, head_offset, total_heads or None, row_offset)

    def streams(self, batch: int, heads: int, device) -> torch.Tensor:
        """(batch, heads, 1, 1) int32 streams of probabilities laid out as (batch, heads, q, kv) (:func:`head_streams`
        shifted by the part of the batch and of the heads this call is)."""
        total = self.total_heads or heads
        streams = head_streams(batch, total, device)[:, self.head_offset : self.head_offset + heads]
        return streams.add(self.batch_offset * total)

    def for_sequence(self, index: int) -> AttentionDropout:
        """This dropout for sequence ``index`` of the batch alone."""
        return dataclasses.replace(self, batch_offset=self.batch_offset + index)

    def kept(self, probs: torch.Tensor, streams: torch.Tensor, row_start: int) -> torch.Tensor:
        """``probs`` (a block of rows from ``row_start``, every column from 0) with the dropped entries zeroed and
        the kept ones scaled by 1 / (1 - p): a new tensor."""
        rows, columns = probs.shape[-2], probs.shape[-1]
        return probs * self.factors(streams, row_start, row_start + rows, columns, probs.dtype)

    def factors(
        self, streams: torch.Tensor, row_start: int, row_end: int, col_end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """A block's dropout as factors in ``dtype``: 1 / (1 - p) where kept, 0 where dropped."""
        offset = self.row_offset
        keep = keep_mask(self.seed, self.p, streams, row_start + offset, row_end + offset, col_end)
        # p = 1 keeps nothing, and its factors are all 0 (as F.dropout's), not 0 times an infinite scale.
        return keep.to(dtype).mul_(1.0 / (1.0 - self.p) if self.p < 1 else 0.0)
