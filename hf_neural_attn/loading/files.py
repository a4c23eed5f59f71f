"""Files of a checkpoint: the caller's keywords split as transformers splits them, the config, the model class,
the names tensors have on disk, and the safetensors reads.

Nothing here builds or patches a model; :mod:`.rebuild` does, with what these functions read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils import CONFIG_NAME

from ..compat.internals import PRIVATE_LOADING_KWARGS, hub_file_or_none, with_reversible_conversions_only
from ..patched_config import PatchedCheckpointBaseConfig
from ..record import PATCHED_MODEL_TYPE, carries_record

# Keyword arguments that locate files (on disk or on the Hub); shared by the config, weights and our reads.
FILE_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")
# transformers' ``PreTrainedModel.from_pretrained`` keywords that steer loading (transformers 5.23 pops these
# before building the config); every other keyword it reads as a config attribute to override, and passes what
# is left to the model's constructor.
LOADING_KWARGS = (
    *FILE_KWARGS,
    "state_dict", "tqdm_class", "output_loading_info", "dtype", "torch_dtype",
    "device_map", "max_memory", "offload_folder", "offload_buffers", "quantization_config",
    "variant", "adapter_kwargs", "adapter_name", "generation_config", "gguf_file", "distributed_config",
    "device_mesh", "tp_plan", "tp_size", "trust_remote_code", "allow_all_kernels", "use_kernels", "kernel_config",
    "key_mapping", "ignore_mismatched_sizes", "use_safetensors", "weights_only", "attn_implementation",
    "mirror", "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict",
    *PRIVATE_LOADING_KWARGS,
)  # fmt: skip
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def split_config_overrides(hf_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(loading keywords, candidate config overrides), as transformers' ``from_pretrained`` splits them."""
    loading = {key: value for key, value in hf_kwargs.items() if key in LOADING_KWARGS}
    return loading, {key: value for key, value in hf_kwargs.items() if key not in LOADING_KWARGS}


