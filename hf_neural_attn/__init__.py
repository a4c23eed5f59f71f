"""hf_neural_attn: nonlinear attention scorers (QANA, Neural Attention, additive, general, NSEA, HEA) for
Hugging Face Transformers.

model = hf_neural_attn.patch_model(model, "qana", h=4)      # same outputs, new trainable scorer
model.save_pretrained("out")                                 # safetensors + patch record in config.json
model = hf_neural_attn.from_pretrained("out")                # rebuilt, patch re-applied
model = hf_neural_attn.unpatch_model(model)                  # the original model, bit for bit

hf_neural_attn.save_adapter(model, "adapter")                # scorer tensors + patch record + base model id
model = hf_neural_attn.from_pretrained("adapter")            # base model loaded, patched, tensors filled in
LoraConfig(..., modules_to_save=hf_neural_attn.peft_modules_to_save(model))   # scorers trained beside LoRA
"""

from . import _compat
from ._version import __version__

# Before anything touches transformers: below the floor the failures are hard to read, so say which release is needed.
_compat.check_transformers_version()

from . import attention, patched_config
from .loading import auto
from .loading.adapters import push_adapter_to_hub, save_adapter
from .loading.checkpoints import from_pretrained
from .patching import patch_model, unpatch_model
from .peft_utils import peft_modules_to_save
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

# The import side effects, all of them here:
# 1. the attention function and mask builder a patched model runs, as attn_implementation="hf_neural_attn";
attention.register()
# 2. model_type "hf_neural_attn" with AutoConfig, and each patched config class with the AutoModel* classes that
#    build its base class, as the class is made (so `import hf_neural_attn` is all an Auto class needs).
auto.register()
patched_config.on_patched_class(auto.register_patched_config)

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
    "is_patched",
    "patch_model",
    "patch_record",
    "peft_modules_to_save",
    "push_adapter_to_hub",
    "save_adapter",
    "scorer_parameters",
    "unpatch_model",
]
