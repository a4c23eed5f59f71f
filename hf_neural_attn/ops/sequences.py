"""Splitting an attention call into its sequences: the one place that says where a sequence lies in a call's
tensors and how its query, keys, values, mask, per-query inputs and dropout are cut out of them.

Two kinds of call are split, and both describe each part as a :class:`SequenceSlice`:

* a padded batch (:func:`padded_sequences`, for :func:`.dispatch.scored_attention`): one sequence per row of the
  batch, scored alone against the span of keys its mask leaves it (:func:`key_spans`), or with its own rows whose
  mask hides every key (a left-padded batch over an eager base);
* a packed call (:func:`.packed.packed_sequences`, for the attention function): several sequences end to end in the
  one row of a batch of 1, as continuous batching and packed training batches hand them over.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .dropout import AttentionDropout

EVERY = slice(None)


@dataclasses.dataclass(frozen=True)
class SequenceSlice:
    """Where one sequence lies in an attention call's tensors: query (batch, heads, q_len, head_dim), keys and values
    (batch, kv_heads, kv_len, head_dim), mask broadcastable to (batch, heads, q_len, kv_len).

    queries, keys: its spans of the query and key axes (``EVERY``: all of them).
    row: its row of the batch (a padded batch), or None where the call's batch is this sequence's (a packed call).
    """

    queries: slice
    keys: slice
    row: int | None = None

    @property
    def q_len(self) -> int:
        """How many queries (of a sequence whose span of queries has bounds)."""
        return self.queries.stop - self.queries.start

    @property
    def kv_len(self) -> int:
        """How many keys (of a sequence whose span of keys has bounds)."""
        return self.keys.stop - self.keys.start

    @property
    def rows(self) -> slice:
        """Its rows of the batch, as a slice that keeps the batch axis."""
        return EVERY if self.row is None else slice(self.row, self.row + 1)

    def query_of(self, query: torch.Tensor) -> torch.Tensor:
        """Its queries, (1 or batch, heads, q_len, head_dim)."""
        return query[self.rows, :, self.queries]

    def keys_of(self, keys: torch.Tensor) -> torch.Tensor:
        """Its keys (or values), (1 or batch, kv_heads, kv_len, head_dim)."""
        return keys[self.rows, :, self.keys]

    def mask_of(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Its block of a mask broadcastable to (batch, heads, q_len, kv_len): an axis the mask broadcasts (size 1)
        stays broadcast."""
        if attention_mask is None:
            return None
        if self.row is not None and attention_mask.dim() == 4 and attention_mask.shape[0] > 1:
            attention_mask = attention_mask[self.rows]
        queries = self.queries if attention_mask.shape[-2] > 1 else EVERY
        return attention_mask[..., queries, self.keys]

    def extras_of(self, extras: Any, batch: int) -> Any:
        """Its part of a scorer's per-query inputs (a NamedTuple of tensors, batch first or broadcast, with a
        ``query_block(start, end)`` method; or None) for a call of ``batch`` rows."""
        if extras is None:
            return None
        if self.row is not None:
            extras = type(extras)._make(
                part[self.rows] if isinstance(part, torch.Tensor) and part.shape[0] == batch else part
                for part in extras
            )
        if self.queries != EVERY:
            extras = extras.query_block(self.queries.start, self.queries.stop)
        return extras

    def dropout_of(self, dropout: AttentionDropout | None) -> AttentionDropout | None:
        """The call's dropout for this sequence alone: a row of a batch drops what that row drops in the whole."""
        if dropout is None or self.row is None:
            return dropout
        return dropout.for_sequence(self.row)


# A padded batch is split into its sequences when that leaves out at least this share of its keys: below, the
# per-sequence calls cost more than the keys they skip.
MIN_SKIPPED_KEYS = 0.125


def padded_sequences(
    attention_mask: torch.Tensor | None,
    batch: int,
    kv_len: int,
    *,
    is_causal: bool,
    rows_by_sequence: list[tuple[int, ...]],
) -> list[tuple[SequenceSlice, tuple[int, ...]]] | None:
    """How the blockwise paths split a call whose sequences differ, or None to run it whole: per row of the batch,
    its :class:`SequenceSlice` and its query rows that must see every key (``rows_seeing_all`` of the paths).

    ``rows_by_sequence`` is :func:`.masks.query_rows_seeing_all` of the call (empty where the paths need no such
    rows). The split reads the mask's values, so it is not asked for while ``torch.compile`` traces.
    """
    if not is_causal:
        # A padded batch of unequal lengths: each sequence scores only the keys its mask leaves it, which the softmax
        # gives exactly zero weight otherwise. (Not for causal calls: they align queries to the end of the keys, which
        # a shorter span of keys would move.)
        spans = key_spans(attention_mask, batch, kv_len)
        if spans is None:
            return None
        return [(SequenceSlice(EVERY, slice(start, end), row), ()) for row, (start, end) in enumerate(spans)]
    if len(set(rows_by_sequence)) > 1:
        # A left-padded batch over an eager base: widening every sequence's blocks for another's pad rows would cost
        # them all the keys a causal block skips.
        return [(SequenceSlice(EVERY, EVERY, row), rows) for row, rows in enumerate(rows_by_sequence)]
    return None


def key_spans(attention_mask: torch.Tensor | None, batch: int, kv_len: int) -> list[tuple[int, int]] | None:
    """Per sequence of the batch, the span of key columns its mask allows to any query row and head, when leaving
    out the others saves at least :data:`MIN_SKIPPED_KEYS` of the call's keys; None otherwise (no mask, one
    sequence, or little padding). A sequence whose mask allows no key keeps every column."""
    if attention_mask is None or batch < 2 or attention_mask.dim() != 4 or attention_mask.shape[0] != batch:
        return None
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    elif attention_mask.is_floating_point():
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    else:
        return None
    columns = allowed.any(dim=1).any(dim=1)  # (batch, kv_len or 1)
    if columns.shape[-1] != kv_len:
        return None
    positions = torch.arange(kv_len, device=columns.device)
    first = torch.where(columns, positions, kv_len).amin(-1).tolist()
    last = torch.where(columns, positions, -1).amax(-1).tolist()
    spans = [(lo, hi + 1) if hi >= lo else (0, kv_len) for lo, hi in zip(first, last, strict=True)]
    skipped = 1 - sum(end - start for start, end in spans) / (batch * kv_len)
    return spans if skipped >= MIN_SKIPPED_KEYS else None