def load_config(path_or_repo_id: str, hf_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(config, loading keywords)`` for ``path_or_repo_id`` and the caller's ``hf_kwargs``.

    As in transformers: a ``config=`` passed in is used as given (callers read it and copy it with
    :func:`~hf_neural_attn.patched_config.base_config`, never change it) and every other keyword goes on to loading; otherwise keywords that are config attributes
    (``num_labels``, ``output_hidden_states``, ...) override the loaded config's, and the rest go on.
    """
    hf_kwargs = dict(hf_kwargs)
    config = hf_kwargs.pop("config", None)
    if config is not None:
        return config, hf_kwargs
    loading, overrides = split_config_overrides(hf_kwargs)
    lookup = {key: loading[key] for key in (*FILE_KWARGS, "trust_remote_code") if key in loading}
    # A patched checkpoint's config.json is read by the library's config class itself, not through AutoConfig's
    # registry: loading works with the integrations switched off (hf_neural_attn.integrations.installer). It is read
    # as its base config with the record: the loaders build the base model from it, and the patch makes it patched.
    saved = saved_config_dict(path_or_repo_id, lookup)
    reader = PatchedCheckpointBaseConfig if (saved or {}).get("model_type") == PATCHED_MODEL_TYPE else AutoConfig
    config, unused = reader.from_pretrained(path_or_repo_id, return_unused_kwargs=True, **lookup, **overrides)
    return config, {**loading, **unused}


def saved_config_dict(
    source, hf_kwargs: dict[str, Any], *, local_only: bool = False, quiet: bool = True
) -> dict | None:
    """The config.json of ``source`` (a folder, or a Hub repo unless ``local_only``; ``hf_kwargs`` locate it) as a
    mapping, without building a config; None where there is none. ``quiet``: None also where the Hub cannot be reached
    or the repo id is malformed (transformers' own loading then says what is wrong); else those errors propagate."""
    try:
        folder = os.path.join(os.fspath(source), hf_kwargs.get("subfolder") or "")
    except TypeError:
        return None
    if os.path.isdir(folder):
        path = os.path.join(folder, CONFIG_NAME)
    elif local_only:
        return None
    else:
        lookup = {key: hf_kwargs[key] for key in FILE_KWARGS if key in hf_kwargs}
        try:
            path = hub_file_or_none(os.fspath(source), CONFIG_NAME, raise_connection_errors=not quiet, **lookup)
        except (OSError, ValueError):  # a malformed repo id, a gated repo, no connection
            if not quiet:
                raise
            return None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_patched_config_dict(data: Any) -> bool:
    """Whether a config.json's content is a patched checkpoint's (also in the format before model_type was ours)."""
    return isinstance(data, dict) and (data.get("model_type") == PATCHED_MODEL_TYPE or carries_record(data))


def check_source(path_or_repo_id) -> None:
    """A path that can only mean a folder on this machine (absolute, or starting with ``.`` or ``~``) exists;
    transformers would otherwise read it as a malformed Hub repo id and say so."""
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise TypeError(
            f"path_or_repo_id must be a folder or a Hub repo id (a string or path), got {type(path_or_repo_id).__name__}."
        )
    path = os.fspath(path_or_repo_id)
    if (os.path.isabs(path) or path.startswith((".", "~"))) and not os.path.isdir(os.path.expanduser(path)):
        raise ValueError(
            f"path_or_repo_id {path!r} is not a folder on this machine"
            f"{' (it is a file)' if os.path.isfile(path) else ''}: check the path, or pass a Hub repo id."
        )


def check_not_training_state(path_or_repo_id) -> None:
    """A local folder that Accelerate's ``save_state`` wrote (its random states beside the weights, no config.json) is
    a training state, not a checkpoint: the error says so and how to get the model out of it (transformers would
    say only that it finds no ``model_type``)."""
    folder = os.path.expanduser(os.fspath(path_or_repo_id))
    if not os.path.isdir(folder) or os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        return
    names = set(os.listdir(folder))
    if not any(name.startswith("random_states") and name.endswith(".pkl") for name in names):
        return
    if "trainer_state.json" in names:  # a checkpoint of hf_neural_attn's recipes (recipes/checkpointing.py)
        how = (
            f"`python -m recipes.export {folder} <new folder>` saves its model with its tokenizer, as the run saves "
            "its final one (a LoRA run's as PEFT's adapter), with a README.md that says how to load it"
        )
    else:
        how = (
            "load it into the model it was trained from with `accelerator.load_state(folder)` and save that model "
            "with `save_pretrained`"
        )
    raise ValueError(
        f"{path_or_repo_id} is a training-state folder, written by Accelerate's save_state to resume training (the "
        "weights in the training backend's own layout, with optimizer, scheduler and random states), not a model "
        f"checkpoint: it has no config.json. Resume training from it, or make a checkpoint of it: {how}."
    )


def check_model_class(model_class) -> None:
    """``model_class`` (the caller's ``model_class=``) is a transformers model class, or None."""
    if model_class is not None and not (isinstance(model_class, type) and issubclass(model_class, PreTrainedModel)):
        raise TypeError(
            f"model_class must be a transformers model class, such as transformers.LlamaForCausalLM, got "
            f"{model_class!r}."
        )


def check_model_class_fits(model_class, config, describe: str) -> None:
    """``model_class`` builds models of ``config``'s kind; else the ``ValueError`` says which kind each is."""
    expected = getattr(model_class, "config_class", None)
    if isinstance(expected, type) and not isinstance(config, expected):
        raise ValueError(
            f"model_class={model_class.__name__} builds {expected.__name__} models, but {describe} is a "
            f"{getattr(config, 'model_type', type(config).__name__)!r} model ({type(config).__name__}). Pass a class "
            "of its kind, or leave model_class out to build the recorded one."
        )


def model_class_for(config, source: str, model_class=None):
    """The transformers class to build: ``model_class`` when given, else ``config.architectures[0]``."""
    if model_class is not None:
        return model_class
    architectures = getattr(config, "architectures", None) or []
    found = getattr(transformers, architectures[0], None) if architectures else None
    if found is None:
        raise ValueError(
            f"Cannot tell which model class to build for {source}: config.architectures is {architectures!r}. "
            "Checkpoints written by save_pretrained record it; or pass model_class=."
        )
    return found


@contextmanager
def unreadable_weights_are_errors(source: str):
    """Turn safetensors' read errors into a ``ValueError`` that says which checkpoint and what to do."""
    try:
        yield
    except SafetensorError as error:
        raise ValueError(
            f"The weights in {source} cannot be read ({error}); the file is truncated or corrupt. Save the "
            "model again, or download it again with force_download=True."
        ) from error


def names_on_disk(model, parameters: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Where each of ``parameters`` (named as in ``model``) can sit in a checkpoint: its name after the key
    renaming transformers applies when saving some models (e.g. ViT's ``vit.layers.0`` is written as
    ``vit.encoder.layer.0``), then its name in the model; each also with the base model prefix added or taken
    away, as transformers matches a bare model (``LlamaModel``) and one with a head (``LlamaForCausalLM``)
    against each other's checkpoints. The first candidate is the name a full checkpoint of ``model`` uses."""
    model_name_of = {id(tensor): name for name, tensor in parameters.items()}
    saved_as = {name: [] for name in parameters}
    for disk_name, tensor in _saved_names(model, dict(parameters)).items():
        if id(tensor) in model_name_of:
            saved_as[model_name_of[id(tensor)]].append(disk_name)
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    candidates = {}
    for name, names in saved_as.items():
        names = [*names, name]
        if prefix != ".":
            names += [n.removeprefix(prefix) if n.startswith(prefix) else prefix + n for n in names]
        candidates[name] = list(dict.fromkeys(names))
    return candidates


def _saved_names(model, parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``parameters`` under the names transformers' ``save_pretrained`` of ``model`` gives them (its
    ``revert_weight_conversion``).

    Some of the converters a load attaches have no reverse: torchao's, which assembles each weight of a pre-quantized
    checkpoint from its parts, makes transformers' own ``save_pretrained`` of such a model raise
    ``NotImplementedError`` too. They act on the base's quantized weights, never on the scorers' names, so those are
    reverted here without them (the renamings a family's checkpoints use still apply)."""
    try:
        return revert_weight_conversion(model, parameters)
    except NotImplementedError:
        return revert_weight_conversion(with_reversible_conversions_only(model), parameters)


def read_tensors(
    source: str, names: set[str], file_kwargs: dict, also: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """Read those of ``names`` present in the checkpoint's safetensors file(s), single or sharded, and every tensor
    whose name ``also`` accepts."""
    index_file = hub_file_or_none(source, WEIGHTS_INDEX_NAME, **file_kwargs)
    if index_file is not None:
        with open(index_file) as handle:
            weight_map = json.load(handle)["weight_map"]
        files = sorted({file for name, file in weight_map.items() if name in names or (also and also(name))})
    else:
        files = [WEIGHTS_NAME]
    tensors: dict[str, torch.Tensor] = {}
    for filename in files:
        local = hub_file_or_none(source, filename, **file_kwargs)
        if local is None:
            raise ValueError(f"{source} has no {filename}; patched checkpoints are saved as safetensors.")
        with safe_open(local, framework="pt") as weights:
            for name in (name for name in weights.keys() if name in names or (also and also(name))):  # noqa: SIM118
                tensors[name] = weights.get_tensor(name)
    return tensors
