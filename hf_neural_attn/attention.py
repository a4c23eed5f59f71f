"""The attention function a patched model runs, registered in transformers' ``AttentionInterface``.

transformers calls it from every attention module of a model whose ``attn_implementation`` is
``"hf_neural_attn"``. A module that carries a scorer (``attn_scorer``) is scored by it; every other module
(layers left out by ``layers=``, cross-attention) is handed back to the model's original implementation.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from .families import FAMILIES
from .ops import scored_attention
from .scorers import Scorer

ATTN_IMPLEMENTATION = "hf_neural_attn"
SCORER_ATTR = "attn_scorer"  # submodule of each patched attention module
# On every attention module that reads the patched config: (family name, original implementation), so
# the modules the patch does not score keep running the model's own attention.
FALLBACK_ATTR = "_hf_neural_attn_fallback"
EXTRAS_KWARG = "hf_neural_attn_extras"  # per-query scorer inputs passed from the pre-hook to the attention function


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
    """
    extras = kwargs.pop(EXTRAS_KWARG, None)
    scorer: Scorer | None = getattr(module, SCORER_ATTR, None)
    if scorer is None:
        if not hasattr(module, FALLBACK_ATTR):
            raise RuntimeError(
                f"{type(module).__name__} runs attn_implementation={ATTN_IMPLEMENTATION!r} but was not patched. "
                "Either the name was set by hand (patch with hf_neural_attn.patch_model instead), or this model "
                "shares its config object with a patched model (build each model from its own copy of the config)."
            )
        family_name, implementation = getattr(module, FALLBACK_ATTR)
        return FAMILIES[family_name].original_attention(
            module, implementation, query, key, value, attention_mask, scaling, dropout, **kwargs
        )
    if scorer.needs_hidden_states and extras is None:
        raise RuntimeError(
            f"The {scorer.name!r} scorer of {type(module).__name__} got no query inputs: its forward pre-hook "
            "did not run. Call the attention module itself (not the attention function directly)."
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    is_causal = kwargs.get("is_causal", getattr(module, "is_causal", False))
    mask = _additive_mask(attention_mask, query, key, is_causal)
    return scored_attention(
        scorer,
        query,
        key,
        value,
        mask,
        scaling=scaling,
        dropout=dropout,
        training=module.training,
        extras=extras,
        is_causal=is_causal,
        need_weights=bool(kwargs.get("output_attentions")),
    )


def _additive_mask(attention_mask, query: torch.Tensor, key: torch.Tensor, is_causal: bool) -> torch.Tensor | None:
    """An additive float mask (0 = attend, large negative = blocked), (batch or 1, 1, q_len, kv_len).

    A causal module handed no mask (a direct call, or a custom mask function that skipped it) gets the
    causal mask built here, aligned to the last query, so the causal mask is never silently dropped.
    """
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        if not is_causal or q_len == 1:
            return None
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        attention_mask = allowed[None, None]
    elif not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"hf_neural_attn needs a tensor attention mask, got {type(attention_mask).__name__}; "
            "flex-attention block masks are not supported."
        )
    attention_mask = attention_mask[..., :kv_len]
    if attention_mask.dtype == torch.bool:
        blocked = torch.finfo(query.dtype).min
        return torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~attention_mask, blocked
        )
    return attention_mask


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_neural_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)


_register()
