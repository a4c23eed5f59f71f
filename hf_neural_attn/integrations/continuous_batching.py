"""Continuous batching of patched models: the one place the library changes transformers' continuous-batching code.

transformers' continuous-batching manager (``generate_batch``, ``init_continuous_batching``,
``generate(cache_implementation="paged")``, ``transformers serve --continuous-batching``) first switches the model to
an implementation it knows (``switch_to_cb_friendly_attn``): a flash one where flash-attn is installed, else
``"paged|eager"`` or ``"sdpa"``, refusing every other name. It keeps no registry of implementations that take packed
calls, so there is no public hook to name ours. Left alone, it refuses a patched model; with flash-attn installed it
switches the base to flash, and the scorers would get every request of a step as one sequence.

:func:`install` wraps that one method, for patched models only (every other model gets transformers' code
unchanged): the model keeps ``"hf_neural_attn"``, so the manager builds no attention mask (its masks are for the
eager and SDPA names) and hands each layer packed calls, which the attention function splits into requests
(:mod:`hf_neural_attn.ops.packed`), scored layers and unscored ones alike. Before anything is generated it checks that
this transformers hands the attention function each request's keys (:func:`continuous_batching_unsupported_reason`).
"""

from __future__ import annotations

import functools
import inspect

import transformers

from ..patched_config import is_patched_config
from .wrapping import wrap_once


def continuous_batching_unsupported_reason() -> str | None:
    """Why this transformers cannot serve patched models by continuous batching, or None when it can.

    The scorers need each request's keys. From transformers 5.19 (read from the code, not the version) the layers
    give the paged cache their keyword arguments (``cache.update(..., kwargs=)``) and it returns the keys read back
    with the new ones; before, the paged implementations wrote and read the cache themselves, inside the attention
    function of each name.
    """
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    if "kwargs" not in inspect.signature(PagedAttentionCache.update).parameters:
        return (
            f"transformers {transformers.__version__}'s continuous batching hands the paged cache to the attention "
            "implementations it knows, which read and write it themselves; hf_neural_attn's scorers need transformers "
            ">= 5.19, where the cache hands every implementation the keys. Upgrade transformers "
            "(pip install -U 'transformers>=5.19'), or generate with model.generate (dynamic or static cache), which "
            "serves patched models on every release."
        )
    return None


def install(continuous_api) -> None:
    """Wrap ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` (once) in the module ``continuous_api``
    (``transformers.generation.continuous_batching.continuous_api``), as the module docstring says."""
    wrap_once(continuous_api.ContinuousBatchingManager, "switch_to_cb_friendly_attn", _keep_patched_models)


def _keep_patched_models(original):
    @functools.wraps(original)
    def switch_to_cb_friendly_attn(manager, model, *args, **kwargs):
        if not is_patched_config(getattr(model, "config", None)):
            return original(manager, model, *args, **kwargs)
        reason = continuous_batching_unsupported_reason()
        if reason is not None:
            raise ValueError(f"Continuous batching of a model patched by hf_neural_attn: {reason}")
        # Nothing to switch: the attention function takes packed calls itself, so nothing to restore at stop either.
        return None

    return switch_to_cb_friendly_attn
