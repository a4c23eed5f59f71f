"""The config object of a patched model: a private copy that carries the patch and says so when saved.

``patch_model`` never writes into the config object it finds on the model. In transformers 5 that object is
often shared (``LlamaForCausalLM(cfg)`` and ``AutoModel*.from_config(cfg)`` keep the caller's ``cfg``), and
writing into it would change every sibling built from it. The patched model gets a deep copy instead, whose
class is switched to a subclass of its own config class (``LlamaConfig`` -> ``LlamaConfigWithNeuralAttn``):

* ``isinstance(config, LlamaConfig)`` and ``config.model_type == "llama"`` still hold, so the model's code,
  PEFT and Trainer see the config they expect;
* its attention implementation reads ``"hf_neural_attn"``, which makes transformers call the scorers; setting another
  (``model.set_attn_implementation("eager")``, ``config._attn_implementation = "sdpa"``) changes the *base*
  implementation underneath (:attr:`_PatchedConfigMixin.base_attn_implementation`), and the scorers keep running;
* ``save_pretrained`` writes ``model_type: "hf_neural_attn"`` (the base type is kept in the record) and
  ``attn_implementation: "hf_neural_attn"``, plus a two-line loader file listed in ``auto_map`` and, when the folder
  has none, a model card (:mod:`hf_neural_attn.model_cards`). With the
  library imported, transformers' Auto classes load such a checkpoint patched (:mod:`hf_neural_attn.integrations.auto_classes`);
  without it every transformers entry point refuses instead of returning the unpatched base model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .compat.internals import (
    attn_implementation_of,
    define_implementation_descriptor,
    output_attentions_flag,
    saved_implementation,
    store_implementation,
    store_output_attentions_flag,
)
from .model_cards import write_full_checkpoint_card
from .record import (
    ATTN_IMPLEMENTATION,
    PATCHED_MODEL_TYPE,
    RECORD_KEY,
    PatchRecord,
    carries_record,
    known_implementations,
    recorded_base_model_type,
    remove_record,
)

LOADER_MODULE = "hf_neural_attn_loader"  # the loader file written beside config.json (without ".py")
LOADER_CONFIG_CLASS = "PatchedCheckpointConfig"
_LOADER_REF = f"{LOADER_MODULE}.{LOADER_CONFIG_CLASS}"
# The name of the library's entry point in vLLM's ``vllm.general_plugins`` group (pyproject.toml), which
# ``VLLM_PLUGINS`` must list for vLLM to load the plugin (hf_neural_attn.integrations.vllm).
VLLM_PLUGIN_NAME = "hf_neural_attn"

# transformers runs this file only under trust_remote_code=True, and only when hf_neural_attn is not importable:
# once it is imported, its registered config class takes precedence over remote code. Its one job is to make the
# load fail with transformers' own "requires the following packages ... hf_neural_attn. Run pip install ..."
# error instead of silently building the unpatched base model.
_LOADER_SOURCE = f'''"""This checkpoint was patched by hf_neural_attn: `pip install hf-neural-attn`, then load it with
`hf_neural_attn.from_pretrained(path)`, or `import hf_neural_attn` before any transformers Auto class.

