"""Loading patched checkpoints.

Adapter-only checkpoints (scorer tensors plus the base model's id) are written and read by
:mod:`hf_neural_attn.adapters`; :func:`from_pretrained` hands such folders and repos over to it.

Saving a full checkpoint needs nothing of ours: a patched model's ``save_pretrained`` / ``push_to_hub``
writes its safetensors (scorer weights included, under ``...attn_scorer...``) and its config, which carries the
patch record in ``hf_neural_attn``. Loading is :func:`from_pretrained`: transformers loads the base model
(so ``dtype``, ``device_map``, ``revision``, ``token`` ... behave as usual), the recorded patch is applied
again, and the scorer weights are read from the same safetensors files.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig
from transformers.utils import cached_file

from . import __version__
from .patching import RECORD_KEY, patch_model, scorer_parameters
from .scorers import SCORERS

# Keyword arguments that locate files (on disk or on the Hub); shared by the config, weights and our reads.
_FILE_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")
_RECORD_FIELDS = ("scorer", "options", "layers", "version")
_WEIGHTS_NAME = "model.safetensors"
_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def from_pretrained(
    path_or_repo_id: str | os.PathLike,
    *,
    base_model_name_or_path: str | os.PathLike | None = None,
    base_model_revision: str | None = None,
    **hf_kwargs: Any,
):
    """Load a patched checkpoint: a full one (a patched model's ``save_pretrained`` / ``push_to_hub``) or an
    adapter-only one (:func:`save_adapter` / :func:`push_adapter_to_hub`).

    Args:
        path_or_repo_id: a local folder or a Hub repo id. One holding ``hf_neural_attn_adapter.json`` is an
            adapter-only checkpoint; anything else is read as a full checkpoint.
        base_model_name_or_path: adapters only: load the base model from here instead of the recorded id
            (e.g. the recorded local folder is on another machine). Its revision is then
            ``base_model_revision``, not the recorded one.
        base_model_revision: adapters only: the base model's revision, instead of the recorded one.
        **hf_kwargs: passed to the model class's ``from_pretrained`` (``dtype``, ``device_map``,
            ``revision``, ``token``, ``local_files_only``, ...). For an adapter, ``revision`` and
            ``subfolder`` locate the adapter; the other keywords go to the base model's ``from_pretrained``
            (``token``, ``cache_dir``, ``local_files_only``, ... to both lookups).

    Returns:
        The model, of the class recorded in ``config.architectures`` (or the adapter), patched as it was
        when saved, with its saved scorer weights: its outputs equal the saved model's.

    Raises:
        ValueError: the folder is not a patched checkpoint (no ``hf_neural_attn`` record in its config),
            the record is damaged, the scorer weights are missing or do not fit, or an adapter does not fit
            its base model (other family, fewer layers, other shapes).
        OSError: an adapter's base model cannot be loaded (the message says how to point at it).
    """
    from .adapters import find_adapter_config, load_adapter_model

    adapter_config_file = find_adapter_config(path_or_repo_id, hf_kwargs)
    if adapter_config_file is not None:
        return load_adapter_model(
            path_or_repo_id,
            adapter_config_file,
            base_model_name_or_path=base_model_name_or_path,
            base_model_revision=base_model_revision,
            hf_kwargs=hf_kwargs,
        )
    if base_model_name_or_path is not None or base_model_revision is not None:
        raise ValueError(
            f"{path_or_repo_id} is not an adapter-only checkpoint (it has no hf_neural_attn_adapter.json), so "
            "base_model_name_or_path / base_model_revision do not apply: a full checkpoint holds its base weights."
        )
    path_or_repo_id = str(path_or_repo_id)
    file_kwargs = {k: hf_kwargs[k] for k in _FILE_KWARGS if k in hf_kwargs}
    config = hf_kwargs.pop("config", None)
    # A copy: the record is removed from it below, and a config the caller passed must stay as it was.
    config = copy.deepcopy(config) if config is not None else AutoConfig.from_pretrained(path_or_repo_id, **file_kwargs)
    record = _read_record(config, path_or_repo_id)
    model_class = _model_class(config, path_or_repo_id)
    # The record describes a patch still to apply; the base model must load unpatched.
    delattr(config, RECORD_KEY)
    # Unpatched layers (and unpatch_model) should run what the saved model ran, unless told otherwise.
    if record.get("base_attn_implementation") in ("eager", "sdpa"):
        hf_kwargs.setdefault("attn_implementation", record["base_attn_implementation"])

    with _unreadable_weights_are_errors(path_or_repo_id), _quiet_transformers():
        model, loading_info = model_class.from_pretrained(
            path_or_repo_id, config=config, output_loading_info=True, **hf_kwargs
        )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # The fresh init is overwritten below: keep the caller's RNG stream and skip init warnings.
        warnings.simplefilter("ignore", UserWarning)
        patch_model(model, record["scorer"], layers=record["layers"], **record["options"])

    expected = scorer_parameters(model)
    _report_base_loading(loading_info, set(expected), path_or_repo_id)
    disk_names = _names_on_disk(model, expected)
    with _unreadable_weights_are_errors(path_or_repo_id):
        on_disk = _read_tensors(path_or_repo_id, {n for names in disk_names.values() for n in names}, file_kwargs)
    tensors = {}
    for name, candidates in disk_names.items():
        found = next((candidate for candidate in candidates if candidate in on_disk), None)
        if found is not None:
            tensors[name] = on_disk[found]
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(
            f"{path_or_repo_id} records a {record['scorer']!r} patch but its weights lack {len(missing)} scorer "
            f"tensor(s), e.g. {missing[:3]}. The checkpoint is incomplete or was saved by another model."
        )
    with torch.no_grad():
        for name, parameter in expected.items():
            saved = tensors[name]
            if saved.shape != parameter.shape:
                raise ValueError(
                    f"Scorer weight {name} in {path_or_repo_id} has shape {tuple(saved.shape)}, but the recorded "
                    f"patch builds {tuple(parameter.shape)}. The checkpoint's config and weights disagree."
                )
            parameter.copy_(saved)
    return model


def _read_record(config, source: str) -> dict[str, Any]:
    record = getattr(config, RECORD_KEY, None)
    if record is None:
        raise ValueError(
            f"{source} is not a hf_neural_attn checkpoint: its config.json has no {RECORD_KEY!r} record. "
            "Load it with transformers and call hf_neural_attn.patch_model(model, ...) to patch it."
        )
    return _check_record(record, source, "config.json")


def _check_record(record: Any, source: str, filename: str, stacklevel: int = 4) -> dict[str, Any]:
    """A patch record read from ``source``'s ``filename``, validated. ``stacklevel`` of a version warning
    points at the user's call (the default suits from_pretrained -> _read_record -> here)."""
    if not isinstance(record, dict) or any(field not in record for field in _RECORD_FIELDS):
        raise ValueError(
            f"The {RECORD_KEY!r} record in {source}/{filename} is damaged: expected a mapping with "
            f"{list(_RECORD_FIELDS)}, got {record!r}."
        )
    if record["scorer"] not in SCORERS:
        raise ValueError(
            f"{source} was patched with scorer {record['scorer']!r}, which this version of hf_neural_attn "
            f"({__version__}) does not have. Available scorers: {sorted(SCORERS)}."
        )
    if str(record["version"]).split(".")[0] != __version__.split(".")[0]:
        warnings.warn(
            f"{source} was saved by hf_neural_attn {record['version']}; this is {__version__}.",
            UserWarning,
            stacklevel=stacklevel,
        )
    return record


