"""The quantization schemes the tests load tiny models with: bitsandbytes (4-bit NF4 and FP4, double quantization,
8-bit) and torchao (int8 and int4 weight-only, int8 dynamic), each as the ``quantization_config`` a user passes to
``from_pretrained``. Both libraries run on the CPU; a test whose library is missing skips with the install command."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

INSTALL = "pip install 'hf-neural-attn[quantization]'"


@dataclass(frozen=True)
class Scheme:
    name: str
    library: str  # the package that quantizes: "bitsandbytes" or "torchao"
    make_config: Callable[[], object]  # the quantization_config for from_pretrained
    # torchao's int8 dynamic quantizes the activations too, per call: a float rounding difference anywhere before a
    # quantized projection (even the unpatched model's eager against its SDPA attention) can move an activation across
    # a quantization step. Its outputs are compared within the unpatched model's own spread.
    quantizes_activations: bool = False

    def config(self):
        pytest.importorskip(self.library, reason=f"{self.library} is not installed: {INSTALL}")
        return self.make_config()


def _bitsandbytes(**options):
    def make():
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(**options)

    return make


def _torchao(config_name: str, **options):
    def make():
        import torchao.quantization
        from transformers import TorchAoConfig

        return TorchAoConfig(getattr(torchao.quantization, config_name)(**options))

    return make


SCHEMES = [
    # BitsAndBytesConfig's own default 4-bit type is FP4: NF4 is named.
    Scheme(
        "bnb-nf4",
        "bitsandbytes",
        _bitsandbytes(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    ),
    Scheme(
        "bnb-fp4-double",
        "bitsandbytes",
        _bitsandbytes(
            load_in_4bit=True,
            bnb_4bit_quant_type="fp4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        ),
    ),
    Scheme("bnb-int8", "bitsandbytes", _bitsandbytes(load_in_8bit=True)),
    Scheme("torchao-int8-weight-only", "torchao", _torchao("Int8WeightOnlyConfig")),
    # torchao's Int4WeightOnlyConfig packs for CUDA kernels only; on the CPU int4 weight-only is its Intx config.
    Scheme("torchao-int4-weight-only", "torchao", _torchao("IntxWeightOnlyConfig", weight_dtype=torch.int4)),
    Scheme(
        "torchao-int8-dynamic",
        "torchao",
        _torchao("Int8DynamicActivationInt8WeightConfig"),
        quantizes_activations=True,
    ),
]
SCHEME = {scheme.name: scheme for scheme in SCHEMES}
SCHEME_NAMES = [scheme.name for scheme in SCHEMES]
BITSANDBYTES_SCHEMES = [scheme.name for scheme in SCHEMES if scheme.library == "bitsandbytes"]
HAS_PEFT = importlib.util.find_spec("peft") is not None


def load_quantized(model_class, folder: Path, scheme: str, **kwargs) -> nn.Module:
    """The float model saved in ``folder`` loaded as ``model_class`` with ``scheme``'s quantization, in eval mode."""
    config = SCHEME[scheme].config()
    return model_class.from_pretrained(folder, quantization_config=config, **kwargs).eval()


def quantized_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every quantized weight of ``model`` (bitsandbytes' packed storage; torchao's tensors dequantized):
    what must stay bit-identical while the scorers train beside them."""
    from hf_neural_attn.placement.quantized import TORCHAO, is_quantized, quantizer_of

    return {
        name: (parameter.dequantize() if quantizer_of(parameter) == TORCHAO else parameter).detach().clone()
        for name, parameter in model.named_parameters()
        if is_quantized(parameter)
    }
