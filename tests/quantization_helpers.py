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
from helpers.checkpoints import save_base
from torch import nn

INSTALL = "pip install 'hf-neural-attn[quantization]'"


@dataclass(frozen=True)
class Scheme:
    name: str
    library: str  # the package that quantizes: "bitsandbytes" or "torchao"
    make_config: Callable[[], object]  # the quantization_config for from_pretrained

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
    # Quantizes the activations too, per call (test_quantization.py compares its outputs within the base's spread).
    Scheme("torchao-int8-dynamic", "torchao", _torchao("Int8DynamicActivationInt8WeightConfig")),
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


# On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit layer's weight for its CPU kernel the first time the layer
# runs in eval mode without gradients, and that layout needs the layer's inputs a multiple of the block size (64)
# and its outputs a multiple of 32: the tiny models' 32-wide projections crash there, patched or not, as no real
# model's do. The quantized tests' models are these sizes (every projection 64, 128 or 256 wide), so they run the
# repacked weights on such a CPU and the plain ones elsewhere.
def quantizable_sizes(family: str) -> dict[str, int]:
    """Config overrides that make the tiny ``family`` model (a FAMILY_CASES name) one bitsandbytes can run on any
    CPU: 64 wide, 4 heads of 16."""
    return {"n_embd": 64} if family == "gpt2" else {"hidden_size": 64, "intermediate_size": 128}


def save_quantizable_base(folder: Path, family: str) -> Path:
    """helpers.checkpoints.save_base with :func:`quantizable_sizes`: the float model a quantized test loads."""
    return save_base(folder, family, **quantizable_sizes(family))


# bitsandbytes' Linear4bit (0.50 on) sets this where the CPU has AVX512-BF16: the layer then repacks its weight for its
# CPU kernel at its first eval-mode forward without gradients, and that kernel passes no gradient.
CPU_KERNEL_SWITCH = "support_avx512bf16_for_cpu"
KERNEL_WARNING = "turned off bitsandbytes' CPU kernel"


def cpu_kernel_layers(model: nn.Module) -> list[nn.Module]:
    """The 4-bit layers of ``model`` that would repack for bitsandbytes' CPU kernel: all of them on a CPU with
    AVX512-BF16 (unless turned off), none elsewhere."""
    return [module for module in model.modules() if getattr(module, CPU_KERNEL_SWITCH, False)]


def repacked_layers(model: nn.Module) -> list[str]:
    """The names of the 4-bit layers of ``model`` that bitsandbytes repacked for its CPU kernel."""
    return [
        name
        for name, module in model.named_modules()
        if getattr(getattr(getattr(module, "weight", None), "quant_state", None), "packing_format_for_cpu", False)
    ]


def gradients_after_an_evaluation(model: nn.Module, inputs: dict, trained: dict[str, torch.Tensor]) -> dict:
    """name -> gradient (None where none came) of the ``trained`` parameters of ``model`` at a training step taken after
    one eval-mode forward without gradients, what an evaluation runs (``inputs`` a causal LM's, their ids the labels).
    Every other parameter is frozen, as QLoRA freezes the base."""
    with torch.no_grad():
        model.eval()(**inputs)
    model.train()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for parameter in trained.values():
        parameter.requires_grad_(True)
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    return {name: parameter.grad for name, parameter in trained.items()}
