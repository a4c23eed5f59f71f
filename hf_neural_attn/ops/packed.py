"""Packed calls: several sequences laid end to end in one row, as transformers' continuous batching hands them over.

Continuous batching (``generate_batch``, ``transformers serve --continuous-batching``) runs every request of a step
in one forward of batch 1: the new tokens of all requests one after the other, no attention mask, and per request
the span of its queries (``cu_seq_lens_q``, cumulative lengths) and of its keys (``cu_seq_lens_k``: what its paged
cache read back, then its new tokens). A request's queries are the last of its keys. Packed training batches
(``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) come the same way, with as many keys as queries, and
over an eager base with a causal mask over the whole row. Flash attention takes that form natively; the scorers take
it one sequence at a time (:func:`packed_sequences`), each against its own keys only, causally, so memory stays
linear in the tokens and no sequence sees another.
"""

from __future__ import annotations

import torch

from .masks import causal_allowed
from .sequences import SequenceSlice

# The keyword arguments of a packed call that describe the packing (and its paged cache): what is left once a
# sequence is cut out of it is an ordinary call.
PACKING_KWARGS = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "block_table",
    "k_cache",
    "v_cache",
    "read_index",
    "write_index",
    "logits_indices",
    "logits_processor_args",
    "position_ids",
)


def packed_sequences(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> list[SequenceSlice] | None:
    """The sequences of a packed call, each its span of queries and of keys (:class:`.sequences.SequenceSlice`, which
    cuts its tensors out of the call's), or None for an ordinary call (no ``cu_seq_lens_q`` / ``cu_seq_lens_k``).

    query: (1, heads, total_q, head_dim); key: (1, kv_heads, total_kv, head_dim). Sequences without queries (the
    padding entries of a static-shape batch, where the cumulative lengths plateau) are left out.

    Raises ``ValueError`` for packed calls the scorers cannot serve: keys left in a paged cache for a fused kernel to
    read (``block_table``), or lengths that do not fit the tensors.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        return None
    if kwargs.get("block_table") is not None:
        raise ValueError(
            "hf_neural_attn got a packed call whose keys stay in the paged cache (a block table, for flash "
            "attention's kv-cache kernel): the scorers need the keys. Serve the patched model with its own "
            "attn_implementation ('hf_neural_attn'), which continuous batching keeps for patched models."
        )
    if isinstance(cu_k, dict):  # one entry per layer type: the layer's cache.update(..., kwargs=) picks its own
        raise TypeError(
            "hf_neural_attn got a packed call whose key lengths were not resolved for this layer "
            f"(cu_seq_lens_k has one entry per layer type: {sorted(cu_k)}): the layer did not pass its keyword "
            "arguments to the paged cache's update."
        )
    q_bounds, k_bounds = _bounds(cu_q), _bounds(cu_k)
    if len(q_bounds) != len(k_bounds) or query.shape[0] != 1:
        raise ValueError(
            f"hf_neural_attn got a packed call it cannot split: batch {query.shape[0]} (packed calls have 1), "
            f"{len(q_bounds) - 1} query spans and {len(k_bounds) - 1} key spans."
        )
    sequences = []
    for q_start, q_end, k_start, k_end in zip(q_bounds, q_bounds[1:], k_bounds, k_bounds[1:]):
        if q_end == q_start:
            continue
        if q_end - q_start > k_end - k_start or q_end > query.shape[-2] or k_end > key.shape[-2]:
            raise ValueError(
                f"hf_neural_attn got a packed sequence of queries {q_start}:{q_end} and keys {k_start}:{k_end} over "
                f"{query.shape[-2]} queries and {key.shape[-2]} keys: a sequence's queries must be the last of its "
                "keys."
            )
        sequences.append(SequenceSlice(slice(q_start, q_end), slice(k_start, k_end)))
    return sequences


# Decoding requests (one query each) are scored together: a batch whose row r is request r's query against its own
# keys, padded to the longest request's (:func:`decoding_batches`, :func:`padded_keys`). One call costs a decode step
# a few dozen small operations however many requests it holds, where one call per request costs them per request,
# and the padding costs scores: a batch takes requests, shortest first, while its padded keys stay within this many
# times the keys its requests have.
DECODE_PADDING = 2.0


def decoding_batches(
    query_counts: list[int], key_counts: list[int], max_padding: float = DECODE_PADDING
) -> list[list[int]]:
    """The sequences of a packed call with one query (decoding requests), by index, in batches, shortest first: each
    batch's rows times its longest key count stays within ``max_padding`` times its key counts' sum. Sequences with
    another number of queries are left out (they are scored one at a time).

    query_counts, key_counts: each sequence's number of queries and of keys."""
    batches: list[list[int]] = []
    keys = 0
    decoding = sorted((index for index, count in enumerate(query_counts) if count == 1), key=key_counts.__getitem__)
    for index in decoding:
        length = key_counts[index]
        if batches and (len(batches[-1]) + 1) * length <= max_padding * (keys + length):
            batches[-1].append(index)
            keys += length
        else:
            batches.append([index])
            keys = length
    return batches


def padded_keys(keys: torch.Tensor, batch: list[SequenceSlice]) -> torch.Tensor:
    """The keys (or values) of each sequence of ``batch`` as a row of a padded batch: (rows, kv_heads, longest,
    head_dim), contiguous, out of the packed (1, kv_heads, total_kv, head_dim); a row's padding repeats its last key
    (the call's mask, :func:`key_padding_mask`, hides it)."""
    starts = torch.tensor([s.keys.start for s in batch], device=keys.device)
    lengths = torch.tensor([s.kv_len for s in batch], device=keys.device)
    offsets = torch.arange(int(lengths.max()), device=keys.device)
    index = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)  # (rows, longest)
    heads = torch.arange(keys.shape[1], device=keys.device)[:, None]
    return keys[0][heads, index[:, None]]


def key_padding_mask(lengths: torch.Tensor, key_len: int) -> torch.Tensor:
    """The boolean mask (rows, 1, 1, key_len), True = attend, of a padded batch whose row r has ``lengths[r]`` keys."""
    return (torch.arange(key_len, device=lengths.device)[None, :] < lengths[:, None])[:, None, None]


def _bounds(cumulative: torch.Tensor | list[int]) -> list[int]:
    return cumulative.tolist() if isinstance(cumulative, torch.Tensor) else list(cumulative)


def sequence_mask(
    sequence: SequenceSlice, *, is_causal: bool, sliding_window: int | None, device
) -> torch.Tensor | None:
    """The boolean mask (1, 1, q_len, kv_len), True = attend, of one sequence of a causal packed call: causal with its
    queries at the end of its keys, and within ``sliding_window`` positions of each query where the layer has a
    window. None where ``is_causal`` alone says it (as many keys as queries, or one query, and no window), so the
    paths build the causal part block by block as they do for any causal call; None for a call that is not causal
    (each sequence sees all its keys)."""
    q_len, kv_len = sequence.q_len, sequence.kv_len
    if not is_causal or (not sliding_window and (q_len == 1 or q_len == kv_len)):
        return None
    allowed = causal_allowed(0, q_len, kv_len, q_len, device)
    if sliding_window:
        # transformers' sliding window: a query sees the keys fewer than ``sliding_window`` positions back.
        rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        allowed &= torch.arange(kv_len, device=device)[None, :] > rows - sliding_window
    return allowed[None, None]
