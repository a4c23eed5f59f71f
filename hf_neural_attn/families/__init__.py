"""Family registry: adding a model family is one adapter module and one line here."""

from __future__ import annotations

from torch import nn

from .base import ModelFamily
from .bert import BertFamily, RobertaFamily
from .gpt2 import GPT2Family
from .llama import LlamaFamily
from .llama_like import LLAMA_LIKE
from .phi3 import Phi3Family
from .standard import StandardAttentionFamily, UnsupportedAttentionError
from .standard_decoders import STANDARD_DECODERS
from .vit import ViTFamily

FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        LlamaFamily(),
        GPT2Family(),
        ViTFamily(),
        *LLAMA_LIKE,
        BertFamily(),
        RobertaFamily(),
        Phi3Family(),
        *STANDARD_DECODERS,
        # Last: the generic fallback for any other model with the standard attention plumbing.
        StandardAttentionFamily(),
    )
}


def find_attention(model: nn.Module) -> tuple[ModelFamily, list[nn.Module], list[nn.Module]]:
    """The family of ``model``, its patchable self-attention modules in layer order, and every attention
    module that reads the model's attention implementation (those plus, e.g., cross-attention).

    Families are tried in registry order; the generic standard-attention family comes last and warns, since
    the model it serves is not in the tested matrix (its probe still checks each module when it is patched).

    Raises:
        TypeError: if no supported attention module is found, or (:class:`UnsupportedAttentionError`) the
            generic path found several kinds of attention.
    """
    for family in FAMILIES.values():
        patchable = [module for module in model.modules() if family.matches(module)]
        if patchable:
            if isinstance(family, StandardAttentionFamily):
                # Probe every module now, so a refusal comes before the generic path's warning.
                family.check(patchable)
                family.warn_if_generic(model, patchable)
            readers = [module for module in model.modules() if family.reads_shared_config(module)]
            return family, patchable, readers
    raise TypeError(
        f"{type(model).__name__} has no attention module hf_neural_attn can patch. Supported families: "
        f"{sorted(FAMILIES)} ({', '.join(c.__name__ for f in FAMILIES.values() for c in f.attention_classes)}), "
        "and any attention module with transformers' standard plumbing (q_proj/k_proj/v_proj, RoPE from "
        "position_embeddings, the attention-function registry; see docs/families.md)."
    )


__all__ = ["FAMILIES", "ModelFamily", "UnsupportedAttentionError", "find_attention"]
