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
eval-mode forward) is read from that layout (:func:`dequantize_cpu_packed_4bit`).

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

# The library that quantized a weight, by the top-level package of its tensor class.
BITSANDBYTES = "bitsandbytes"
TORCHAO = "torchao"
KNOWN_QUANTIZERS = (BITSANDBYTES, TORCHAO)


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
        if getattr(quant_state, "packing_format_for_cpu", False):
            return dequantize_cpu_packed_4bit(weight.data, quant_state)
        if quant_state is not None:  # Params4bit (NF4 or FP4; a nested state under double quantization)
            return bnb_functional.dequantize_4bit(weight.data, quant_state)
        scales = getattr(weight, "SCB", None)
        if scales is None:
            scales = getattr(getattr(layer, "state", None), "SCB", None)  # older releases keep the row scales on the layer's state
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


def activation_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a quantized ``model``'s activations run in: that of its first float parameter that is not quantized
    (its embeddings, usually; transformers' ``model.dtype``). None when the model is not quantized: its projections'
    own dtype is then the one (see the module docstring)."""
    parameters = list(model.parameters())
    if not any(is_quantized(parameter) for parameter in parameters):
        return None
    floats = (parameter.dtype for parameter in parameters if parameter.is_floating_point() and not is_quantized(parameter))
    return next(floats, torch.get_default_dtype())
