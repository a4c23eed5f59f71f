"""hf_neural_attn: nonlinear attention scorers (QANA, Neural Attention) for Hugging Face Transformers.

    model = hf_neural_attn.patch_model(model, "qana", h=4)      # same outputs, new trainable scorer
    model.save_pretrained("out")                                 # safetensors + patch record in config.json
    model = hf_neural_attn.from_pretrained("out")                # rebuilt, patch re-applied
    model = hf_neural_attn.unpatch_model(model)                  # the original model, bit for bit
"""

__version__ = "0.1.0"

from .checkpoint import from_pretrained  # noqa: E402
from .patching import is_patched, patch_model, scorer_parameters, unpatch_model  # noqa: E402
from .scorers import NeuralAttentionConfig, QanaConfig, ScorerConfig  # noqa: E402

__all__ = [
    "NeuralAttentionConfig",
    "QanaConfig",
    "ScorerConfig",
    "__version__",
    "from_pretrained",
    "is_patched",
    "patch_model",
    "scorer_parameters",
    "unpatch_model",
]
