"""A patched module's attention over a paged KV cache: the keys of a serving engine's requests in the blocks its
block table names, written and read back by the scored layers themselves.

A serving engine (vLLM: :mod:`hf_neural_attn.integrations.vllm`) runs every request of a step in one forward of batch
1, the new tokens of all requests end to end, and describes the step as a :class:`PagedStep`: where each request's
queries lie, how many keys it has (its cached prefix, then its new tokens), its cache blocks, and the cache slot of
each new token. :func:`paged_scored_attention` writes the step's new keys and values to their slots and scores each
request's queries against its own keys only, causally from the end of its keys, on one of two paths:

* the paged kernel (:func:`hf_neural_attn.ops.triton.paged_fused_attention`), which walks the block table itself:
  no gather, one launch for the step. Where :func:`hf_neural_attn.ops.dispatch.resolve_paged_impl` says so (CUDA,
  or ``impl="triton"``). Neural Attention's key half R is kept in a cache of its own beside the keys
  (:func:`key_side_blocks`), written for the new tokens only.
* the torch paths: the keys gathered back (:class:`DecodingRows`, :class:`PrefillRun`), decoding requests (one query
  each) scored together as a padded batch with a request per row (:func:`hf_neural_attn.attention.decoding_attention`),
  each run of requests with several queries (prefills, prefill chunks) as a packed call
  (:func:`hf_neural_attn.attention.attention_with_keys`).

The layout inside a block is the engine's (any strides): the caller hands the key and value caches as views
(blocks, block_size, kv_heads, head_dim).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .attention import attention_with_keys, decoding_attention, extras_rows, query_rows
from .ops.dispatch import kernels_serve, resolve_paged_impl
from .ops.packed import decoding_batches, key_padding_mask
from .ops.terms import PAIR_MLP
from .ops.triton import paged_fused_attention, paged_kernel_unsupported_reason
from .record import EXTRAS_KWARG, SCORER_ATTR

# Where a module keeps Neural Attention's key half R of its paged cache (:func:`key_side_blocks`), with the cache
# storage it belongs to.
KEY_SIDE_ATTR = "_hf_neural_attn_key_side"


@dataclasses.dataclass(frozen=True)
class DecodingRows:
    """A batch of decoding requests, one per row: where their queries are and where each row's keys lie in the cache.

    positions: (rows,), each request's query in the step; block_ids: (rows * blocks,), each row's first ``blocks``
    cache blocks in order (enough for the longest row; a shorter row's table pads the rest); longest: the longest
    row's key count; mask: (rows, 1, 1, longest), True on a row's own keys; padding: (rows, 1, longest, 1), True on
    the slots after a row's own, or None where every row is as long as the longest.
    """

    positions: torch.Tensor
    block_ids: torch.Tensor
    longest: int
    mask: torch.Tensor
    padding: torch.Tensor | None

    def read(self, blocks: torch.Tensor, *, values: bool = False) -> torch.Tensor:
        """The rows' keys (``values``: values) from a layer's (blocks, block_size, kv_heads, head_dim) cache:
        (rows, kv_heads, longest, head_dim), contiguous (the scorers' matrix products then copy nothing).

        Whole blocks are copied (``index_select``: 2-3x faster than gathering slot by slot on this project's CPU),
        so a row's slots after its own keys hold whatever the cache holds there: its mask hides those keys, and its
        values there are set to 0, since a weight of 0 times a value that is not finite would not be 0."""
        rows = self.positions.shape[0]
        gathered = blocks.index_select(0, self.block_ids).view(rows, -1, *blocks.shape[2:])
        gathered = gathered[:, : self.longest].transpose(1, 2).contiguous()
        if values and self.padding is not None:
            gathered.masked_fill_(self.padding, 0)
        return gathered


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
class PagedStep:
    """One serving step over a paged cache, the same for every scored layer of the step (each reads its own cache at
    the same slots): build it once per step (:meth:`build`).

    query_start_loc: (requests + 1,) cumulative query counts; seq_lens: (requests,) each request's keys, cached and
    new; block_table: (requests, max_blocks) its cache blocks in order; slots: (tokens,) the cache slot (block *
    block_size + offset) of each new token. decoding, prefills: where the torch paths read the keys back.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    decoding: list[DecodingRows]
    prefills: list[PrefillRun]

    @classmethod
    def build(
        cls,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slots: torch.Tensor,
        *,
        block_size: int,
    ) -> PagedStep:
        """The step of ``requests = len(seq_lens)`` requests (the tensors as in the class doc; longer ones are cut
        to the requests), for caches of ``block_size`` tokens a block."""
        requests = seq_lens.shape[0]
        query_start_loc, block_table = query_start_loc[: requests + 1], block_table[:requests]
        starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
        table = block_table.to(torch.int64)
        query_counts = [end - start for start, end in zip(starts, starts[1:])]
        decoding = [
            _decoding_rows(table, batch, [starts[r] for r in batch], [lengths[r] for r in batch], block_size)
            for batch in decoding_batches(query_counts, lengths)
        ]
        prefills, request = [], 0
        while request < requests:
            if query_counts[request] <= 1:  # decoding (above), or no query this step
                request += 1
                continue
            end = request
            while end < requests and query_counts[end] > 1:
                end += 1
            prefills.append(
                _prefill_run(table[request:end], starts[request : end + 1], lengths[request:end], block_size)
            )
            request = end
        return cls(query_start_loc, seq_lens, block_table, slots, decoding, prefills)


def paged_scored_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    step: PagedStep,
    scaling: float | None,
    dropout: float = 0.0,
    **kwargs,
) -> torch.Tensor:
    """The attention of one scored module for one serving step (inference).

    query: (1, heads, tokens, head_dim); key, value: (1, kv_heads, tokens, head_dim), the step's new tokens of every
    request end to end (``tokens`` = ``step.slots``'s length; later rows are padding, left 0); key_blocks,
    value_blocks: the layer's cache, (blocks, block_size, kv_heads, head_dim) views. Writes the new keys and values to
    their slots, then returns (1, tokens, heads, head_dim).
    """
    scorer = getattr(module, SCORER_ATTR)
    tokens = step.slots.shape[0]
    write_tokens(key_blocks, value_blocks, key[0, :, :tokens], value[0, :, :tokens], step.slots)
    extras = kwargs.pop(EXTRAS_KWARG, None)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    output = query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1])
    if resolve_paged_impl(scorer.config.impl, scorer, device=query.device) == "triton":
        kernel_output = _kernel_attention(
            module, scorer, query[:, :, :tokens], key[:, :, :tokens], key_blocks, value_blocks, step, scaling, extras
        )
        if kernel_output is not None:
            output[:, :tokens] = kernel_output.transpose(1, 2)
            return output
    for rows in step.decoding:
        output[0, rows.positions] = decoding_attention(
            module, query_rows(query, rows.positions), rows.read(key_blocks), rows.read(value_blocks, values=True),
            rows.mask,
            scaling, dropout, extras_rows(extras, rows.positions), kwargs,
        )[:, 0]  # fmt: skip
    for run in step.prefills:
        queries = run.queries
        run_extras = {} if extras is None else {EXTRAS_KWARG: extras.query_block(queries.start, queries.stop)}
        output[:, queries], _ = attention_with_keys(
            module, query[:, :, queries], run.read(key_blocks), run.read(value_blocks), None, scaling, dropout,
            **kwargs, **run_extras, cu_seq_lens_q=run.cu_seq_lens_q, cu_seq_lens_k=run.cu_seq_lens_k,
        )  # fmt: skip
    return output


