"""Names in transformers' attention registries: ``AttentionInterface`` (the attention function a model whose
``attn_implementation`` is that name calls) and ``AttentionMaskInterface`` (the mask builder for it).

These are transformers' public extension points, and the one change to transformers a patched model cannot run
without: its config names ``"hf_neural_attn"``. That is why the opt-out (``HF_NEURAL_ATTN_NO_INTEGRATIONS``,
:func:`hf_neural_attn.integrations.uninstall`) keeps it: ``patch_model`` and ``hf_neural_attn.from_pretrained``
register the name when they make a patched model.
"""

from __future__ import annotations

from collections.abc import Callable


def register_attention(name: str, attention_function: Callable, mask_builder: Callable | None = None) -> None:
    """Register ``attention_function`` under ``name`` (and ``mask_builder`` beside it). Registering again replaces
    the same entry: nothing accumulates."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_function)
    if mask_builder is not None:
        AttentionMaskInterface.register(name, mask_builder)
