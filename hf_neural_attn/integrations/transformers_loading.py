"""A transformers model class's own ``from_pretrained``, ``save_pretrained`` and constructor, on patched checkpoints,
models and configs.

transformers builds what it is asked for: ``LlamaForCausalLM.from_pretrained(path)`` builds a ``LlamaForCausalLM``
from ``path/config.json`` whatever model type the file names, and an explicit ``attn_implementation=`` overrides the
one the file asks for. On a patched checkpoint that would be the base model, its trained scorer tensors left aside as
"unexpected". It is the most common way to load a model (``transformers serve`` loads the class named in
``config.architectures`` that way, with its own ``attn_implementation``).

Once the library is imported, :func:`install` (run as soon as transformers' modeling stack is imported as well, see
:mod:`hf_neural_attn.integrations.import_hooks`) wraps transformers' ``PreTrainedModel.from_pretrained``: a call whose source
is a patched checkpoint (its config.json, or the ``config=`` passed in, carries the patch record) is served by
:func:`hf_neural_attn.from_pretrained` with the class asked for and every keyword as given (``attn_implementation``,
``config``, ``device_map``, ``dtype``, ...), so it returns the patched model, of that class. Any other call runs
transformers' own code unchanged. The check reads config.json where no ``config=`` is passed (transformers reads it
next anyway; for a Hub repo it is one more cached-file lookup), and a local folder's config.json where a ``config=``
without the record is. The library's own loaders build the base model through classes marked with
:data:`~hf_neural_attn.record.BASE_LOAD_ATTR`, which pass straight through.

A model built by its class from a patched model's or checkpoint's config (``LlamaForCausalLM(patched.config)``, as
transformers' own tests build an assistant model for assisted decoding) is patched as that config's record says,
with fresh scorers, as ``AutoModelForCausalLM.from_config(patched.config)`` gives it
(:func:`~hf_neural_attn.patching.patch_as_recorded`): ``post_init``, which every transformers model calls at the end
of its ``__init__``, does it for the outermost model being built.

``save_pretrained`` of a patched model whose scorers PEFT still wraps (``get_peft_model(model).get_base_model()
.save_pretrained(path)``) would write the scorer tensors under PEFT's wrapper names, a checkpoint nothing can load
patched: it is refused, with the calls that save what was trained.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from ..loading.files import is_patched_config_dict, saved_config_dict
from ..record import BASE_LOAD_ATTR, PEFT_WRAPPER_PARTS, SCORER_ATTR, carries_record, is_patched
from .wrapping import wrap_once


def install() -> None:
    """Wrap ``PreTrainedModel.from_pretrained``, ``save_pretrained`` and ``post_init`` (once; see the module
    docstring)."""
    wrap_once(PreTrainedModel, "from_pretrained", _routing_from_pretrained)
    wrap_once(PreTrainedModel, "save_pretrained", _checked_save_pretrained)
    wrap_once(PreTrainedModel, "post_init", _patching_post_init)


def _routing_from_pretrained(original):
    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if getattr(cls, BASE_LOAD_ATTR, False) or not is_patched_source(pretrained_model_name_or_path, kwargs):
            return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        if model_args:
            raise TypeError(
                f"{pretrained_model_name_or_path} is a hf_neural_attn checkpoint, whose loading takes no positional "
                "model arguments; pass options as keywords."
            )
        # Imported here: install() runs while transformers' modeling stack finishes importing, which may be in the
        # middle of one of the library's own imports, so this module imports no loader at its top.
        from ..loading.dispatch import from_pretrained as load_patched

        return load_patched(pretrained_model_name_or_path, model_class=cls, **kwargs)

    return from_pretrained


def _patching_post_init(original):
    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        # Cheap for every other model: only a config carrying the record is looked at further.
        if carries_record(self.config) and not is_patched(self) and not _built_inside_another_model(self):
            from ..patching import patch_as_recorded

            patch_as_recorded(self, self.config)
        return result

    return post_init


def _built_inside_another_model(model) -> bool:
    """Whether ``model`` is a part another model's ``__init__`` is building (``LlamaModel`` inside
    ``LlamaForCausalLM``): the model being built is the outermost, and it is patched once, whole, at the end of its
    own ``__init__`` (transformers calls ``post_init`` last in every model's ``__init__``, parts first)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            builder = frame.f_locals.get("self")
            if builder is not model and isinstance(builder, PreTrainedModel):
                return True
        frame = frame.f_back
    return False


def _checked_save_pretrained(original):
    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        # With transformers' own PEFT integration loaded (add_adapter), save_pretrained writes the adapter only.
        if is_patched(self) and not getattr(self, "_hf_peft_config_loaded", False):
            check_scorers_unwrapped(self, kwargs.get("state_dict"))
        return original(self, save_directory, *args, **kwargs)

    return save_pretrained


def is_patched_source(source, kwargs: dict[str, Any]) -> bool:
    """Whether a ``from_pretrained(source, **kwargs)`` call loads a patched checkpoint: the ``config=`` passed in
    carries the patch record, or (none passed) the checkpoint's config.json does.

    Raises:
        ValueError: a ``config=`` without the record for a local folder whose config.json is a patched checkpoint's:
            the model would be built without its patch.
    """
    if source is None or kwargs.get("gguf_file") or kwargs.get("state_dict") is not None:
        return False
    config = kwargs.get("config")
    if isinstance(config, PretrainedConfig):
        if carries_record(config):
            return True
        # The Auto classes pass the config they read: for a patched checkpoint that is a patched config (above).
        # A config built by hand for a patched folder is checked where that is a file read (a local folder).
        if is_patched_config_dict(saved_config_dict(source, kwargs, local_only=True)):
            raise ValueError(
                f"{source} is a hf_neural_attn checkpoint, and the config= passed in ({type(config).__name__}) carries "
                "no patch record, so the model would be built without its scorers. Leave config= out, or pass "
                f"AutoConfig.from_pretrained({str(source)!r}) (with hf_neural_attn imported), changed as you need."
            )
        return False
    saved = saved_config_dict(config if isinstance(config, (str, os.PathLike)) else source, kwargs)
    return is_patched_config_dict(saved)


def check_scorers_unwrapped(model, state_dict: dict | None = None) -> None:
    """Refuse to save a patched model whose scorer tensors would be written under PEFT's wrapper names.

    Raises:
        ValueError: naming the tensors and the calls that save what was trained.
    """
    names = state_dict.keys() if state_dict is not None else (name for name, _ in model.named_parameters())
    marker = f".{SCORER_ATTR}."
    wrapped = [
        name
        for name in names
        if marker in f".{name}" and any(part in "." + f".{name}".partition(marker)[2] for part in PEFT_WRAPPER_PARTS)
    ]
    if wrapped:
        raise ValueError(
            f"This patched model's scorers are still wrapped by PEFT ({len(wrapped)} tensors such as {wrapped[:2]}), "
            "so save_pretrained would write them under PEFT's names, where loading cannot find them. Save the PEFT "
            "model (peft_model.save_pretrained(path): the adapter with the trained scorers), or merge first "
            "(peft_model.merge_and_unload().save_pretrained(path): a full patched checkpoint)."
        )
