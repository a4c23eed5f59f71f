"""Quantized base models: what the patch reads of a weight that bitsandbytes or torchao quantized.

A patch reads a base model's query projection for three facts: its width (``in_features``), the standard deviation
of its weights (the scale new query rows are drawn at, :func:`.base.query_weight_std`) and the dtype its activations
run in (the scorers are built in it). A quantized projection keeps its weights in a storage none of those can be read
from directly:

===================================  ==============================================  =================================
quantized by                         the weight                                      read here
===================================  ==============================================  =================================
bitsandbytes 4-bit (NF4, FP4)         ``Params4bit``: packed ``uint8`` of shape           ``dequantize_4bit`` with its
                                     ``(numel / 2, 1)``, a ``quant_state`` beside it     ``quant_state`` (double
                                                                                     quantization included)
bitsandbytes 8-bit (LLM.int8)         ``Int8Params``: ``int8`` rows, a scale per row      ``int8_vectorwise_dequant``
                                     (``SCB``)
torchao (int8/int4 weight-only,       a tensor subclass that reports the float dtype      its own ``dequantize()``
int8 dynamic, ...)                    and refuses most ops (``std`` among them)
===================================  ==============================================  =================================

A 4-bit weight bitsandbytes repacked for its CPU kernel (on a CPU with AVX512-BF16, after the layer's first
eval-mode forward) is read from that layout (:func:`dequantize_cpu_packed_4bit`). That kernel passes no gradient, so
the patch turns it off on the 4-bit layers it has not yet repacked (:func:`keep_4bit_trainable`), saying so once, and
``unpatch_model`` turns it on again (:func:`turn_off_cpu_kernel_for_patch`, :func:`restore_cpu_kernel`).

Everything here reads a dequantized *copy*: the base's quantized weights are never changed (they stay quantized and
bit-identical through patching and training; the scorers are new float modules beside them). A weight of another
integer storage, from a quantizer the library does not know (GPTQ, AWQ, HQQ, ...), is refused by name
(:func:`check_readable`) before the model changes.

The dtype: a quantized model's activations run in the dtype of its float parameters (embeddings, norms; what
``model.dtype`` reports, and what ``prepare_model_for_kbit_training`` casts to float32), and bitsandbytes' layers
return their output in the dtype of their input, whatever ``bnb_4bit_compute_dtype`` their matmul runs in. So that is
the dtype the scorers are built in (:func:`activation_dtype`), never the packed storage's.
"""

from __future__ import annotations

import torch
from torch import nn

from .._warnings import warn_user
from .base import Placement

# The library that quantized a weight, by the top-level package of its tensor class.
BITSANDBYTES = "bitsandbytes"
TORCHAO = "torchao"
KNOWN_QUANTIZERS = (BITSANDBYTES, TORCHAO)

# bitsandbytes' Linear4bit (0.50 on) sets this attribute at construction where the CPU has AVX512-BF16, and then repacks
# its weight for its CPU kernel at the layer's first forward on the CPU in eval mode without gradients.
CPU_KERNEL_SWITCH = "support_avx512bf16_for_cpu"
# Set on a 4-bit layer whose CPU kernel a patch turned off, so that unpatch_model turns it on again.
KERNEL_TURNED_OFF_ATTR = "_hf_neural_attn_cpu_kernel_off"


class UnreadableQuantizationError(ValueError):
    """A base model's weights are quantized in a storage the patch cannot read."""


def quantizer_of(weight: torch.Tensor) -> str | None:
    """``"bitsandbytes"`` or ``"torchao"`` for a weight one of them quantized, None for a plain tensor (of any dtype:
    :func:`check_readable` says whether a plain integer tensor can be read)."""
    package = type(weight).__module__.split(".", 1)[0]
    return package if package in KNOWN_QUANTIZERS else None


def is_quantized(weight: torch.Tensor) -> bool:
    """Whether ``weight`` holds quantized storage (of a known quantizer, or an integer tensor of an unknown one)."""
    return quantizer_of(weight) is not None or not (weight.is_floating_point() or weight.is_meta)


