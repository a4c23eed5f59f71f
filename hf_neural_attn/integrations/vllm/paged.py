"""A patched module's attention inside vLLM: keys written to and read back from vLLM's paged cache.

vLLM runs every request of a step in one forward of batch 1: the new tokens of all requests end to end. Its
Transformers modeling backend gives each attention module a vLLM ``Attention`` layer (``module.attn``), which owns the
layer's block of the paged KV cache, and the step's metadata says where each request's queries lie
(``query_start_loc``), how many keys it has (``seq_lens``: its cached prefix, then its new tokens) and in which cache
blocks they are (``block_table``; ``slot_mapping`` for the new tokens).

A scored module writes its new keys and values to that cache itself, reads each request's keys back in order, and
hands them to the library's packed path (:func:`hf_neural_attn.attention.attention_with_keys` with
``cu_seq_lens_q`` / ``cu_seq_lens_k``), which scores each request against its own keys only, causally from the end of
its keys. vLLM's attention kernels never read a scored layer's cache, so the layout inside a block is this module's
(:func:`block_views`); prefix caching, chunked prefill and preemption work on whole blocks and need nothing more.
A module the patch does not score runs vLLM's own attention function, kernels and layout.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from vllm.model_executor.layers.attention.attention import get_attention_context

from ...attention import PAGED_BASES, attention_with_keys, decoding_attention, extras_rows, query_rows
from ...ops.packed import decoding_batches, key_padding_mask
from ...record import EXTRAS_KWARG, SCORER_ATTR

VLLM_IMPLEMENTATION = "vllm"  # the attention implementation vLLM's Transformers modeling backend sets on the config
VLLM_LAYER_ATTR = "attn"  # where that backend puts a module's vLLM Attention layer


def register() -> None:
    """Serve patched modules whose base implementation is vLLM's with :func:`paged_attention`."""
    PAGED_BASES[VLLM_IMPLEMENTATION] = paged_attention


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention of one module for one vLLM step.

    query: (1, heads, tokens, head_dim); key, value: (1, kv_heads, tokens, head_dim), the step's new tokens of every
    request end to end. Returns (1, tokens, heads, head_dim) and no probabilities.

    Decoding requests (one query) are scored together, a padded batch with one request per row
    (:func:`hf_neural_attn.attention.decoding_attention`); each run of requests with several queries (prefills,
    prefill chunks) as a packed call (:func:`hf_neural_attn.attention.attention_with_keys`).
    """
    if getattr(module, SCORER_ATTR, None) is None:
        return ALL_ATTENTION_FUNCTIONS[VLLM_IMPLEMENTATION](
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layer = getattr(module, VLLM_LAYER_ATTR)
    metadata, _, kv_cache, slots = get_attention_context(layer.layer_name)
    output = query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1])
    if metadata is None:
        # vLLM's warm-up and memory-profiling runs, which have no cache yet: nothing is attended, as in vLLM's own
        # backends. (The profile so leaves out the scorers' working memory, which is linear in the tokens.)
        return output, None
    tokens = metadata.num_actual_tokens
    key_blocks, value_blocks = block_views(kv_cache, layer)
    slots = metadata.slot_mapping if slots is None else slots
    write_tokens(key_blocks, value_blocks, key[0, :, :tokens], value[0, :, :tokens], slots[:tokens])
    reads = step_reads(metadata, *key_blocks.shape[1:3])
    extras = kwargs.pop(EXTRAS_KWARG, None)
    for rows in reads.decoding:
        keys, values = rows.read(key_blocks), rows.read(value_blocks)
        output[0, rows.positions] = decoding_attention(
            module, query_rows(query, rows.positions), keys, values, rows.mask, scaling, dropout,
            extras_rows(extras, rows.positions), kwargs,
        )[:, 0]  # fmt: skip
    for run in reads.prefills:
        queries = run.queries
        run_extras = {} if extras is None else {EXTRAS_KWARG: extras.query_block(queries.start, queries.stop)}
        output[:, queries], _ = attention_with_keys(
            module, query[:, :, queries], run.read(key_blocks), run.read(value_blocks), None, scaling, dropout,
            **kwargs, **run_extras, cu_seq_lens_q=run.cu_seq_lens_q, cu_seq_lens_k=run.cu_seq_lens_k,
        )  # fmt: skip
    return output, None


@dataclasses.dataclass(frozen=True)
class DecodingRows:
    """A batch of decoding requests, one per row: where their queries are and where each row's keys lie in the cache.

    positions: (rows,), each request's query in the step; blocks, offsets: (rows, 1, longest), the cache slot of
    each row's keys in order (a row's padding repeats its last key); heads: (kv_heads, 1), the cache's heads; mask:
    (rows, 1, 1, longest), True on a row's own keys.
    """

    positions: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    heads: torch.Tensor
    mask: torch.Tensor

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        """The rows' keys (or values) from a layer's (blocks, block_size, kv_heads, head_dim) cache: (rows,
        kv_heads, longest, head_dim), contiguous (the scorers' matrix products then copy nothing)."""
        return blocks[self.blocks, self.offsets, self.heads]


@dataclasses.dataclass(frozen=True)
class PrefillRun:
    """Consecutive requests with several queries each, as one packed call: its span of the step's queries, the
    cumulative query and key counts (from 0), and the cache slot of each of its keys in order (total_keys,)."""

    queries: slice
    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        """The run's keys (or values) end to end: (1, kv_heads, total_keys, head_dim)."""
        return blocks[self.blocks, self.offsets].transpose(0, 1)[None]


@dataclasses.dataclass(frozen=True)
class StepReads:
    """Where a step's scored layers read their requests' keys: the same slots in every layer's own cache."""

    decoding: list[DecodingRows]
    prefills: list[PrefillRun]


# The last step's reads, worked out at its first scored layer and kept for the others: (metadata, (block size,
# kv heads), reads). The metadata object is vLLM's per step (a new one each step), held here so that its identity
# stays its own.
_last_step: tuple[object, tuple[int, int], StepReads] | None = None


def step_reads(metadata, block_size: int, kv_heads: int) -> StepReads:
    """The :class:`StepReads` of the step vLLM's attention ``metadata`` describes, for caches of ``block_size``
    tokens a block and ``kv_heads`` heads (worked out once per step)."""
    global _last_step
    if _last_step is not None and _last_step[0] is metadata and _last_step[1] == (block_size, kv_heads):
        return _last_step[2]
    requests = metadata.query_start_loc.shape[0] - 1
    starts = metadata.query_start_loc[: requests + 1].tolist()
    lengths = metadata.seq_lens[:requests].tolist()
    block_table = metadata.block_table[:requests].to(torch.int64)
    query_counts = [end - start for start, end in zip(starts, starts[1:])]
    decoding = [
        _decoding_rows(block_table, [starts[request] for request in batch], [lengths[request] for request in batch],
                       batch, block_size, kv_heads)
        for batch in decoding_batches(query_counts, lengths)
    ]  # fmt: skip
    prefills = []
    request = 0
    while request < requests:
        if query_counts[request] <= 1:  # decoding (above), or no query this step
            request += 1
            continue
        end = request
        while end < requests and query_counts[end] > 1:
            end += 1
        prefills.append(
            _prefill_run(block_table[request:end], starts[request : end + 1], lengths[request:end], block_size)
        )
        request = end
    reads = StepReads(decoding, prefills)
    _last_step = (metadata, (block_size, kv_heads), reads)
    return reads


def _decoding_rows(
    block_table: torch.Tensor,
    positions: list[int],
    lengths: list[int],
    requests: list[int],
    block_size: int,
    kv_heads: int,
) -> DecodingRows:
    device = block_table.device
    lengths_tensor = torch.tensor(lengths, device=device)
    key_positions = torch.minimum(torch.arange(max(lengths), device=device)[None, :], lengths_tensor[:, None] - 1)
    blocks = block_table[requests].gather(1, key_positions // block_size)
    return DecodingRows(
        torch.tensor(positions, device=device), blocks[:, None], (key_positions % block_size)[:, None],
        torch.arange(kv_heads, device=device)[:, None], key_padding_mask(lengths_tensor, key_positions.shape[1]),
    )  # fmt: skip


def _prefill_run(block_table: torch.Tensor, starts: list[int], lengths: list[int], block_size: int) -> PrefillRun:
    device = block_table.device
    lengths_tensor = torch.tensor(lengths, device=device)
    cumulative = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=device)
    cumulative[1:] = lengths_tensor.cumsum(0)
    request = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_tensor)
    position = torch.arange(request.shape[0], device=device) - cumulative[request]  # within its request
    cu_q = torch.tensor(starts, device=device) - starts[0]
    return PrefillRun(
        slice(starts[0], starts[-1]), cu_q, cumulative, block_table[request, position // block_size],
        position % block_size,
    )  # fmt: skip


def block_views(kv_cache: torch.Tensor, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's key and value cache as two views (blocks, block_size, kv_heads, head_dim) of its cache tensor.

    The cache's shape is the attention backend's (``get_kv_cache_shape``): vLLM's CPU attention keeps
    (blocks, kv_heads, block_size, 2 * head_dim), keys in the first half of each row; its GPU backends keep
    (2, blocks, block_size, kv_heads, head_dim). The views index the same memory, whichever strides the backend chose.
    """
    heads, head_dim = layer.num_kv_heads, layer.head_size
    if kv_cache.dim() == 4 and kv_cache.shape[1] == heads and kv_cache.shape[3] == 2 * head_dim:
        blocks, _, block_size, _ = kv_cache.shape
        halves = kv_cache.view(blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
        return tuple(half.transpose(1, 2) for half in halves)
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (heads, head_dim):
        return kv_cache[0], kv_cache[1]
    raise ValueError(
        f"hf_neural_attn cannot read the paged cache of {layer.layer_name}: shape {tuple(kv_cache.shape)} is not a "
        "layout the plugin knows (vLLM's CPU attention or its GPU backends' (2, blocks, block_size, kv_heads, "
        "head_dim)). Choose one of those attention backends."
    )


def write_tokens(
    key_blocks: torch.Tensor, value_blocks: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write the step's new keys and values, (kv_heads, tokens, head_dim), to their slots (block * block_size +
    offset, one per token)."""
    block_size = key_blocks.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_blocks[blocks, offsets] = key.transpose(0, 1).to(key_blocks.dtype)
    value_blocks[blocks, offsets] = value.transpose(0, 1).to(value_blocks.dtype)
