"""A capacity control for comparisons (``--widen_mlp N``): every layer's MLP widened by N hidden units.

A patch adds parameters; a control that is not patched but as large asks whether a gain is the scorer's or only the
extra capacity's. The new units' input weights are drawn like the model's own (normal, the config's
``initializer_range``; biases zero) and their output weights are zero, so the widened model computes exactly what
the pretrained one did at step 0 (as the patches do) and learns from there: the output weights get gradients at
once, the input weights from the second step. The config's width (``n_inner`` / ``intermediate_size``) is updated,
so a checkpoint saves and reloads as an ordinary model of that width.

Two MLP layouts are known: GPT-2's (``mlp.c_fc`` / ``mlp.c_proj``, transformers' ``Conv1D``, weights stored
``(in, out)``) and the gated one of Llama and its relatives (``mlp.gate_proj``, ``mlp.up_proj`` / ``mlp.down_proj``,
``nn.Linear``).
"""

from __future__ import annotations

import torch
from torch import nn

from recipes.errors import RecipeError


def _gpt2_mlps(model) -> list[tuple[list, list]]:
    """(widened on the output side, widened on the input side) per layer, for GPT-2's ``Conv1D`` pair."""
    return [([block.mlp.c_fc], [block.mlp.c_proj]) for block in model.transformer.h]


def _gated_mlps(model) -> list[tuple[list, list]]:
    return [([layer.mlp.gate_proj, layer.mlp.up_proj], [layer.mlp.down_proj]) for layer in model.model.layers]


# model_type -> (the config's width attribute, the layers' MLP modules)
LAYOUTS = {
    "gpt2": ("n_inner", _gpt2_mlps),
    "llama": ("intermediate_size", _gated_mlps),
    "mistral": ("intermediate_size", _gated_mlps),
    "qwen2": ("intermediate_size", _gated_mlps),
}


def mlp_width(config) -> int:
    """The MLP's hidden width of a config (GPT-2's ``n_inner`` defaults to 4 x ``n_embd``)."""
    width_name, _ = LAYOUTS[config.model_type]
    width = getattr(config, width_name)
    return width if width is not None else 4 * config.n_embd


def _grow(weight: torch.Tensor, dim: int, extra: int, std: float | None) -> nn.Parameter:
    """``weight`` with ``extra`` more rows along ``dim``: drawn normal(0, std), or zeros where ``std`` is None."""
    shape = list(weight.shape)
    shape[dim] = extra
    new = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
    if std is not None:
        new.normal_(0.0, std)
    return nn.Parameter(torch.cat([weight.detach(), new], dim=dim), requires_grad=weight.requires_grad)


def _widen_output(module, extra: int, std: float) -> None:
    """More output units: new random input weights, zero biases (Conv1D stores (in, out), Linear (out, in))."""
    conv1d = not isinstance(module, nn.Linear)
    module.weight = _grow(module.weight, 1 if conv1d else 0, extra, std)
    if module.bias is not None:
        module.bias = _grow(module.bias, 0, extra, None)
    if conv1d:
        module.nf += extra
    else:
        module.out_features += extra


def _widen_input(module, extra: int) -> None:
    """More input units, read with zero weights: the output is unchanged."""
    conv1d = not isinstance(module, nn.Linear)
    module.weight = _grow(module.weight, 0 if conv1d else 1, extra, None)
    if not conv1d:
        module.in_features += extra


def check_widening(config, extra: int, *, from_scratch: bool, quantized: bool) -> None:
    """Refuse what --widen_mlp cannot do, before any weight is loaded."""
    if extra < 0:
        raise RecipeError(f"--widen_mlp must be a number of hidden units (0 or more), got {extra}.")
    if not extra:
        return
    if from_scratch:
        raise RecipeError(
            "--widen_mlp widens a pretrained model's MLP; a model built from scratch takes its width from "
            "--config_overrides (n_inner=... for GPT-2, intermediate_size=... for Llama)."
        )
    if quantized:
        raise RecipeError("--widen_mlp cannot widen quantized weights: drop --load_in_4bit / --load_in_8bit.")
    if config.model_type not in LAYOUTS:
        raise RecipeError(
            f"--widen_mlp knows the MLPs of {sorted(LAYOUTS)}, not {config.model_type!r}: widen it in the config "
            "and load with --ignore_mismatched_sizes, or compare without this control."
        )


def widen_mlp(model, extra: int) -> int:
    """Widen every layer's MLP of ``model`` by ``extra`` hidden units, function-preserving; update its config.
    Returns the number of parameters added."""
    config = model.config
    width_name, layers = LAYOUTS[config.model_type]
    weights = [module.weight for outputs, inputs in layers(model) for module in (*outputs, *inputs)]
    if any(hasattr(weight, "ds_id") or type(weight.data) is not torch.Tensor for weight in weights):
        # A ZeRO-3 placeholder (empty, the whole tensor elsewhere), a DTensor shard or a quantized tensor: a row
        # appended to it would not be a row of the whole weight.
        raise RecipeError(
            "--widen_mlp widens whole float weights; this model's MLP weights are partitioned (DeepSpeed ZeRO-3), "
            "sharded or quantized. Run the control without that placement (under DDP, say)."
        )
    before = sum(p.numel() for p in model.parameters())
    std = getattr(config, "initializer_range", 0.02)
    width = mlp_width(config)
    with torch.no_grad():
        for outputs, inputs in layers(model):
            for module in outputs:
                _widen_output(module, extra, std)
            for module in inputs:
                _widen_input(module, extra)
    setattr(config, width_name, width + extra)
    return sum(p.numel() for p in model.parameters()) - before
