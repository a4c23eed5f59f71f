"""hf_neural_attn: nonlinear attention scorers (QANA, Neural Attention, additive, general, NSEA, HEA) for
Hugging Face Transformers.

model = hf_neural_attn.patch_model(model, "qana", h=4)      # same outputs, new trainable scorer
model.save_pretrained("out")                                 # safetensors + patch record in config.json
model = hf_neural_attn.from_pretrained("out")                # rebuilt, patch re-applied
hf_neural_attn.set_impl(model, "chunked")                    # how a patched model computes (run time, not saved)
model = hf_neural_attn.unpatch_model(model)                  # the original model, bit for bit

hf_neural_attn.save_adapter(model, "adapter")                # scorer tensors + patch record + base model id
model = hf_neural_attn.from_pretrained("adapter")            # base model loaded, patched, tensors filled in
LoraConfig(..., modules_to_save=hf_neural_attn.peft_modules_to_save(model))   # scorers trained beside LoRA

Importing the library is cheap: what needs transformers' modeling stack (seconds to import) is imported on first use,
and what the library sets up in it waits until something else imports it (hf_neural_attn.integrations.installer).
"""

from __future__ import annotations

import importlib

from ._version import __version__
from .compat import versions as _versions

# Before anything touches transformers: below the floor the failures are hard to read, so say which release is needed.
_versions.check_transformers_version()

from .integrations import installer as _integrations
from .model_cards import LIBRARY_NAME, checkpoint_tags
from .record import PatchRecord, is_patched, patch_record, scorer_parameters
from .scorers import (
    AdditiveConfig,
    GeneralConfig,
    HeaConfig,
    NeuralAttentionConfig,
    NseaConfig,
    QanaConfig,
    ScorerConfig,
)

# The public functions whose modules import transformers' modeling stack: loaded on first access.
_LAZY_NAMES = {
    "patch_model": "patching",
    "unpatch_model": "patching",
    "set_impl": "patching",
    "from_pretrained": "loading.dispatch",
    "full_shape": "placement.zero3",
    "keep_4bit_trainable": "placement.quantized",
    "save_adapter": "loading.adapters",
    "push_adapter_to_hub": "loading.adapters",
    "peft_modules_to_save": "peft_utils",
}
_SUBMODULES = (
    "attention",
    "auto",
    "families",
    "integrations",
    "loading",
    "ops",
    "patching",
    "peft_utils",
    "plotting",
    "scorers",
)


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES, *_SUBMODULES})


# Every change the library makes to other libraries is a row of one table, hf_neural_attn.integrations.installer
# (INTEGRATIONS): what it changes and when. Installing them is the one import side effect; HF_NEURAL_ATTN_NO_INTEGRATIONS=1
# keeps only the attention function patched models call by name (see docs/api.md, "What the library changes in
# other libraries").
_integrations.install_on_import()

__all__ = [
    "LIBRARY_NAME",
    "AdditiveConfig",
    "GeneralConfig",
    "HeaConfig",
    "NeuralAttentionConfig",
    "NseaConfig",
    "PatchRecord",
    "QanaConfig",
    "ScorerConfig",
    "__version__",
    "checkpoint_tags",
    "from_pretrained",
    "full_shape",
    "is_patched",
    "keep_4bit_trainable",
    "patch_model",
    "patch_record",
    "peft_modules_to_save",
    "push_adapter_to_hub",
    "save_adapter",
    "scorer_parameters",
    "set_impl",
    "unpatch_model",
]