def _kernel_attention(
    module, scorer, query, key, key_blocks, value_blocks, step: PagedStep, scaling, extras
) -> torch.Tensor | None:
    """The paged kernel over the step: (1, heads, tokens, head_dim), or None where it cannot serve the call under
    ``impl="auto"`` (the torch paths then do, after a warning naming why); under ``impl="triton"`` that is a
    ``ValueError``. Neural Attention's key half R of the new tokens is written to its paged cache first
    (:func:`key_side_blocks`), where the kernel reads every key's."""
    fused = scorer.fused_inputs(query, key, extras)
    key_side = None
    if fused.term == PAIR_MLP:
        key_side = key_side_blocks(module, key_blocks, fused.hidden)
        block_size = key_blocks.shape[1]
        key_side[step.slots // block_size, step.slots % block_size] = fused.tensors[1][0].transpose(0, 1)
    call = (fused, query, key_blocks, value_blocks, step.block_table, step.seq_lens, step.query_start_loc)
    reason = paged_kernel_unsupported_reason(*call, key_side)
    if not kernels_serve(scorer.config.impl, reason, "serve this paged step", warn_fallback=True):
        return None
    return paged_fused_attention(*call, scaling, key_side)


def key_side_blocks(module: nn.Module, key_blocks: torch.Tensor, hidden: int) -> torch.Tensor:
    """The paged cache of Neural Attention's key half R of ``module``, (blocks, block_size, kv_heads, hidden), paged
    as ``key_blocks`` is (the same block and offset per key), made on first use and again when the engine gives the
    layer another cache. Its memory is ``hidden / (2 * head_dim)`` of the key and value cache's (3 % at h=4 and a
    head of 64), which the engine's memory profile does not count."""
    held = module.__dict__.get(KEY_SIDE_ATTR)
    identity = (key_blocks.untyped_storage().data_ptr(), tuple(key_blocks.shape[:3]), hidden)
    if held is None or held[0] != identity:
        blocks = key_blocks.new_zeros(*key_blocks.shape[:3], hidden)
        held = module.__dict__[KEY_SIDE_ATTR] = (identity, blocks)
    return held[1]


def write_tokens(
    key_blocks: torch.Tensor, value_blocks: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write the step's new keys and values, (kv_heads, tokens, head_dim), to their slots (block * block_size +
    offset, one per token)."""
    block_size = key_blocks.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_blocks[blocks, offsets] = key.transpose(0, 1).to(key_blocks.dtype)
    value_blocks[blocks, offsets] = value.transpose(0, 1).to(value_blocks.dtype)


def _decoding_rows(
    block_table: torch.Tensor, requests: list[int], positions: list[int], lengths: list[int], block_size: int
) -> DecodingRows:
    device = block_table.device
    longest = max(lengths)
    lengths_tensor = torch.tensor(lengths, device=device)
    mask = key_padding_mask(lengths_tensor, longest)
    padding = None if min(lengths) == longest else ~mask.view(len(lengths), 1, longest, 1)
    block_ids = block_table[requests, : -(-longest // block_size)].reshape(-1)
    return DecodingRows(torch.tensor(positions, device=device), block_ids, longest, mask, padding)


def _prefill_run(block_table: torch.Tensor, starts: list[int], lengths: list[int], block_size: int) -> PrefillRun:
    device = block_table.device
    lengths_tensor = torch.tensor(lengths, device=device)
    cumulative = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=device)
    cumulative[1:] = lengths_tensor.cumsum(0)
    request = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_tensor)
    position = torch.arange(request.shape[0], device=device) - cumulative[request]  # within its request
    return PrefillRun(
        slice(starts[0], starts[-1]), torch.tensor(starts, device=device) - starts[0], cumulative,
        block_table[request, position // block_size], position % block_size,
    )  # fmt: skip
