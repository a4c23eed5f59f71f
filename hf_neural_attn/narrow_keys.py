"""Narrow keys: queries and keys narrower than the model's head dimension (QANA's ``key_dim``, a from-scratch option).

A scorer asks for them through its config (:attr:`~hf_neural_attn.scorers.ScorerConfig.narrow_key_dim`, None for
the model's own width); everything the option means to the rest of the library is here:

* building the narrower query and key projections of an attention module without changing it
  (:func:`narrow_key_projections`), and installing them (:func:`use_narrow_keys`): the module then runs
  :class:`NarrowKeyLlamaAttention`, Llama's forward with the query and key width apart from the value width;
* the refusals: a quantized base (:func:`check_base`); undoing the patch, an adapter-only save, PEFT adapters
  (:func:`refuse`); accelerate's offloading of a checkpoint being loaded (:func:`refuse_offloading`), and vLLM
  (:func:`refuse_vllm`): each says why and what to do instead;
* the questions other modules ask: the width a patched model runs at (:func:`width_of`) and the one a record names
  (:func:`recorded_width`).

Only Llama attention (``LlamaAttention`` itself) runs with narrow keys: its forward is rewritten here with the two
widths apart. The module sits beside the model families; the record is read through the scorer config it describes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb, eager_attention_forward

from .compat.internals import attn_implementation_of, mark_initialized
from .families.base import ModelFamily, query_weight_std
from .placement.quantized import activation_dtype
from .scorers import ScorerConfig


def check_base(model: nn.Module, scorer: ScorerConfig) -> None:
    """Refuse narrow keys on a quantized ``model`` (bitsandbytes, torchao): its projections are packed, and the
    narrower ones are trained from scratch, which a quantized base cannot hold.

    Raises:
        ValueError: ``scorer`` asks for narrow keys and ``model`` is quantized.
    """
    width = scorer.narrow_key_dim
    if width is not None and activation_dtype(model) is not None:
        raise ValueError(
            f"hf_neural_attn cannot patch a quantized model with key_dim={width}: key_dim replaces the query and key "
            "projections by narrower ones trained from scratch, which a quantized base cannot hold. Leave key_dim out "
            "(the scorers train beside the quantized projections), or build the model in float to train key_dim from "
            "scratch. The model was not changed."
        )


def narrow_key_projections(family: ModelFamily, module: nn.Module, width: int) -> dict[str, nn.Module]:
    """New query and key projections of ``width`` per head for ``module`` (of ``family``), by attribute name; built
    without changing the module, at the scale of the ones they replace (the model's init scale when it was trained
    from scratch), flagged so that transformers' ``init_weights`` leaves them alone.

    Raises:
        ValueError: ``module`` is not Llama attention, whose forward this module rewrites for narrower keys.
    """
    if type(module) is not LlamaAttention:
        raise ValueError(
            f"key_dim is not supported on {type(module).__name__} ({family.name} family): narrower keys need the "
            "attention forward to shape queries and keys apart from values, which hf_neural_attn provides for Llama "
            "attention (LlamaAttention). Leave key_dim out, or train a Llama-architecture model."
        )
    config = module.config
    projections = {}
    for name, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
        old = getattr(module, name)
        new = nn.Linear(
            old.in_features, heads * width, bias=old.bias is not None, dtype=old.weight.dtype, device=old.weight.device
        )
        if not new.weight.is_meta:
            with torch.no_grad():
                new.weight.normal_(0.0, query_weight_std(module, old.weight))
                if new.bias is not None:
                    new.bias.zero_()
            for parameter in new.parameters():
                mark_initialized(parameter)
        projections[name] = new
    return projections


def use_narrow_keys(module: nn.Module, width: int, projections: dict[str, nn.Module]) -> None:
    """Install what :func:`narrow_key_projections` built: ``module`` then computes ``width``-wide queries and keys
    (its KV cache holds them) and keeps its values' width."""
    for name, projection in projections.items():
        setattr(module, name, projection)
    module.__class__ = NarrowKeyLlamaAttention
    module.key_dim = width


def width_of(model: nn.Module) -> int | None:
    """The query and key width a patched ``model`` runs its narrow-key layers at, or None where it has none (its
    modules tell: the patch gave them :class:`NarrowKeyLlamaAttention`'s forward)."""
    widths = [module.key_dim for module in model.modules() if isinstance(module, NarrowKeyLlamaAttention)]
    return widths[0] if widths else None


def recorded_width(record: Any) -> int | None:
    """The narrow-key width a patch record (:class:`~hf_neural_attn.record.PatchRecord`) names, or None.

    Raises:
        ValueError: the record's options do not describe its scorer (a damaged record, :meth:`scorer_config`).
    """
    return record.scorer_config().narrow_key_dim


