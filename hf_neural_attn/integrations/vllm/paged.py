"""A patched module's attention inside vLLM: keys written to and read back from vLLM's paged cache.

vLLM runs every request of a step in one forward of batch 1: the new tokens of all requests end to end. Its
Transformers modeling backend gives each attention module a vLLM ``Attention`` layer (``module.attn``), which owns the
layer's block of the paged KV cache, and the step's metadata says where each request's queries lie
(``query_start_loc``), how many keys it has (``seq_lens``: its cached prefix, then its new tokens) and in which cache
blocks they are (``block_table``; ``slot_mapping`` for the new tokens).

A scored module hands the step to the library (:func:`hf_neural_attn.paged_attention.paged_scored_attention`), which
writes its new keys and values to that cache itself and scores each request against its own keys only, causally from
the end of its keys: on a GPU with the paged kernel, which walks the block table; on a CPU on the torch paths, the keys
gathered back. vLLM's attention kernels never read a scored layer's cache, so the layout inside a block is this
module's (:func:`block_views`); prefix caching, chunked prefill and preemption work on whole blocks and need nothing
more.
A module the patch does not score runs vLLM's own attention function, kernels and layout.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from vllm.model_executor.layers.attention.attention import get_attention_context

from ...attention import PAGED_BASES
from ...paged_attention import PagedStep, paged_scored_attention
from ...record import SCORER_ATTR

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
    """
    if getattr(module, SCORER_ATTR, None) is None:
        return ALL_ATTENTION_FUNCTIONS[VLLM_IMPLEMENTATION](
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layer = getattr(module, VLLM_LAYER_ATTR)
    metadata, _, kv_cache, slots = get_attention_context(layer.layer_name)
    if metadata is None:
        # vLLM's warm-up and memory-profiling runs, which have no cache yet: nothing is attended, as in vLLM's own
        # backends. (The profile so leaves out the scorers' working memory, which is linear in the tokens.)
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1]), None
    key_blocks, value_blocks = block_views(kv_cache, layer)
    step = _step_of(metadata, metadata.slot_mapping if slots is None else slots, key_blocks.shape[1])
    output = paged_scored_attention(
        module, query, key, value, key_blocks, value_blocks, step, scaling, dropout, **kwargs
    )  # fmt: skip
    return output, None


# The last step, built at its first scored layer and kept for the others: (metadata, block size, step). vLLM builds a
# new metadata object each step; holding it here keeps its identity its own.
_last_step: tuple[object, int, PagedStep] | None = None


def _step_of(metadata, slots: torch.Tensor, block_size: int) -> PagedStep:
    """The :class:`~hf_neural_attn.paged_attention.PagedStep` vLLM's attention ``metadata`` describes (once per
    step)."""
    global _last_step
    if _last_step is not None and _last_step[0] is metadata and _last_step[1] == block_size:
        return _last_step[2]
    requests = metadata.query_start_loc.shape[0] - 1
    step = PagedStep.build(
        metadata.query_start_loc, metadata.seq_lens[:requests], metadata.block_table,
        slots[: metadata.num_actual_tokens], block_size=block_size,
    )  # fmt: skip
    _last_step = (metadata, block_size, step)
    return step


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
