"""transformers' Auto classes load patched checkpoints as patched models, once hf_neural_attn is imported.

A patched checkpoint's config.json says ``model_type: "hf_neural_attn"`` (see :mod:`hf_neural_attn.patched_config`).
Importing the library registers that type with ``AutoConfig``, whose config class
(:class:`~hf_neural_attn.patched_config.PatchedCheckpointConfig`) rebuilds the base config (``LlamaConfig``, ...) as
its patched subclass. Each patched config class is in turn registered here with every ``AutoModel*`` class that
serves its base class, mapped to a small loader class:

* ``AutoModelForCausalLM.from_pretrained(path)`` -> :func:`hf_neural_attn.from_pretrained` with the base class
  that Auto class would have built (``LlamaForCausalLM``), so the model comes back patched with its trained
  scorer weights, of the ordinary transformers class;
* ``AutoModelForCausalLM.from_config(patched_model.config)`` -> that base class built from the config and
  patched as recorded (freshly initialised scorers, like any ``from_config``).

This is the same route transformers offers any library with its own model types (``AutoConfig.register`` and
``AutoModel*.register``). :mod:`hf_neural_attn.integrations.installer` registers the checkpoint type with
``AutoConfig`` and hands :func:`register_patched_config` to
:func:`hf_neural_attn.patched_config.on_patched_class`, so each patched config class is mapped as it is made.
"""

from __future__ import annotations

import os
from functools import cache

from transformers import PretrainedConfig
from transformers.models.auto import modeling_auto
from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

from ..compat.internals import auto_model_classes, auto_model_mapping
from ..loading.dispatch import from_pretrained
from ..patched_config import base_config, base_config_as_recorded
from ..patching import patch_as_recorded, recorded_patch
from .wrapping import register

# Where transformers maps a config class to what goes with the model (AutoTokenizer, AutoImageProcessor,
# AutoFeatureExtractor, AutoProcessor): a patched folder's files resolve to the classes its base's would.
_PREPROCESSOR_MAPPINGS = (TOKENIZER_MAPPING, IMAGE_PROCESSOR_MAPPING, FEATURE_EXTRACTOR_MAPPING, PROCESSOR_MAPPING)


def register_patched_config(patched_class: type[PretrainedConfig], base_class: type[PretrainedConfig]) -> None:
    """Map ``patched_class`` to a loader in every Auto model class that builds ``base_class``, and to
    ``base_class``'s tokenizer, image processor, feature extractor and processor classes."""
    for auto_class in auto_model_classes(modeling_auto):
        if base_class in auto_model_mapping(auto_class):
            register(auto_model_mapping(auto_class), patched_class, _loader_for(auto_class))
    for mapping in _PREPROCESSOR_MAPPINGS:
        if base_class not in mapping:
            continue
        try:
            classes = mapping[base_class]
        except (ImportError, AttributeError):  # its dependency is missing: the base's Auto class fails the same way
            continue
        register(mapping, patched_class, classes)


def _base_model_class(auto_class: type, config: PretrainedConfig):
    """The transformers class ``auto_class`` builds for the unpatched ``config``."""
    candidates = auto_model_mapping(auto_class)[type(config)]
    if not isinstance(candidates, (list, tuple)):
        return candidates
    by_name = {candidate.__name__: candidate for candidate in candidates}
    for architecture in getattr(config, "architectures", None) or []:
        if architecture in by_name:
            return by_name[architecture]
    return candidates[0]


@cache
def _loader_for(auto_class: type) -> type:
    """The class ``auto_class`` maps patched configs to: it builds the base class ``auto_class`` would build."""

    class PatchedModelLoader:
        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args, config=None, **kwargs):
            if model_args:
                raise TypeError(
                    "hf_neural_attn checkpoints take no positional model arguments; pass options as keywords."
                )
            model_class = _base_model_class(auto_class, base_config(config))
            return from_pretrained(pretrained_model_name_or_path, model_class=model_class, config=config, **kwargs)

        @classmethod
        def _from_config(cls, config, **kwargs):
            recorded_patch(config)  # read before the model is built: no record, or a damaged one, fails fast
            plain = base_config_as_recorded(config)
            model = _base_model_class(auto_class, plain)._from_config(plain, **kwargs)
            return patch_as_recorded(model, config, config_is_private=True)  # ``plain`` was made for this model

    PatchedModelLoader.__name__ = PatchedModelLoader.__qualname__ = f"{auto_class.__name__}PatchedLoader"
    return PatchedModelLoader
