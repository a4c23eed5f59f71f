"""Which model class vLLM builds for a patched checkpoint.

vLLM resolves a checkpoint's ``architectures`` (``LlamaForCausalLM``) to its own implementation of that
architecture, which has no place for the scorers' weights, or, with ``model_impl="transformers"``, to its
Transformers modeling backend (``TransformersForCausalLM``), which builds the transformers model but only serves
modules that call vLLM's attention. A patched config (the library's config class, which config.json reads as once the
library is imported) resolves instead to :class:`~.model.PatchedTransformersForCausalLM`, registered as
:data:`ARCHITECTURE`: the Transformers modeling backend with the scorers. Every other config resolves as before.
"""

from __future__ import annotations

import functools

from vllm import ModelRegistry
from vllm.config import ModelConfig

from ...patched_config import is_patched_config
from ..wrapping import wrap_once
from .checks import check_parallelism

ARCHITECTURE = "HfNeuralAttnForCausalLM"  # the name the model class is registered under in vLLM's ModelRegistry
_MODEL_CLASS = "hf_neural_attn.integrations.vllm.model:PatchedTransformersForCausalLM"
# The backend class vLLM would pick for the config; the only one the patched class extends.
_SERVED_BACKEND_CLASS = "TransformersForCausalLM"


def install() -> None:
    """Register the model class and make vLLM's model config resolve patched configs to it (once per process)."""
    ModelRegistry.register_model(ARCHITECTURE, _MODEL_CLASS)
    wrap_once(ModelConfig, "get_model_arch_config", _around(before=_before_arch_config))
    wrap_once(ModelConfig, "_get_transformers_backend_cls", _around(after=_backend_class_for_patched))
    wrap_once(ModelConfig, "verify_with_parallel_config", _around(before=_parallelism))


def _around(before=None, after=None):
    """What makes a wrapper of a ModelConfig method, with ``before(config, *arguments)`` and
    ``result = after(config, result)`` around it."""

    def make_wrapper(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            if before is not None:
                before(self, *args, **kwargs)
            result = method(self, *args, **kwargs)
            return after(self, result) if after is not None else result

        return wrapper

    return make_wrapper


def _before_arch_config(model_config: ModelConfig) -> None:
    """A patched model is served by the Transformers modeling backend: ``model_impl`` "auto" becomes "transformers",
    and vLLM's own implementations are refused, since they would serve the base model without its scorers."""
    if not is_patched_config(model_config.hf_config):
        return
    if model_config.model_impl not in ("auto", "transformers"):
        raise ValueError(
            f"{model_config.model} was patched by hf_neural_attn: its attention scorers run in vLLM's Transformers "
            f"modeling backend only, and model_impl={model_config.model_impl!r} would serve the base model "
            "without them. Leave model_impl out (or pass model_impl='transformers')."
        )
    model_config.model_impl = "transformers"


def _backend_class_for_patched(model_config: ModelConfig, backend_class: str) -> str:
    if not is_patched_config(model_config.hf_config):
        return backend_class
    if backend_class != _SERVED_BACKEND_CLASS:
        raise ValueError(
            f"hf_neural_attn serves patched text decoders in vLLM (vLLM's {_SERVED_BACKEND_CLASS}); {model_config.model} "
            f"would need vLLM's {backend_class} (a multimodal, mixture-of-experts or pooling model), which the plugin "
            "does not extend. Serve it with transformers: python -m hf_neural_attn.serve PATH."
        )
    return ARCHITECTURE


def _parallelism(model_config: ModelConfig, parallel_config) -> None:
    if is_patched_config(model_config.hf_config):
        check_parallelism(model_config.model, parallel_config)
