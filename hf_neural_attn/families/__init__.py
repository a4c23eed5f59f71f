"""Family registry: adding a model family is one adapter module and one line here."""

from __future__ import annotations

from torch import nn

from .base import ModelFamily
from .bert import BertFamily, RobertaFamily
from .gpt2 import GPT2Family
from .llama import LlamaFamily
from .llama_like import GemmaFamily, MistralFamily, Qwen2Family, Qwen3Family
from .vit import ViTFamily

FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        LlamaFamily(),
        GPT2Family(),
        ViTFamily(),
        MistralFamily(),
        Qwen2Family(),
        Qwen3Family(),
        GemmaFamily(),
        BertFamily(),
        RobertaFamily(),
    )
}


def find_attention(model: nn.Module) -> tuple[ModelFamily, list[nn.Module], list[nn.Module]]:
    """The family of ``model``, its patchable self-attention modules in layer order, and every attention
    module that reads the model's attention implementation (those plus, e.g., cross-attention).

    Raises:
        TypeError: if no supported attention module is found.
    """
    for family in FAMILIES.values():
        patchable = [module for module in model.modules() if family.matches(module)]
        if patchable:
            readers = [module for module in model.modules() if family.reads_shared_config(module)]
            return family, patchable, readers
    raise TypeError(
        f"{type(model).__name__} has no attention module hf_neural_attn can patch. Supported families: "
        f"{sorted(FAMILIES)} ({', '.join(c.__name__ for f in FAMILIES.values() for c in f.attention_classes)})."
    )


__all__ = ["FAMILIES", "ModelFamily", "find_attention"]