def check_readable(layer: nn.Module, weight: torch.Tensor, what: str) -> None:
    """Raise :class:`UnreadableQuantizationError` when ``weight`` (of ``layer``, described as ``what``) is quantized in a
    storage this module cannot dequantize. Called before a patch changes anything."""
    if quantizer_of(weight) is not None or weight.is_floating_point() or weight.is_meta:
        return
    raise UnreadableQuantizationError(
        f"hf_neural_attn cannot read {what}: {type(layer).__name__}.weight is a {type(weight).__name__} of "
        f"{weight.dtype} storage from a quantizer it does not know. It patches models quantized by bitsandbytes "
        "(load_in_4bit, NF4 or FP4, double quantization; load_in_8bit) and torchao (TorchAoConfig), and float models: "
        "load the base with one of those (docs/qlora.md). The model was not changed."
    )


def logical_shape(weight: torch.Tensor) -> torch.Size:
    """The shape of the weight ``weight`` stands for: a bitsandbytes 4-bit weight's own ``shape`` is its packed storage's,
    ``(numel / 2, 1)``, and its ``quant_state`` keeps the weight's; any other tensor's own shape."""
    quant_state = getattr(weight, "quant_state", None) if quantizer_of(weight) == BITSANDBYTES else None
    return torch.Size(quant_state.shape) if quant_state is not None else weight.shape


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """The weight of the linear ``layer`` as a float tensor of its logical shape (``(out_features, in_features)`` for
    ``nn.Linear`` and the bitsandbytes and torchao layers that replace it): the weight itself when it is not quantized
    (on meta too), a dequantized copy otherwise, detached.

    Raises:
        UnreadableQuantizationError: the weight is quantized by a library this module does not know.
    """
    weight = layer.weight
    quantizer = quantizer_of(weight)
    if quantizer is None:
        check_readable(layer, weight, "its query weights")
        return weight
    with torch.no_grad():
        if quantizer == TORCHAO:
            return weight.dequantize()
        import bitsandbytes.functional as bnb_functional  # only reached with a weight bitsandbytes made

        quant_state = getattr(weight, "quant_state", None)
        if is_repacked_for_cpu(layer):
            return dequantize_cpu_packed_4bit(weight.data, quant_state)
        if quant_state is not None:  # Params4bit (NF4 or FP4; a nested state under double quantization)
            return bnb_functional.dequantize_4bit(weight.data, quant_state)
        scales = getattr(weight, "SCB", None)
        if scales is None:
            # Older releases keep the row scales on the layer's state.
            scales = getattr(getattr(layer, "state", None), "SCB", None)
        if weight.dtype == torch.int8 and scales is not None:  # Int8Params after quantization
            return bnb_functional.int8_vectorwise_dequant(weight.data, scales)
        if weight.is_floating_point():  # not quantized yet (moved to a device quantizes it)
            return weight.detach()
    raise UnreadableQuantizationError(
        f"hf_neural_attn cannot read the weights of {type(layer).__name__}: a bitsandbytes {type(weight).__name__} "
        f"with {weight.dtype} storage and neither a 4-bit quant_state nor 8-bit row scales. The model was not changed."
    )


