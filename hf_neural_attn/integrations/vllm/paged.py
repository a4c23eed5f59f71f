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

import weakref

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from vllm.model_executor.layers.attention.attention import get_attention_context

from ...attention import PAGED_BASES
from ...paged_attention import PagedStep, paged_scored_attention
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

    A scored module's step runs as one opaque operator (:data:`SCORED_ATTENTION_OP`), as vLLM's own attention does:
    what it does depends on the step's requests (their counts are read on the host), so a graph vLLM compiles calls
    it rather than tracing into it, and vLLM's piecewise compilation splits its graphs there.
    """
    if getattr(module, SCORER_ATTR, None) is None:
        return ALL_ATTENTION_FUNCTIONS[VLLM_IMPLEMENTATION](
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layer_name = getattr(module, VLLM_LAYER_ATTR).layer_name
    extras = kwargs.get(EXTRAS_KWARG)
    if extras is not None:
        _EXTRAS_TYPES[layer_name] = type(extras)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    parts = [] if extras is None else list(extras)
    output = torch.ops.hf_neural_attn.vllm_scored_attention(query, key, value, parts, float(scaling), layer_name)
    return output, None


# The scored modules by their vLLM attention layer's name (what the operator is given, as vLLM's own attention
# operator is; :func:`register_scored_modules`), and the type of their scorer's per-query inputs, which the operator
# gets as a list of tensors.
_SCORED_MODULES: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
_EXTRAS_TYPES: dict[str, type] = {}
SCORED_ATTENTION_OP = "hf_neural_attn::vllm_scored_attention"


def register_scored_modules(model: nn.Module) -> None:
    """Make the scored attention modules of ``model`` (built by vLLM, each with its vLLM attention layer) known to
    the operator by their layer's name (held weakly: a model vLLM lets go is not kept)."""
    for module in model.modules():
        layer = getattr(module, VLLM_LAYER_ATTR, None)
        if getattr(module, SCORER_ATTR, None) is not None and hasattr(layer, "layer_name"):
            _SCORED_MODULES[layer.layer_name] = module


@torch.library.custom_op(SCORED_ATTENTION_OP, mutates_args=())
def _scored_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    extras: list[torch.Tensor | None],
    scaling: float,
    layer_name: str,
) -> torch.Tensor:
    """The step of the scored module behind ``layer_name``: its new keys and values written to vLLM's cache, each
    request scored against its own keys (:func:`hf_neural_attn.paged_attention.paged_scored_attention`)."""
    module = _SCORED_MODULES[layer_name]
    layer = getattr(module, VLLM_LAYER_ATTR)
    metadata, _, kv_cache, slots = get_attention_context(layer_name)
    if metadata is None:
        # vLLM's warm-up and memory-profiling runs, which have no cache yet: nothing is attended, as in vLLM's own
        # backends. (The profile so leaves out the scorers' working memory, which is linear in the tokens.)
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1])
    key_blocks, value_blocks = block_views(kv_cache, layer)
    step = _step_of(metadata, metadata.slot_mapping if slots is None else slots, key_blocks.shape[1])
    kwargs = {EXTRAS_KWARG: _EXTRAS_TYPES[layer_name]._make(extras)} if extras else {}
    return paged_scored_attention(module, query, key, value, key_blocks, value_blocks, step, scaling, **kwargs)


@_scored_attention.register_fake
def _scored_attention_fake(query, key, value, extras, scaling, layer_name):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])


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