Without the library, transformers would build the unpatched base model and drop the trained scorers; this
file makes the load fail with an error naming the package instead.
"""

import hf_neural_attn  # noqa: F401
from hf_neural_attn.auto import {LOADER_CONFIG_CLASS}  # noqa: F401
'''


def is_patched_config(config: Any) -> bool:
    return isinstance(config, _PatchedConfigMixin)


class _PatchedConfigMixin:
    """Mixed in front of a config class by :func:`patched_config_class`; see the module docstring."""

    _base_config_class: type[PretrainedConfig]

    # The class's descriptor for transformers' implementation field (defined below the class, through
    # integrations.internals) wins over the instance's own field, which keeps the *base* implementation: the one
    # the modules the patch does not score run, whose masks the scored modules get, and that unpatch_model
    # restores. transformers reads and writes the implementation through that field (``set_attn_implementation``,
    # ``config._attn_implementation = ...``, generation utilities): it always reads "hf_neural_attn", which is
    # what makes transformers call the scorers, and a value written is the new base.
    def _read_implementation(self) -> str:
        return ATTN_IMPLEMENTATION

    def _write_implementation(self, value: str | None) -> None:
        if value in (None, ATTN_IMPLEMENTATION):  # transformers re-asserting what it read: nothing changes
            return
        if not isinstance(value, str):
            raise TypeError(f"An attention implementation is a name, got {type(value).__name__} {value!r}.")
        if value not in known_implementations():  # transformers checks what set_attn_implementation is given
            raise ValueError(
                f"attn_implementation={value!r} is not an attention implementation transformers knows; the "
                f"possible ones are {known_implementations()}."
            )
        store_implementation(self, value)
        record = PatchRecord.of(self)
        if record is not None:  # the top config: a save records the new base (sub-configs carry no record)
            dataclasses.replace(record, base_attn_implementation=value).write_to(self)

    @property
    def base_attn_implementation(self) -> str:
        """The implementation the model runs under the patch: its unscored modules run it (eager or SDPA; flash and
        flex need masks of their own, so under those the unscored modules run SDPA), the scored ones get its masks.
        Set it as on any model, ``model.set_attn_implementation("eager")``; the scorers keep running."""
        return saved_implementation(self) or "eager"

    # transformers refuses output_attentions=True on a config whose implementation is not "eager", since SDPA and
    # flash return no probabilities. The patched attention returns them for every layer, scored or not.
    @property
    def output_attentions(self) -> bool:
        return output_attentions_flag(self)

    @output_attentions.setter
    def output_attentions(self, value: bool) -> None:
        store_output_attentions_flag(self, value)

    def to_json_string(self, use_diff: bool = True) -> str:
        text = super().to_json_string(use_diff)
        if not carries_record(self):  # a sub-config, serialised inside its parent by to_dict
            return text
        data = json.loads(text)
        data["model_type"] = PATCHED_MODEL_TYPE
        data["attn_implementation"] = ATTN_IMPLEMENTATION
        data["auto_map"] = {**(data.get("auto_map") or {}), "AutoConfig": _LOADER_REF}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs) -> None:
        if carries_record(self):
            # Written first, so that a push_to_hub of this folder uploads it together with config.json.
            os.makedirs(save_directory, exist_ok=True)
            with open(os.path.join(save_directory, f"{LOADER_MODULE}.py"), "w") as handle:
                handle.write(_LOADER_SOURCE)
            # The Hub's metadata of a patched checkpoint (hf_neural_attn.model_cards), unless the folder has a card.
            write_full_checkpoint_card(self, save_directory)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    def __reduce_ex__(self, protocol):
        # The class is made at run time, so pickle (torch.save, multiprocessing) rebuilds it from its base class.
        return _rebuild_patched_config, (self._base_config_class, self.__dict__.copy())


define_implementation_descriptor(
    _PatchedConfigMixin,
    property(_PatchedConfigMixin._read_implementation, _PatchedConfigMixin._write_implementation),
)


def _rebuild_patched_config(base_class: type[PretrainedConfig], state: dict[str, Any]) -> PretrainedConfig:
    """A patched config of ``base_class`` with the attributes ``state``, made as what it is (a copy, an unpickled
    one): no class changes after it is made."""
    patched_class = patched_config_class(base_class)
    config = patched_class.__new__(patched_class)
    config.__dict__.update(state)
    return config


# Called with (patched class, base class) for every patched config class made: the integrations register the
# attention function and transformers' Auto-class mapping here (hf_neural_attn.integrations.installer), so this module
# need not know the loaders that sit above it.
_PATCHED_CLASS_CALLBACKS: list[Callable[[type[PretrainedConfig], type[PretrainedConfig]], None]] = []


def on_patched_class(callback: Callable[[type[PretrainedConfig], type[PretrainedConfig]], None]) -> None:
    """Call ``callback(patched_class, base_class)`` for each patched config class, those made so far included."""
    _PATCHED_CLASS_CALLBACKS.append(callback)
    for base_class in _made_classes:
        callback(patched_config_class(base_class), base_class)


_made_classes: list[type[PretrainedConfig]] = []


def made_patched_classes() -> list[tuple[type[PretrainedConfig], type[PretrainedConfig]]]:
    """(patched class, base class) of every patched config class made so far in this process."""
    return [(patched_config_class(base_class), base_class) for base_class in _made_classes]


@cache
def patched_config_class(base_class: type[PretrainedConfig]) -> type[PretrainedConfig]:
    """The patched subclass of ``base_class``, made once per class; see :func:`on_patched_class`."""
    patched = type(
        f"{base_class.__name__}WithNeuralAttn",
        (_PatchedConfigMixin, base_class),
        {"__module__": __name__, "_base_config_class": base_class},
    )
    _made_classes.append(base_class)
    for callback in _PATCHED_CLASS_CALLBACKS:
        callback(patched, base_class)
    return patched


def base_config_as_recorded(config: PretrainedConfig, memo: dict[int, Any] | None = None) -> PretrainedConfig:
    """:func:`base_config` of a config carrying a record, for a model to be patched as the record says: where the
    config names no implementation of its own (one read from a checkpoint's config.json, which names ours), the copy
    runs the record's base (:attr:`PatchRecord.base_to_run`), as the loaders run it."""
    plain = base_config(config, memo)
    record = PatchRecord.of(config)
    if saved_implementation(plain) is None and record is not None and record.base_to_run:
        store_implementation(plain, record.base_to_run)
    return plain


def make_patched(config: PretrainedConfig) -> None:
    """Switch ``config`` (a private copy) to its patched class, in place."""
    if not is_patched_config(config):
        config.__class__ = patched_config_class(type(config))


def make_unpatched(config: PretrainedConfig) -> None:
    """Undo :func:`make_patched` in place: the base class again, its saved implementation visible, no record."""
    if is_patched_config(config):
        config.__class__ = config._base_config_class
    remove_record(config)


def implementation_under_patch(config: PretrainedConfig) -> str:
    """The attention implementation a model with ``config`` runs where the patch does not score, and would run
    unpatched: what ``patch_model`` records as the base. A patched config's base (the model it came from was patched
    over it, or ``set_attn_implementation`` chose it since); a plain config's own implementation. Never the patch's
    own name: a plain config that says ``"hf_neural_attn"`` (set by hand) has no base of its own, and runs eager
    under the patch, as a patched config without a base does."""
    if is_patched_config(config):
        return config.base_attn_implementation
    implementation = attn_implementation_of(config)
    return implementation if implementation not in (None, ATTN_IMPLEMENTATION) else "eager"


def model_type_under_patch(config: PretrainedConfig) -> str:
    """The model type of the unpatched model a model with ``config`` is (what ``patch_model`` records as the base
    type): never the patch's own, which a plain config class keeps when it reads a patched config.json."""
    model_type = config.model_type
    return type(config).model_type if model_type == PATCHED_MODEL_TYPE else model_type


def base_config(config: PretrainedConfig, memo: dict[int, Any] | None = None) -> PretrainedConfig:
    """A copy of ``config`` as the unpatched model's config: plain base class, no record, and its own
    ``_attn_implementation`` (a patched config keeps the base model's underneath). ``memo``: ``copy.deepcopy``'s,
    which then maps each sub-config to its copy."""
    memo = {} if memo is None else memo
    if is_patched_config(config):
        # Made as the base class (a deep copy of the attributes), not copied as a patched config and switched back.
        base_class = config._base_config_class
        plain = memo[id(config)] = base_class.__new__(base_class)
        plain.__dict__.update(copy.deepcopy(vars(config), memo))
    else:
        plain = copy.deepcopy(config, memo)
    remove_record(plain)
    if saved_implementation(plain) == ATTN_IMPLEMENTATION:
        store_implementation(plain, None)  # set by hand or read from a plain class load
    if plain.__dict__.get("model_type") == PATCHED_MODEL_TYPE:
        del plain.__dict__["model_type"]  # read from a patched config.json by the plain class: its class's again
    return plain


def config_from_saved_dict(config_dict: dict[str, Any], *, patched: bool = True, **kwargs):
    """Build the patched config of a checkpoint whose config.json says ``model_type: "hf_neural_attn"``; ``patched``
    False: its base config, carrying the record (what the library's loaders read: they build the base model, then
    patch its config once).

    Called by transformers through ``AutoConfig.from_pretrained`` (see :class:`hf_neural_attn.auto.
    PatchedCheckpointConfig`); returns what ``PretrainedConfig.from_dict`` returns for the base config class.
    """
    # Only the field needed to pick the config class is read here; the loaders check the whole record
    # (PatchRecord.from_dict), where the message can name the checkpoint's folder.
    base_type = recorded_base_model_type(config_dict)
    if not isinstance(base_type, str) or base_type == PATCHED_MODEL_TYPE or base_type not in CONFIG_MAPPING:
        raise ValueError(
            f"This checkpoint's config.json says model_type {PATCHED_MODEL_TYPE!r}, but its {RECORD_KEY!r} record "
            f"has no valid 'base_model_type' field (got {base_type!r}): the file is damaged, or "
            "base_model_type names a model this version of transformers does not have."
        )
    plain = {key: value for key, value in config_dict.items() if key != "attn_implementation"}
    plain["model_type"] = base_type
    auto_map = {key: ref for key, ref in (plain.pop("auto_map", None) or {}).items() if ref != _LOADER_REF}
    if auto_map:  # a base model with custom code of its own keeps it
        plain["auto_map"] = auto_map
    result = CONFIG_MAPPING[base_type].from_dict(plain, **kwargs)
    if patched:
        make_patched(result[0] if isinstance(result, tuple) else result)
    return result


class PatchedCheckpointConfig(PretrainedConfig):
    """``AutoConfig``'s class for ``model_type: "hf_neural_attn"``: builds the checkpoint's patched base config
    (:func:`config_from_saved_dict`). Saved checkpoints' loader files import it as
    ``hf_neural_attn.auto.PatchedCheckpointConfig``."""

    model_type = PATCHED_MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        refuse_vllm_without_plugin()
        return config_from_saved_dict(config_dict, **kwargs)


def refuse_vllm_without_plugin() -> None:
    """Refuse to read a patched checkpoint's config in a vLLM process that loaded its plugins without the library's.

    There vLLM would build its own implementation of the base architecture (nothing routes the patched config to the
    plugin's model class) and fail on the scorers' weights (``attn_scorer``) without naming the library. This runs
    where vLLM reads the config: through the checkpoint's loader file (``trust_remote_code=True``) or with the library
    imported by the user's script. Nothing of vLLM is imported: a process without it passes."""
    plugins, environment = sys.modules.get("vllm.plugins"), sys.modules.get("vllm.envs")
    if plugins is None or environment is None or not getattr(plugins, "plugins_loaded", False):
        return
    allowed = environment.VLLM_PLUGINS
    if allowed is None or VLLM_PLUGIN_NAME in allowed:
        return
    raise ValueError(
        f"This checkpoint was patched by hf_neural_attn, and this vLLM process loaded its plugins without "
        f"hf_neural_attn's (VLLM_PLUGINS={','.join(allowed)!r}), so vLLM would build the base model without the "
        f"attention scorers. Add the plugin's name, {VLLM_PLUGIN_NAME}, to VLLM_PLUGINS (a comma-separated list of "
        "plugin names) or unset it, with hf-neural-attn installed in vLLM's environment (pip install 'hf-neural-attn[vllm]'); "
        "or serve it with transformers: python -m hf_neural_attn.serve PATH."
    )


class PatchedCheckpointBaseConfig(PatchedCheckpointConfig):
    """The library's loaders' reader of a patched checkpoint's config.json: its base config, carrying the record
    (:func:`config_from_saved_dict` with ``patched=False``)."""

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        return config_from_saved_dict(config_dict, patched=False, **kwargs)


@contextlib.contextmanager
def base_implementation_visible(config: PretrainedConfig) -> Iterator[None]:
    """Within the block, ``config`` and the patched configs nested in it read as their base classes: their attention
    implementation reads the base one (what an engine that builds the model set, e.g. vLLM's ``"vllm"``), for code
    that decides from that name what the model dispatches to. The patch and its record stay; on leaving, they read
    ``"hf_neural_attn"`` again."""
    patched = [sub for sub in _configs_within(config) if is_patched_config(sub)]
    for sub in patched:
        sub.__class__ = sub._base_config_class
    try:
        yield
    finally:
        for sub in patched:
            sub.__class__ = patched_config_class(type(sub))


def _configs_within(config: PretrainedConfig) -> list[PretrainedConfig]:
    """``config`` and every config held in its attributes (a multimodal model's text config), depth first."""
    found = [config]
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            found.extend(_configs_within(value))
    return found
