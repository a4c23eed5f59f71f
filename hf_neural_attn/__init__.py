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

__version__ = "0.1.0"

from . import (
    _compat,  # noqa: F401  (first: raises ImportError naming the needed transformers if it is too old)
    auto,  # noqa: F401  (registers patched checkpoints with transformers' Auto classes)
)
from .adapters import push_adapter_to_hub, save_adapter
from .checkpoint import from_pretrained
from .patching import is_patched, patch_model, scorer_parameters, unpatch_model
from .peft_utils import peft_modules_to_save
from .scorers import (
    AdditiveConfig,
    GeneralConfig,
    HeaConfig,
    NeuralAttentionConfig,
    NseaConfig,
    QanaConfig,
    ScorerConfig,
)

__all__ = [
    "AdditiveConfig",
    "GeneralConfig",
    "HeaConfig",
    "NeuralAttentionConfig",
    "NseaConfig",
    "QanaConfig",
    "ScorerConfig",
    "__version__",
    "from_pretrained",
    "is_patched",
    "patch_model",
    "peft_modules_to_save",
    "push_adapter_to_hub",
    "save_adapter",
    "scorer_parameters",
    "unpatch_model",
]