def dequantize_cpu_packed_4bit(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """A bitsandbytes 4-bit weight that bitsandbytes repacked for its CPU kernel, dequantized to ``quant_state.shape``.

    On a CPU with AVX512-BF16, bitsandbytes (0.50 on) rewrites a ``Linear4bit``'s weight the first time the layer runs
    in eval mode without gradients (``quant_state.packing_format_for_cpu``): the 4-bit codes of each 32 output rows
    interleaved as ``(out / 32, in / 2, 32, 2)`` bytes of shape ``(out, in / 2)``, and the block scales (double
    quantization undone) as a bfloat16 ``(in / blocksize, out)`` matrix. ``dequantize_4bit`` reads only the layout
    before that, and bitsandbytes' own inverse leaves the scales of a weight without double quantization transposed,
    so the codes are read here from the packed layout itself. Reads ``packed``, changes nothing.

    Args:
        packed: ``(out, in / 2)`` ``uint8`` (or a float storage type viewed as bytes).
        quant_state: its ``QuantState``: ``shape`` ``(out, in)``, ``absmax`` ``(in / blocksize, out)``, ``code`` (the
            16 values of NF4 or FP4), ``blocksize``, ``original_dtype`` (the weight's dtype).
    """
    out_features, in_features = quant_state.shape
    # Each 32 bytes hold the 64 codes of 32 output rows at two neighbouring inputs, in (row, input) order: the low
    # nibbles those of the first 16 rows, the high nibbles those of the last 16.
    packed_rows = packed.view(torch.uint8).reshape(-1, 32)
    codes = torch.cat([packed_rows & 0xF, packed_rows >> 4], dim=-1)  # (out / 32 * in / 2, 64)
    codes = codes.reshape(out_features // 32, in_features // 2, 32, 2).transpose(1, 2)
    codes = codes.reshape(out_features, in_features)
    scales = quant_state.absmax.float().T.repeat_interleave(quant_state.blocksize, dim=1)  # (out, in)
    values = quant_state.code.to(packed.device)[codes.long()]
    # The packing set the state's dtype to bfloat16 (its kernel's) and kept the weight's in original_dtype.
    return (values * scales).to(getattr(quant_state, "original_dtype", quant_state.dtype))


def is_repacked_for_cpu(layer: nn.Module) -> bool:
    """Whether bitsandbytes repacked the 4-bit weight of ``layer`` for its CPU kernel
    (:func:`dequantize_cpu_packed_4bit` reads that layout)."""
    quant_state = getattr(getattr(layer, "weight", None), "quant_state", None)
    return bool(getattr(quant_state, "packing_format_for_cpu", False))


def keep_4bit_trainable(model: nn.Module) -> nn.Module:
    """Turn bitsandbytes' CPU kernel for 4-bit layers off on every layer of ``model`` (a PEFT model too), so that it
    keeps training after an evaluation, and return ``model``.

    On a CPU with AVX512-BF16, bitsandbytes (0.50 on) repacks a 4-bit layer's weight for its CPU kernel the first time
    the layer runs in eval mode without gradients, and runs that kernel from then on, in training mode too. The kernel
    passes no gradient, so from the first evaluation on nothing that needs one through a 4-bit layer trains (LoRA on
    the layers before it; the scorers, whose gradients come back through ``o_proj``), and nothing says so. A model it
    repacked also saves wrong weights (docs/qlora.md). With the kernel off, the layers keep the layout they loaded in
    and compute as bitsandbytes does on a GPU or in training mode: the input is not rounded to bfloat16, and CPU
    inference is slower. ``patch_model`` and the loaders of patched models do this themselves (and say so); call it
    on an unpatched 4-bit model you train, before its first evaluation. Other layers (8-bit, torchao, float) and
    bitsandbytes releases without the kernel are left alone; elsewhere (a GPU, another CPU) it changes nothing that
    runs.

    Raises:
        ValueError: a 4-bit layer was repacked already (the model ran in eval mode without gradients on such a CPU):
            the message names it and says to load the base again. The model is not changed then.
    """
    repacked = [name for name, module in model.named_modules() if is_repacked_for_cpu(module)]
    if repacked:
        raise ValueError(
            f"keep_4bit_trainable: bitsandbytes already repacked {len(repacked)} 4-bit layers of this model for its "
            f"CPU kernel ({repacked[0]}, ...), at their first eval-mode forward without gradients; no gradient passes "
            "them, and the repacking cannot be undone exactly. Load the base again and call keep_4bit_trainable(model) "
            "before its first evaluation. The model was not changed."
        )
    for module in model.modules():
        if getattr(module, CPU_KERNEL_SWITCH, False):
            setattr(module, CPU_KERNEL_SWITCH, False)
    return model


def turn_off_cpu_kernel_for_patch(model: nn.Module) -> None:
    """What a patch does with bitsandbytes' CPU kernel (:func:`keep_4bit_trainable`): turn it off on every 4-bit layer
    of ``model`` that has it on, mark those for :func:`restore_cpu_kernel`, and say so in one warning where they run on
    the CPU. Layers the kernel repacked already stay as they are (a patch changes no quantized weight; they keep
    computing what the base computed), and the warning says that they pass no gradient."""
    layers = [module for module in model.modules() if getattr(module, CPU_KERNEL_SWITCH, False)]
    for layer in layers:
        setattr(layer, CPU_KERNEL_SWITCH, False)
        setattr(layer, KERNEL_TURNED_OFF_ATTR, True)
    if not any(layer.weight.device.type in ("cpu", "meta") for layer in layers):
        return  # on a GPU the kernel never runs: nothing changed that the user would see
    message = (
        f"hf_neural_attn turned off bitsandbytes' CPU kernel on the {len(layers)} 4-bit layers of this model "
        f"({CPU_KERNEL_SWITCH}=False, what hf_neural_attn.keep_4bit_trainable does): it repacks a layer's weight at "
        "its first eval-mode forward without gradients into a layout no gradient passes, so LoRA and the scorers "
        "would stop training after the first evaluation. The layers compute as in training mode (no bfloat16 "
        "rounding of their input; slower inference on this CPU); unpatch_model turns the kernel on again "
        "(docs/qlora.md)."
    )
    repacked = sum(is_repacked_for_cpu(layer) for layer in layers)
    if repacked:
        message += (
            f" {repacked} of them had been repacked already (the model ran in eval mode before the patch) and stay so: "
            "no gradient passes them. To train this model, load the base again and patch it before its first "
            "evaluation."
        )
    warn_user(message)


def activation_quantized_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s layers whose torchao weight also quantizes the layer's input at every call (int8
    dynamic activation quantization: the weight's ``act_quant_kwargs``, or an older torchao's ``input_quant_func``).
    That rounding passes no gradient back to the input, so nothing before such a layer trains through it."""
    return [
        name
        for name, module in model.named_modules()
        if quantizer_of(weight := getattr(module, "weight", None)) == TORCHAO
        and (getattr(weight, "act_quant_kwargs", None) is not None or getattr(weight, "input_quant_func", None))
    ]


def warn_if_activations_quantized(model: nn.Module) -> None:
    """After a patch: say, once, when torchao quantizes the activations of some of ``model``'s layers, through which
    the scorers' gradients would have to come back (:func:`activation_quantized_layers`). Not refused: such a model
    serves and evaluates patched as well as its base."""
    layers = activation_quantized_layers(model)
    if layers:
        warn_user(
            f"hf_neural_attn: torchao quantizes the activations of {len(layers)} layers of this model ({layers[0]}, "
            "...: int8 dynamic quantization), and that quantization passes no gradient to their input, so the scorers "
            "(whose gradients come back through the output projection) and anything before those layers will not "
            "train. The patched model evaluates and serves as its base; to train it, quantize the base weight-only "
            "(torchao's Int8WeightOnlyConfig, or bitsandbytes' load_in_4bit) (docs/qlora.md)."
        )


def restore_cpu_kernel(model: nn.Module) -> None:
    """Turn bitsandbytes' CPU kernel on again on the 4-bit layers of ``model`` where a patch turned it off
    (:func:`turn_off_cpu_kernel_for_patch`): the unpatched model runs as the base did."""
    for module in model.modules():
        if getattr(module, KERNEL_TURNED_OFF_ATTR, False):
            setattr(module, CPU_KERNEL_SWITCH, True)
            delattr(module, KERNEL_TURNED_OFF_ATTR)


def activation_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a quantized ``model``'s activations run in: that of its first float parameter that is not quantized
    (its embeddings, usually; transformers' ``model.dtype``). None when the model is not quantized: its projections'
    own dtype is then the one (see the module docstring)."""
    parameters = list(model.parameters())
    if not any(is_quantized(parameter) for parameter in parameters):
        return None
    floats = (
        parameter.dtype for parameter in parameters if parameter.is_floating_point() and not is_quantized(parameter)
    )
    return next(floats, torch.get_default_dtype())


class QuantizedWeights(Placement):
    """bitsandbytes' and torchao's quantized bases: scorers built in the activations' dtype; bitsandbytes' CPU kernel
    turned off while patched (and on again after), torchao's activation quantization said once."""

    name = "quantized"

    def scorer_dtype(self, model):
        return activation_dtype(model)

    def apply_model(self, model):
        # A patched model is one to train: bitsandbytes' CPU kernel for 4-bit layers would stop its gradients at the
        # first evaluation, and torchao's activation quantization stops them at every call.
        turn_off_cpu_kernel_for_patch(model)
        warn_if_activations_quantized(model)

    def remove_model(self, model):
        restore_cpu_kernel(model)  # the base's own bitsandbytes CPU kernel, which the patch turned off


PLACEMENT = QuantizedWeights()
