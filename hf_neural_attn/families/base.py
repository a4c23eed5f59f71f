"""How a model family hands its attention over to a scorer.

A family adapter answers four questions about one attention module: is it a self-attention module we
can patch, what geometry do its queries and keys have, where are the hidden states in its forward call,
and how does it rotate queries (RoPE), if it does. Everything else (q, k, v projections, the KV cache,
masks) stays the model's own: the patch only swaps the attention function through transformers'
``AttentionInterface``, and every supported attention forward passes its ``**kwargs`` on to it.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..compat.internals import accelerate_hook
from ..placement.quantized import dense_weight
from ..scorers import AttentionGeometry


class ModelFamily:
    """Base adapter. Subclasses name ``attention_classes`` and implement :meth:`geometry`."""

    name: ClassVar[str]
    attention_classes: ClassVar[tuple[type[nn.Module], ...]]
    # The config field the attention dropout probability comes from, named when its value is not a probability.
    attention_dropout_field: ClassVar[str] = "attention_dropout"

    @classmethod
    def described(cls, name: str, *attention_classes: type[nn.Module]) -> ModelFamily:
        """This adapter as it is, serving the attention modules of ``attention_classes`` under ``name`` (its key in
        ``FAMILIES``, recorded in checkpoints as their ``family``): the registry entry of a model family that needs
        no code of its own, such as Mistral's (``LlamaFamily.described("mistral", MistralAttention)``). Its class is
        made here, named after ``name`` (``"qwen3_moe"`` -> ``Qwen3MoeFamily``)."""
        attributes = {"name": name, "attention_classes": attention_classes, "__module__": cls.__module__}
        return type(f"{name.title().replace('_', '')}Family", (cls,), attributes)()

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is a self-attention module of this family (the ones that get a scorer)."""
        return isinstance(module, self.attention_classes)

    def reads_shared_config(self, module: nn.Module) -> bool:
        """Whether ``module`` picks its attention function from the model's config. Those a patch does not
        score (cross-attention, say) must still be routed to the model's original implementation."""
        return isinstance(module, self.attention_classes)

    def original_attention(
        self, module: nn.Module, implementation: str, query, key, value, attention_mask, scaling, dropout, **kwargs
    ):
        """Run the model's own attention (``"eager"`` or ``"sdpa"``) for a module the patch does not score.

        ``attention_mask`` is the one that implementation expects (see ``hf_neural_attention_mask``). Calls that
        need the probabilities arrive as ``"eager"``, the only path that returns them, with an additive mask.
        """
        if implementation == "eager":
            eager = sys.modules[type(module).__module__].eager_attention_forward
            return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if attention_mask is not None and attention_mask.dtype not in (torch.bool, query.dtype):
            # SDPA wants the mask in the query dtype (autocast); clamp so the large negative stays finite.
            attention_mask = attention_mask.clamp(min=torch.finfo(query.dtype).min).to(query.dtype)
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    def geometry(self, module: nn.Module) -> AttentionGeometry:
        raise NotImplementedError

    def hidden_states(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        """The (batch, seq, hidden) input of the attention module's forward call."""
        return call_argument(module, args, kwargs, "hidden_states")

    def rotary(self, module: nn.Module, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A function applying this call's RoPE at the query positions to a (batch, n, seq, head_dim)
        tensor, or None for models without rotary embeddings."""
        return None


def call_argument(module: nn.Module, args: tuple, kwargs: dict, name: str):
    """The value of parameter ``name`` in a call ``module(*args, **kwargs)``, however it was passed."""
    if name in kwargs:
        return kwargs[name]
    position = forward_parameters(type(module)).index(name)
    return args[position] if position < len(args) else None


@functools.cache
def forward_parameters(module_class: type[nn.Module]) -> tuple[str, ...]:
    """The names of ``module_class.forward``'s parameters after ``self`` (empty if it has no signature).
    Looked up on every forward of every patched layer, so computed once per class."""
    try:
        return tuple(name for name in inspect.signature(module_class.forward).parameters if name != "self")
    except (TypeError, ValueError):
        return ()


def rotation(module: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's RoPE at this call's query positions, for a (batch, n, seq, head_dim) tensor.

    The modeling module's own ``apply_rotary_pos_emb``, so interleaved and scaled variants stay the model's.
    Under partial rotary only the first ``cos.shape[-1]`` dimensions turn, whether the model splits them
    off in its forward (StableLM) or in ``apply_rotary_pos_emb`` (Phi-3).
    """
    apply_rotary_pos_emb = sys.modules[type(module).__module__].apply_rotary_pos_emb
    rotary_dim = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if rotary_dim == x.shape[-1]:  # every dimension turns (no partial rotary): no slicing, no concatenation
            return apply_rotary_pos_emb(x, x[:, :0], cos, sin)[0]
        turned, kept = x[..., :rotary_dim], x[..., rotary_dim:]
        # The function turns a query and a key; the key here is empty, only the query is wanted.
        turned, _ = apply_rotary_pos_emb(turned, turned[:, :0], cos, sin)
        return torch.cat([turned, kept], dim=-1)

    return rotate


def linear_query_geometry(
    query_proj: nn.Linear, num_heads: int, num_kv_heads: int, head_dim: int, *, module: nn.Module | None = None
) -> AttentionGeometry:
    """Geometry of an attention module whose queries come from a separate ``nn.Linear`` (or the bitsandbytes or
    torchao layer that quantized one: its weights are read dequantized, :func:`.quantized.dense_weight`). ``module``,
    the attention module, lends its config to :func:`query_weight_std` when the weights are on meta."""
    weight = dense_weight(query_proj)
    return AttentionGeometry(
        hidden_size=query_proj.in_features,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        query_bias=query_proj.bias is not None,
        query_weight_std=query_weight_std(query_proj if module is None else module, weight),
        dtype=weight.dtype,
        device=weight.device,
    )


# transformers' own fallback when a config names no initializer_range (PreTrainedModel._init_weights).
_DEFAULT_INITIALIZER_RANGE = 0.02


def query_weight_std(module: nn.Module, weight: torch.Tensor) -> float:
    """The standard deviation of the query weights ``weight`` (any shape) of ``module`` (the attention module,
    or the projection holding them), the scale new query-side scorer parameters are drawn at.

    Weights on the meta device have no values. When the model was *built* on meta (``with
    torch.device("meta")``, accelerate's ``init_empty_weights()``, transformers' loading), this returns the
    std transformers' init draws W_Q at, the config's ``initializer_range`` (0.02 when the config names none);
    the scorer's parameters are then created on meta as well and drawn when the model is materialised
    (``Scorer._apply``). The init stays function-preserving either way: the std only sets the scale of the
    mirrored pairs, which cancel at any scale. (Offloaded weights are read for real: ``patch_model`` loads
    them for the time it reads the geometry, see :func:`.offload.offloaded_weights_loaded`.)

    Raises:
        ValueError: the weights are on meta and accelerate's hooks sit on the module, but loading them did not
            give them values (a hook of a kind :func:`.offload.offloaded_weights_loaded` does not know).
    """
    if not weight.is_meta:
        return float(weight.detach().float().std())
    if any(accelerate_hook(part) is not None for part in module.modules()):
        raise ValueError(
            f"Cannot patch {type(module).__name__}: its weights are offloaded by accelerate, and its hooks did not "
            "load them for patching (hf_neural_attn knows accelerate's AlignDevicesHook, which cpu_offload, "
            "disk_offload, dispatch_model and from_pretrained(device_map=..., offload_folder=...) attach). Load "
            "the model without offloading and patch it, or offload it with one of those. The model was not changed."
        )
    # Attention modules of transformers models keep their config; a bare projection has none (default std).
    config = getattr(module, "config", None)
    std = getattr(config, "initializer_range", None)
    if std is None and config is not None and hasattr(config, "get_text_config"):
        std = getattr(config.get_text_config(), "initializer_range", None)
    return float(std or _DEFAULT_INITIALIZER_RANGE)