def _model_class(config, source: str):
    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        raise ValueError(
            f"Cannot tell which model class to build for {source}: config.architectures is {architectures!r}. "
            "Checkpoints written by save_pretrained record it."
        )
    return model_class


@contextmanager
def _unreadable_weights_are_errors(source: str):
    try:
        yield
    except SafetensorError as error:
        raise ValueError(
            f"The weights in {source} cannot be read ({error}); the file is truncated or corrupt. Save the "
            "model again, or download it again with force_download=True."
        ) from error


@contextmanager
def _quiet_transformers():
    """Hide transformers' load report, which lists the scorer weights as unexpected; we check it ourselves."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _report_base_loading(
    info: dict, scorer_names: set[str], source: str, missing_hint: str = "", stacklevel: int = 3
) -> None:
    """Warn about base weights transformers could not match; ``missing_hint`` is added when some are missing.
    ``stacklevel`` points the warning at the user's call (the default suits from_pretrained -> here)."""
    unexpected = sorted(set(info.get("unexpected_keys", ())) - scorer_names)
    missing = sorted(info.get("missing_keys", ()))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", ()))
    problems = [
        f"{label}: {names[:5]}{' ...' if len(names) > 5 else ''}"
        for label, names in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched))
        if names
    ]
    if problems:
        hint = f" {missing_hint}" if missing and missing_hint else ""
        warnings.warn(
            f"Loading the base model from {source}: " + "; ".join(problems) + "." + hint,
            UserWarning,
            stacklevel=stacklevel,
        )


def _names_on_disk(model, parameters: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Where each parameter can sit in the checkpoint: its name after the key renaming transformers
    applies when saving some models (e.g. ViT's ``vit.layers.0`` is written as ``vit.encoder.layer.0``),
    then its name in the model."""
    from transformers.core_model_loading import revert_weight_conversion

    model_name_of = {id(tensor): name for name, tensor in parameters.items()}
    saved_as = {name: [] for name in parameters}
    for disk_name, tensor in revert_weight_conversion(model, dict(parameters)).items():
        if id(tensor) in model_name_of:
            saved_as[model_name_of[id(tensor)]].append(disk_name)
    return {name: [*names, name] for name, names in saved_as.items()}


def _read_tensors(source: str, names: set[str], file_kwargs: dict) -> dict[str, torch.Tensor]:
    """Read ``names`` from the checkpoint's safetensors file(s), single or sharded."""
    lookup = {**file_kwargs, "_raise_exceptions_for_missing_entries": False}
    index_file = cached_file(source, _WEIGHTS_INDEX_NAME, **lookup)
    if index_file is not None:
        with open(index_file) as handle:
            weight_map = json.load(handle)["weight_map"]
        files = sorted({weight_map[name] for name in names if name in weight_map})
    else:
        files = [_WEIGHTS_NAME]
    tensors: dict[str, torch.Tensor] = {}
    for filename in files:
        local = cached_file(source, filename, **lookup)
        if local is None:
            raise ValueError(f"{source} has no {filename}; patched checkpoints are saved as safetensors.")
        with safe_open(local, framework="pt") as weights:
            for name in names.intersection(weights.keys()):
                tensors[name] = weights.get_tensor(name)
    return tensors
