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
and what the library sets up in it waits until something else imports it (see the side effects below).
"""

from __future__ import annotations

import importlib

from . import _compat, _import_hooks
from ._version import __version__

# Before anything touches transformers: below the floor the failures are hard to read, so say which release is needed.
_compat.check_transformers_version()

from . import patched_config
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
    "full_shape": "families.zero3",
    "save_adapter": "loading.adapters",
    "push_adapter_to_hub": "loading.adapters",
    "peft_modules_to_save": "peft_utils",
}
_SUBMODULES = ("attention", "auto", "families", "loading", "ops", "patching", "peft_utils", "plotting", "scorers")


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


def _on_patched_class(patched_class, base_class) -> None:
    """A patched config class was made (by patch_model, or by AutoConfig reading a patched checkpoint): register the
    attention function its models run, and map it to the Auto model classes, tokenizers and processors of its base."""
    from . import attention
    from .loading import auto

    attention.register()
    auto.register_patched_config(patched_class, base_class)


def _on_modeling_utils(modeling_utils) -> None:
    """transformers' modeling stack is imported: a model class's own from_pretrained loads patched checkpoints
    patched, its save_pretrained refuses a patched model PEFT still wraps, and its push_to_hub writes the library's
    card for a patched checkpoint where transformers would write its generic one. (This may run in the middle of
    another import of the library's, which imported transformers: plain_classes and model_cards import nothing of the
    library's at their top but the record's names and the loading files' keywords.)"""
    from transformers.utils import hub

    from . import model_cards
    from .loading import plain_classes

    plain_classes.install()
    # push_to_hub calls transformers.utils.hub's function, save_pretrained(push_to_hub=True) the name modeling_utils
    # imported from it: both are wrapped.
    model_cards.install_push_card(hub)
    model_cards.install_push_card(modeling_utils)


def _on_ulysses(ulysses) -> None:
    """DeepSpeed's Ulysses sequence parallelism is imported: its registration refuses a patched model by name."""
    from .families import parallelism
    from .record import ATTN_IMPLEMENTATION

    parallelism.refuse_ulysses(ulysses, attn_implementation=ATTN_IMPLEMENTATION)


def _on_continuous_batching(continuous_api) -> None:
    """transformers' continuous batching is imported: its manager serves patched models with their scorers."""
    from . import continuous_batching

    continuous_batching.install(continuous_api)


# The import side effects, all of them here:
# 1. model_type "hf_neural_attn" with AutoConfig, so that `import hf_neural_attn` is all an Auto class needs;
patched_config.register_checkpoint_config()
# 2. each patched config class, as it is made: the attention function, the Auto model classes, preprocessors;
patched_config.on_patched_class(_on_patched_class)
# 3. once transformers' modeling stack is imported (now, or whenever something imports it): transformers' own
#    from_pretrained and save_pretrained know patched checkpoints and models (hf_neural_attn.loading.plain_classes),
#    and push_to_hub's card of a patched checkpoint is the library's (hf_neural_attn.model_cards).
_import_hooks.after_import("transformers.modeling_utils", _on_modeling_utils)
# 4. once transformers' continuous batching is imported: its manager keeps a patched model's scorers
#    (hf_neural_attn.continuous_batching).
_import_hooks.after_import("transformers.generation.continuous_batching.continuous_api", _on_continuous_batching)
# 5. once DeepSpeed's Ulysses sequence parallelism is imported: its registration refuses a patched model by name
#    (hf_neural_attn.families.parallelism, which also holds what the library adds for tensor and context parallelism).
_import_hooks.after_import("deepspeed.runtime.sequence_parallel.ulysses_sp", _on_ulysses)

__all__ = [
    "AdditiveConfig",
    "GeneralConfig",
    "HeaConfig",
    "NeuralAttentionConfig",
    "NseaConfig",
    "PatchRecord",
    "QanaConfig",
    "ScorerConfig",
    "__version__",
    "from_pretrained",
    "full_shape",
    "is_patched",
    "patch_model",
    "patch_record",
    "peft_modules_to_save",
    "push_adapter_to_hub",
    "save_adapter",
    "scorer_parameters",
    "set_impl",
    "unpatch_model",
]