# What cannot be done with a narrow-key model, and why: the end of "This model was patched with key_dim=<width>".
_REFUSALS = {
    # unpatch_model
    "unpatch": ", which replaced its query and key projections by narrower ones: there is no original model to go "
    "back to. Reload the original checkpoint instead.",
    # save_adapter
    "save an adapter": ": its query and key projections are new too, so no base model on disk holds the rest of it. "
    "Save the full model with model.save_pretrained.",
    # peft_modules_to_save and the PEFT helpers
    "train PEFT adapters": ", a from-scratch option whose new query and key projections must train in full: train "
    "all its parameters rather than adapters.",
}


def refuse(model: nn.Module, action: str) -> None:
    """Refuse ``action`` (a key of :data:`_REFUSALS`: ``"unpatch"``, ``"save an adapter"``, ``"train PEFT
    adapters"``) on a narrow-key ``model``, whose query and key projections were replaced; any other model passes.

    Raises:
        ValueError: ``model`` runs narrow keys, saying why ``action`` cannot be done and what to do instead.
    """
    width = width_of(model)
    if width is not None:
        raise ValueError(f"This model was patched with key_dim={width}{_REFUSALS[action]}")


def refuse_offloading(width: int | None, device_map, offload_folder) -> None:
    """Loading a narrow-key checkpoint (``width`` None: not one) with accelerate's offloading, whose offloaded copies
    of the base's weights have the base's shapes (the first forward would fail inside accelerate). Refused: a
    ``device_map`` (asked for, or the one transformers chose) with a layer on "disk", or on "cpu" beside layers on an
    accelerator, or an ``offload_folder``.

    Raises:
        ValueError: the load offloads a narrow-key checkpoint.
    """
    if width is None:
        return
    placements = set(device_map.values()) if isinstance(device_map, dict) else set()
    offloads = "disk" in placements or ("cpu" in placements and placements - {"cpu", "disk", torch.device("cpu")})
    if offloads or offload_folder is not None:
        raise ValueError(
            f"This checkpoint was patched with key_dim={width}, whose narrower query and key projections "
            f"accelerate's offloading cannot hold (device_map {device_map!r}"
            f"{f', offload_folder {offload_folder!r}' if offload_folder is not None else ''}). Load it on one device "
            "(device_map='cpu', or a single GPU), or give it the memory to keep every layer on one."
        )


def refuse_vllm(model: str, width: int | None) -> None:
    """Serving a narrow-key checkpoint (``width`` None: not one) in vLLM, whose cache holds keys at the model's head
    size.

    Raises:
        ValueError: ``width`` is not None.
    """
    if width is not None:
        raise ValueError(
            f"hf_neural_attn cannot serve {model} in vLLM: it was patched with QANA's key_dim={width}, whose narrower "
            "keys do not fit vLLM's cache of the model's head size. Serve it with transformers (python -m "
            "hf_neural_attn.serve PATH, or generate), or patch without key_dim."
        )


def narrow_rotary(cos: torch.Tensor, sin: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE tables (..., head_dim) cut to ``width`` dimensions: every (head_dim / width)-th of its
    frequencies (the nearest below where that is not an integer), in Llama's layout ``[f, f]``.

    Where ``width`` divides head_dim this is exactly RoPE at that width with the model's base (and scaling); otherwise
    the frequencies are still the model's, spread over its whole range. Any set of frequencies keeps the dot product
    a function of j - i, which is all the scores need.
    """
    half, narrow = cos.shape[-1] // 2, width // 2
    index = torch.div(torch.arange(narrow, device=cos.device) * half, narrow, rounding_mode="floor")
    cos, sin = cos[..., index], sin[..., index]
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class NarrowKeyLlamaAttention(LlamaAttention):
    """Llama attention whose queries and keys are ``key_dim`` wide and values ``head_dim`` wide.

    The class a Llama attention module patched with narrow keys takes (its q_proj and k_proj are then ``key_dim``
    per head). The forward is Llama's with the two widths apart: keys go to the KV cache at ``key_dim``, RoPE turns
    them with :func:`narrow_rotary`, and the dot product is scaled by ``key_dim ** -0.5``.
    """

    key_dim: int

    def rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's RoPE tables (..., head_dim) as this module's queries and keys are turned (:func:`narrow_rotary`):
        what the family hands the scorer's row-wise RoPE."""
        return narrow_rotary(cos, sin, self.key_dim)

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None, **kwargs
    ):
        # transformers 5.24 renamed the layer's ``past_key_values`` to ``cache``; earlier releases pass the former.
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        query_states = self.q_proj(hidden_states).view(*input_shape, -1, self.key_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.key_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)

        cos, sin = self.rotary_tables(*position_embeddings)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            # A paged cache (continuous batching: its packed calls carry cu_seq_lens_k) holds keys at the model's
            # head_dim, so the narrow keys go in zero-padded and come back cut; other caches take any width.
            paged = kwargs.get("cu_seq_lens_k") is not None
            if paged:
                key_states = F.pad(key_states, (0, self.head_dim - self.key_dim))
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
            if paged:
                key_states = key_states[..., : self.key_dim]

        # A patched model runs attn_implementation "hf_neural_attn": this is its scoring path.
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            attn_implementation_of(self.config), eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.key_dim**-0.5,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights
