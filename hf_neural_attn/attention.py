"""The attention function a patched model runs, registered in transformers' ``AttentionInterface``, and the
mask builder registered beside it in ``AttentionMaskInterface``.

transformers calls the function from every attention module of a model whose ``attn_implementation`` is
``"hf_neural_attn"``. A module that carries a scorer (``attn_scorer``) is scored by it; every other module
(layers left out by ``layers=``, cross-attention) is handed back to the model's original implementation.

The masks are what the model's original implementation would build (:func:`hf_neural_attention_mask`), so
the modules the patch does not score see exactly the mask they saw before, edge cases included (an SDPA
cross-attention row whose encoder input is all padding). The scored path accepts every form those take.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn
from transformers.masking_utils import eager_mask, sdpa_mask

from . import placements
from .compat.internals import output_attentions_collector
from .families import FAMILIES, ModelFamily
from .ops.call_shapes import CONTEXT, ORDINARY, PACKED, PAGED
from .ops.context_parallel import ContextShards, attention_across_ranks
from .ops.dispatch import scored_attention
from .ops.dropout import DropoutPlacement, draw_seed
from .ops.masks import as_additive_mask, zero_rows_without_keys
from .ops.packed import (
    PACKING_KWARGS,
    decoding_batches,
    key_padding_mask,
    packed_sequences,
    padded_keys,
    sequence_mask,
)
from .parallel.context import (
    check_context_parallel_scorer,
    context_parallel_shards,
    packed_call_refused,
    refuse_unscored_under_context_parallelism,
)
from .parallel.sequence import check_no_sequence_parallelism
from .patched_config import is_patched_config
from .record import ATTN_IMPLEMENTATION, EXTRAS_KWARG, FALLBACK_ATTR, SCORER_ATTR
from .scorers import Scorer

# Base implementations that keep a model's keys in a paged cache of their own, which only they can read and write
# (vLLM's "vllm"), by name: the function that serves a patched model's attention modules over such a base. It is
# called as the attention function is, and writes the call's keys to the cache, reads each sequence's keys back and
# hands them to :func:`attention_with_keys`. The integrations fill it (hf_neural_attn.integrations.vllm), so that this
# module knows no serving engine.
PAGED_BASES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {}


def hf_neural_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function registered as ``"hf_neural_attn"`` (transformers' attention-function API).

    query: (batch, heads, q_len, head_dim); key, value: (batch, kv_heads, kv_len, head_dim).
    Returns (batch, q_len, heads, head_dim) output and the attention probabilities.

    Over a paged base (:data:`PAGED_BASES`) the call goes to that base's function, which reads the keys from its
    cache; otherwise the keys are the call's own (:func:`attention_with_keys`).
    """
    context_shards = context_parallel_shards()
    shape = call_shape(module, kwargs, context_shards)
    if shape == PAGED:
        paged = PAGED_BASES[base_implementation(module.config)]
        return paged(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return _attention_of_shape(
        shape, context_shards, module, query, key, value, attention_mask, scaling, dropout, kwargs
    )


def call_shape(module: nn.Module, kwargs: dict, context_shards: ContextShards | None) -> str:
    """The shape of this call (a name of :data:`hf_neural_attn.ops.call_shapes.CALL_SHAPES`), as the call shows it:
    ``"paged"`` over a base whose keys stay in an engine's cache, else :func:`keys_call_shape`. ``context_shards``:
    :func:`~hf_neural_attn.parallel.context.context_parallel_shards`, read once per call by the caller. The one place
    that tells it (a padded batch is the dispatcher's, which splits one only where its path gains)."""
    # PAGED_BASES is empty unless an integration registered one: no lookup of the config on the usual path.
    if PAGED_BASES and base_implementation(getattr(module, "config", None)) in PAGED_BASES:
        return PAGED
    return keys_call_shape(kwargs, context_shards)


def keys_call_shape(kwargs: dict, context_shards: ContextShards | None) -> str:
    """The shape of a call that carries its keys: ``"packed"`` (``cu_seq_lens_q`` and ``cu_seq_lens_k``: several
    sequences in one row), ``"context"`` (torch's context-parallel block is open: ``context_shards``) or
    ``"ordinary"``.

    Raises:
        ValueError: a packed call under context parallelism (each process holds a slice of the row).
    """
    if kwargs.get("cu_seq_lens_q") is not None:
        if context_shards is not None:
            raise packed_call_refused()
        if kwargs.get("cu_seq_lens_k") is not None:
            return PACKED
    return CONTEXT if context_shards is not None else ORDINARY


def attention_with_keys(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`hf_neural_attention_forward` over the keys and values the call carries (a paged base's function calls
    it with the keys it read back). Shapes as there."""
    context_shards = context_parallel_shards()
    shape = keys_call_shape(kwargs, context_shards)
    return _attention_of_shape(
        shape, context_shards, module, query, key, value, attention_mask, scaling, dropout, kwargs
    )


def _attention_of_shape(
    shape: str,
    context_shards: ContextShards | None,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A call whose keys it carries, served as its ``shape`` says (:func:`keys_call_shape`). A packed call runs one
    sequence at a time, each against its own keys (:mod:`hf_neural_attn.ops.packed`), scored or not."""
    extras = kwargs.pop(EXTRAS_KWARG, None)
    is_causal = kwargs.get("is_causal", getattr(module, "is_causal", False))
    sequences = packed_sequences(query, key, kwargs) if shape == PACKED else None
    if sequences is None:
        return _attention(
            module, query, key, value, attention_mask, scaling, dropout, extras, is_causal, kwargs,
            context_shards=context_shards,
        )  # fmt: skip
    sliding_window = kwargs.get("sliding_window")
    call_kwargs = {name: value for name, value in kwargs.items() if name not in PACKING_KWARGS}
    eager_base = getattr(module, SCORER_ATTR, None) is None and _unscored_implementation(module) == "eager"
    output = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    # Decoding requests (one query each) are scored together, a padded batch with one request per row
    # (:func:`decoding_attention`): one call instead of one per request, whose fixed cost is most of a decode step's.
    # Only where each query sees all its keys and nothing else depends on the split (eval, no maps, no window or mask).
    batched = (
        getattr(module, SCORER_ATTR, None) is not None and not module.training and attention_mask is None
        and not sliding_window and not wants_attention_weights(kwargs)
    )  # fmt: skip
    counts = ([sequence.q_len for sequence in sequences], [sequence.kv_len for sequence in sequences])
    for indices in decoding_batches(*counts) if batched else []:
        batch = [sequences[index] for index in indices]
        positions = torch.tensor([sequence.queries.start for sequence in batch], device=query.device)
        lengths = torch.tensor([sequence.kv_len for sequence in batch], device=query.device)
        keys = padded_keys(key, batch)
        output[0, positions] = decoding_attention(
            module, query_rows(query, positions), keys, padded_keys(value, batch),
            key_padding_mask(lengths, keys.shape[-2]), scaling, dropout, extras_rows(extras, positions), call_kwargs,
        )[:, 0]  # fmt: skip
    for sequence in sequences:
        if batched and sequence.q_len == 1:
            continue
        sequence_query, sequence_key = sequence.query_of(query), sequence.keys_of(key)
        if attention_mask is not None:
            # A mask over the whole packed row (a packed training batch whose model built one, causal over the row):
            # its block on this sequence's queries and keys, in the form the model's implementation gave it.
            mask = sequence.mask_of(attention_mask)
        else:  # continuous batching builds none: each sequence's own, causal from the end of its keys
            mask = sequence_mask(sequence, is_causal=is_causal, sliding_window=sliding_window, device=query.device)
            if eager_base:  # eager adds its mask to the logits, and builds no causal mask of its own
                mask = _additive_mask(mask, sequence_query, sequence_key, is_causal)
        output[:, sequence.queries], _ = _attention(
            module, sequence_query, sequence_key, sequence.keys_of(value), mask, scaling, dropout,
            sequence.extras_of(extras, query.shape[0]), is_causal, call_kwargs, context_shards=None,
        )  # fmt: skip
    return output, None


def decoding_attention(
    module: nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    dropout: float,
    extras,
    kwargs: dict,
) -> torch.Tensor:
    """Decoding requests of a packed call scored as one padded batch, a request per row: each query against its own
    keys only.

    query: (rows, heads, 1, head_dim); keys, values: (rows, kv_heads, longest, head_dim), padded after each row's
    own; mask: (rows, 1, 1, longest), True on a row's own keys (:func:`hf_neural_attn.ops.packed.key_padding_mask`);
    extras: the scorer's per-query inputs for these rows (:func:`extras_rows`). Returns (rows, 1, heads, head_dim).
    """
    return _attention(module, query, keys, values, mask, scaling, dropout, extras, False, kwargs, context_shards=None)[
        0
    ]


def query_rows(query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Queries ``positions`` of a packed call's (1, heads, total_q, head_dim), one per row: (rows, heads, 1,
    head_dim)."""
    return query[0][:, positions].transpose(0, 1)[:, :, None]


def extras_rows(extras, positions: torch.Tensor):
    """A scorer's per-query inputs of a packed call (batch 1) for queries ``positions``, one query per row, as
    :func:`query_rows` lays out the queries; None stays None."""
    return None if extras is None else extras.query_rows(positions)


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    extras,
    is_causal: bool,
    kwargs: dict,
    *,
    context_shards: ContextShards | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One call of :func:`hf_neural_attention_forward` (an ordinary or a context-parallel one, ``context_shards``
    saying which; or one sequence of a packed call): ``module``'s scorer, or the model's own attention for a module
    the patch does not score. Shapes as there; ``extras`` is the scorer's per-query inputs."""
    need_weights = wants_attention_weights(kwargs)
    scorer: Scorer | None = getattr(module, SCORER_ATTR, None)
    if scorer is None:
        return _unscored_attention(
            module, query, key, value, attention_mask, scaling, dropout, is_causal, kwargs,
            need_weights=need_weights, context_parallel=context_shards is not None,
        )  # fmt: skip
    if scorer.needs_hidden_states and extras is None:
        raise RuntimeError(
            f"The {scorer.name!r} scorer of {type(module).__name__} got no query inputs: its forward pre-hook "
            "did not run. Call the attention module itself (not the attention function directly)."
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    check_no_sequence_parallelism()
    family = FAMILIES.get(getattr(module, FALLBACK_ATTR)[0], ModelFamily)  # named in a dropout value's error
    score = functools.partial(
        scored_attention,
        scorer,
        scaling=scaling,
        dropout=dropout,
        dropout_source=f"config.{family.attention_dropout_field}",
        training=module.training,
        need_weights=need_weights,
    )
    heads = placements.heads_held(scorer, query.shape[1])
    placement = None
    if module.training and dropout > 0 and (heads is not None or context_shards is not None):
        # A part of an attention computed in parts drops what the whole would: one seed for the whole, the heads'
        # and rows' places in it.
        first_head, total_heads = heads if heads is not None else (0, query.shape[1])
        placement = DropoutPlacement(draw_seed(), first_head, total_heads)
    # The paths read the scorer's parameters without calling it as a module (no module hook runs for them): each
    # placement puts them in place for the call (accelerate's offloaded tensors loaded, tensor parallelism's shards
    # read as local tensors).
    with placements.scorer_in_place(scorer):
        if context_shards is None:
            mask = _scoring_mask(attention_mask, query, key, is_causal)
            return score(query, key, value, mask, extras=extras, is_causal=is_causal, dropout_placement=placement)
        # Context parallelism: this process holds a slice of the sequence; its queries are scored against every
        # process's keys, a block of queries at a time with the keys its positions see.
        check_context_parallel_scorer(scorer)

        def attend(rows, keys, values, rows_extras, first_position):
            rows_placement = dataclasses.replace(placement, row_offset=first_position) if placement else None
            return score(
                rows, keys, values, None, extras=rows_extras, is_causal=is_causal, dropout_placement=rows_placement
            )[0]

        output = attention_across_ranks(
            context_shards, query, key, value, attention_mask, extras, is_causal=is_causal, need_weights=need_weights,
            attend=attend,
        )  # fmt: skip
        return output, None


def _unscored_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    is_causal: bool,
    kwargs: dict,
    *,
    need_weights: bool,
    context_parallel: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_attention` for a module the patch does not score: the model's own attention, over the base it runs
    (:func:`_unscored_implementation`). Shapes as in :func:`hf_neural_attention_forward`."""
    implementation = _unscored_implementation(module)
    family_name = getattr(module, FALLBACK_ATTR)[0]
    if context_parallel:
        refuse_unscored_under_context_parallelism(implementation, module)
    if need_weights and implementation != "eager":
        # Only the eager path returns probabilities. It adds its mask to the logits, so it gets the
        # additive form of the mask this call carries (which may be SDPA's boolean one, or None for causal);
        # the rows SDPA's boolean mask allows no key stay SDPA's zeros, so asking for maps changes no output.
        boolean_mask = _scoring_mask(attention_mask, query, key, is_causal)
        output, weights = FAMILIES[family_name].original_attention(
            module, "eager", query, key, value, _additive_mask(attention_mask, query, key, is_causal), scaling,
            dropout, **kwargs,
        )  # fmt: skip
        output, weights = zero_rows_without_keys(boolean_mask, output.transpose(1, 2), weights)
        return output.transpose(1, 2), weights
    return FAMILIES[family_name].original_attention(
        module, implementation, query, key, value, attention_mask, scaling, dropout, **kwargs
    )


def wants_attention_weights(kwargs: dict) -> bool:
    """Whether the caller of this attention call asked for its probabilities (``output_attentions``).

    Most models pass ``output_attentions`` on to the attention function, but not all (GPT-2's model forward
    drops it). transformers 5 collects the maps with forward hooks on the attention modules while a
    collector for an ``*attentions`` output is active, so that collector is the signal every model gives.
    """
    if kwargs.get("output_attentions"):
        return True
    collected = output_attentions_collector()
    return bool(collected) and any(key.endswith("attentions") for key in collected)


def _scoring_mask(attention_mask, query: torch.Tensor, key: torch.Tensor, is_causal: bool) -> torch.Tensor | None:
    """The call's mask in a form the scoring paths take (see :mod:`hf_neural_attn.ops.masks`), without a copy.

    It accepts every form :func:`hf_neural_attention_mask` hands out: the eager float mask, SDPA's boolean mask
    (True = attend), or None. None on a causal module means what it means to SDPA, which is where
    transformers leaves it out (its ``is_causal``): causal aligned to the first query. transformers does that
    only when there are as many keys as queries or a single query, where that is the paths' own causal
    alignment (to the end of the keys), so None stays None and the paths build the causal part block by block.
    A direct call without a mask and with more keys than queries gets SDPA's alignment as an explicit mask, so
    the causal mask is never silently dropped or shifted.
    """
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        if is_causal and 1 < q_len != kv_len:
            return torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()[None, None]
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"hf_neural_attn needs a tensor attention mask, got {type(attention_mask).__name__}; "
            "flex-attention block masks are not supported."
        )
    return attention_mask[..., :kv_len]


def _additive_mask(attention_mask, query: torch.Tensor, key: torch.Tensor, is_causal: bool) -> torch.Tensor | None:
    """The call's mask as an additive float mask, (batch or 1, 1, q_len, kv_len), or None for full attention
    (for the eager implementation of the modules the patch does not score)."""
    return as_additive_mask(
        _scoring_mask(attention_mask, query, key, is_causal),
        q_len=query.shape[-2],
        kv_len=key.shape[-2],
        is_causal=is_causal,
        dtype=query.dtype,
        device=query.device,
    )


def base_implementation(config) -> str | None:
    """The base implementation a patched config holds (what ``set_attn_implementation`` last chose), or None for a
    config the patch did not mark."""
    return config.base_attn_implementation if is_patched_config(config) else None


def _unscored_implementation(module: nn.Module) -> str:
    """The implementation a module the patch does not score runs: its config's base (what
    ``set_attn_implementation`` last chose) or, without one, the implementation it was patched over."""
    if not hasattr(module, FALLBACK_ATTR):
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={ATTN_IMPLEMENTATION!r} but was not patched: the name "
            "was set by hand on a config that carries no patch, or the model was built from a patched config before "
            "hf_neural_attn was imported, or as a part inside another model. Patch it with "
            "hf_neural_attn.patch_model(model, scorer); load a patched checkpoint with "
            "hf_neural_attn.from_pretrained(path) (or any from_pretrained after `import hf_neural_attn`); a model "
            "built from a patched model's config, by its class or AutoModel*.from_config, is patched like it."
        )
    patched_over = getattr(module, FALLBACK_ATTR)[1]
    return runnable_base(base_implementation(getattr(module, "config", None)) or patched_over)


def runnable_base(base: str) -> str:
    """The implementation the modules the patch does not score run over ``base``: eager and SDPA as they are; flash
    and flex need masks of their own, which the scored modules do not take, so everything else runs SDPA."""
    return base if base in ("eager", "sdpa") else "sdpa"


def hf_neural_attention_mask(*args, config=None, **kwargs):
    """The mask builder registered as ``"hf_neural_attn"`` (transformers' ``AttentionMaskInterface`` API).

    Builds what the model's base implementation would get (:func:`base_implementation` of ``config``, which
    transformers passes to mask builders): SDPA's mask (boolean, or None where SDPA's ``is_causal`` or no mask is
    exact) over an SDPA base, the eager float mask over an eager one. So the modules the patch does not score
    (cross-attention, layers left out by ``layers=``) run exactly as they would unpatched; the scored modules turn
    any of them into an additive mask (:func:`_additive_mask`).

    Bases other than eager and SDPA (flash, flex) run their unscored modules through SDPA (:func:`runnable_base`) and
    get SDPA's mask. A config the patch did not mark gets the eager mask, which every path accepts.
    """
    base = base_implementation(config)
    if base in PAGED_BASES:  # each sequence's mask is made where its keys are read back from the cache
        return None
    builder = eager_mask if base in (None, "eager") else sdpa_mask
    return builder(*args, config=config, **kwargs)
