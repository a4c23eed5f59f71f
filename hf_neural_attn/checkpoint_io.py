"""What both checkpoint loaders share: reading and checking the patch record, splitting the caller's keywords
the way transformers does, reading safetensors, and the one load -> patch -> fill sequence.

:mod:`hf_neural_attn.checkpoint` (full checkpoints, and the dispatch) and :mod:`hf_neural_attn.adapters`
(adapter-only checkpoints) both build their model with :func:`load_patched_model`; they differ only in where
the base weights, the config and the scorer tensors come from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import re
import warnings
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig
from transformers.utils import cached_file

from . import __version__
from .families import find_attention
from .families.base import offloaded_weights_loaded
from .ops import IMPL_OPTIONS
from .patched_config import read_record
from .patching import patch_model, scorer_parameters
from .scorers import SCORERS, ScorerConfig

# Keyword arguments that locate files (on disk or on the Hub); shared by the config, weights and our reads.
FILE_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")
# transformers' ``PreTrainedModel.from_pretrained`` keywords that steer loading (transformers 5.23 pops these
# before building the config); every other keyword it reads as a config attribute to override, and passes what
# is left to the model's constructor.
LOADING_KWARGS = (
    *FILE_KWARGS,
    "state_dict", "tqdm_class", "output_loading_info", "_from_pipeline", "_from_auto", "dtype", "torch_dtype",
    "device_map", "max_memory", "offload_folder", "offload_buffers", "quantization_config", "_commit_hash",
    "variant", "adapter_kwargs", "adapter_name", "generation_config", "gguf_file", "distributed_config",
    "device_mesh", "tp_plan", "tp_size", "trust_remote_code", "allow_all_kernels", "use_kernels", "kernel_config",
    "key_mapping", "ignore_mismatched_sizes", "use_safetensors", "weights_only", "attn_implementation",
    "mirror", "_fast_init", "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict",
)  # fmt: skip
RECORD_FIELDS = ("scorer", "options", "layers", "version")  # required; "family", "base_attn_implementation" optional
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# The compute path a checkpoint falls back to when the recorded one cannot run on this machine: Triton where it
# can run (a model loaded on CPU and moved to a GPU later), the chunked path elsewhere.
PORTABLE_IMPL = "auto"
# At most this many elements of each base tensor go into its checksum (evenly strided): training moves every
# element of a weight it touches, so a sample catches it, and hashing stays cheap for large embeddings.
CHECKSUM_SAMPLE = 1 << 16


# ------------------------------------------------------------------------------------------ the patch record


def damaged(source: str, filename: str, field: str | None, problem: str) -> ValueError:
    """The error for a damaged patch record, naming the file it came from and the field."""
    where = f"field {field!r} of " if field else ""
    return ValueError(
        f"The hf_neural_attn record in {source}/{filename} is damaged: {where}the record {problem}. "
        "Save the model (or adapter) again with hf_neural_attn, or restore the file."
    )


def check_record(record: Any, source: str, filename: str, stacklevel: int = 4) -> dict[str, Any]:
    """The patch record read from ``source``'s ``filename`` (``config.json`` or the adapter JSON), validated
    field by field so that any damage is a ``ValueError`` naming the file and the field. ``stacklevel`` of the
    version warning points at the user's call."""
    if not isinstance(record, dict):
        raise damaged(source, filename, None, f"must be a mapping with {list(RECORD_FIELDS)}, got {record!r}")
    for field in RECORD_FIELDS:
        if field not in record:
            raise damaged(source, filename, field, f"lacks it (expected {list(RECORD_FIELDS)})")
    scorer, options, layers = record["scorer"], record["options"], record["layers"]
    if not isinstance(scorer, str):
        raise damaged(source, filename, "scorer", f"must name a scorer, got {scorer!r}")
    if scorer not in SCORERS:
        raise ValueError(
            f"{source} was patched with scorer {scorer!r}, which this version of hf_neural_attn "
            f"({__version__}) does not have. Available scorers: {sorted(SCORERS)}."
        )
    if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
        raise damaged(source, filename, "options", f"must be a mapping of option names to values, got {options!r}")
    if not (
        isinstance(layers, list) and layers and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    ):
        raise damaged(source, filename, "layers", f"must be a non-empty list of layer indices, got {layers!r}")
    if any(i < 0 for i in layers) or layers != sorted(set(layers)):
        raise damaged(source, filename, "layers", f"must hold sorted non-negative layer indices, got {layers!r}")
    version = record["version"]
    if not isinstance(version, str) or not re.fullmatch(r"\d+(\.\d+)*\S*", version):
        raise damaged(source, filename, "version", f"must be a version string, got {version!r}")
    for field in ("family", "base_attn_implementation", "base_model_type"):
        if record.get(field) is not None and not isinstance(record[field], str):
            raise damaged(source, filename, field, f"must be a name, got {record[field]!r}")
    if version.split(".")[0] != __version__.split(".")[0]:
        warnings.warn(
            f"{source} was saved by hf_neural_attn {version}; this is {__version__}.",
            UserWarning,
            stacklevel=stacklevel,
        )
    return record


def read_config_record(config, source: str) -> dict[str, Any]:
    """The checked patch record of a checkpoint's config (``ValueError`` with a hint when it has none)."""
    record = read_record(config)
    if record is None:
        raise ValueError(
            f"{source} is not a hf_neural_attn checkpoint: its config.json has no hf_neural_attn record. "
            "Load it with transformers and call hf_neural_attn.patch_model(model, ...) to patch it."
        )
    return check_record(record, source, "config.json", stacklevel=5)


def scorer_config(record: dict[str, Any], source: str, filename: str, impl: str | None) -> ScorerConfig:
    """The scorer config a checked record describes, with the compute path to run here.

    ``impl`` (the caller's choice) wins over the recorded one. The compute path is a run-time choice, not part of
    the model (every path computes the same scores), so a recorded ``"triton"`` that cannot run on this machine
    (no CUDA or no triton package) becomes :data:`PORTABLE_IMPL`, with one warning.
    """
    config_class = SCORERS[record["scorer"]].config_class
    try:
        config = config_class.from_record(record["options"])
    except (TypeError, ValueError) as error:
        raise damaged(
            source, filename, "options", f"does not describe a {record['scorer']!r} scorer: {str(error).rstrip('.')}"
        ) from error
    if impl is not None:
        if impl not in IMPL_OPTIONS:
            raise ValueError(f"impl={impl!r} is not a compute path; choose one of {sorted(IMPL_OPTIONS)}.")
        return dataclasses.replace(config, impl=impl)
    if config.impl == "triton" and not triton_can_run_here():
        warnings.warn(
            f"{source} was saved with impl='triton', which needs CUDA and the triton package; this machine lacks "
            f"{'CUDA' if not torch.cuda.is_available() else 'triton'}. Loading it with impl={PORTABLE_IMPL!r} "
            "(Triton where it can run, the chunked path elsewhere; same scores). Pass impl=... to choose.",
            UserWarning,
            stacklevel=4,
        )
        return dataclasses.replace(config, impl=PORTABLE_IMPL)
    return config


def triton_can_run_here() -> bool:
    """Whether the Triton kernels could run on this machine at all (CUDA present and triton installed)."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def check_model_fits_record(model, record: dict[str, Any], describe: str) -> None:
    """The freshly loaded base ``model`` is of the recorded family and has the recorded layers (scorer tensor
    shapes are checked when they are filled). ``describe`` starts the messages (e.g. "The adapter X")."""
    try:
        family, attention_modules, _ = find_attention(model)
    except TypeError as error:
        raise ValueError(f"{describe} cannot apply to the base model: {error}") from error
    if record.get("family") not in (None, family.name):
        raise ValueError(
            f"{describe} was saved from a {record['family']!r} model, but the base model is a {family.name!r} "
            "model; check base_model_name_or_path."
        )
    if record["layers"][-1] >= len(attention_modules):
        raise ValueError(
            f"{describe} patches attention layers {record['layers']}, but the base model has "
            f"{len(attention_modules)}; it was saved from another base model (check base_model_name_or_path)."
        )


# --------------------------------------------------------------------------------- keywords, config, class


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
    config, unused = AutoConfig.from_pretrained(path_or_repo_id, return_unused_kwargs=True, **lookup, **overrides)
    return config, {**loading, **unused}


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


# ------------------------------------------------------------------------------------------ files, contexts


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


@contextmanager
def quiet_transformers():
    """Hide transformers' load report, which lists the scorer weights as unexpected; we check it ourselves."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def names_on_disk(model, parameters: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Where each of ``parameters`` (named as in ``model``) can sit in a checkpoint: its name after the key
    renaming transformers applies when saving some models (e.g. ViT's ``vit.layers.0`` is written as
    ``vit.encoder.layer.0``), then its name in the model; each also with the base model prefix added or taken
    away, as transformers matches a bare model (``LlamaModel``) and one with a head (``LlamaForCausalLM``)
    against each other's checkpoints. The first candidate is the name a full checkpoint of ``model`` uses."""
    from transformers.core_model_loading import revert_weight_conversion

    model_name_of = {id(tensor): name for name, tensor in parameters.items()}
    saved_as = {name: [] for name in parameters}
    for disk_name, tensor in revert_weight_conversion(model, dict(parameters)).items():
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


def read_tensors(source: str, names: set[str], file_kwargs: dict) -> dict[str, torch.Tensor]:
    """Read those of ``names`` present in the checkpoint's safetensors file(s), single or sharded."""
    lookup = {**file_kwargs, "_raise_exceptions_for_missing_entries": False}
    index_file = cached_file(source, WEIGHTS_INDEX_NAME, **lookup)
    if index_file is not None:
        with open(index_file) as handle:
            weight_map = json.load(handle)["weight_map"]
        files = sorted({weight_map[name] for name in names if name in weight_map})
    else:
        files = [WEIGHTS_NAME]
    tensors: dict[str, torch.Tensor] = {}
    for filename in files:
        local = cached_file(source, filename, **lookup)
        if local is None:
            raise ValueError(f"{source} has no {filename}; patched checkpoints are saved as safetensors.")
        with safe_open(local, framework="pt") as weights:
            for name in names.intersection(weights.keys()):
                tensors[name] = weights.get_tensor(name)
    return tensors


# ---------------------------------------------------------------------------------------- base checksums


def base_checksum_names(model) -> list[str]:
    """A few base parameters that see the usual ways of training a base (full fine-tuning, merged LoRA, training
    the top or bottom layers): the first and the last of each kind (names with the layer numbers taken out:
    ``model.layers.#.self_attn.q_proj.weight``), so every module type, and the first and last layer, are covered.
    A change confined to middle layers goes unseen: a cheap check, not a proof."""
    scorers = set(scorer_parameters(model))
    chosen: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        if name not in scorers:
            kind = chosen.setdefault(re.sub(r"\.\d+\.", ".#.", name), [name])
            kind[1:] = [name] if name != kind[0] else []
    return [name for names in chosen.values() for name in names]


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """sha256 (hex, first 16 digits) of up to :data:`CHECKSUM_SAMPLE` evenly strided elements of ``tensor``,
    cast to ``dtype`` first (a cast to a lower precision is deterministic, so a base loaded in bf16 from fp32
    files hashes like one cast after loading)."""
    flat = tensor.detach().reshape(-1)
    flat = flat[:: max(1, flat.numel() // CHECKSUM_SAMPLE)][:CHECKSUM_SAMPLE]
    flat = flat.to(device="cpu", dtype=dtype or flat.dtype).contiguous()
    digest = hashlib.sha256(str(tuple(tensor.shape)).encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return digest.hexdigest()[:16]


def base_checksums(model) -> dict[str, dict[str, str]]:
    """``{name: {"dtype": ..., "sha256": ...}}`` of :func:`base_checksum_names`, for an adapter's JSON."""
    parameters = dict(model.named_parameters())
    checksums = {}
    for name in base_checksum_names(model):
        digest = _parameter_checksum(model, name)
        if digest is not None:
            checksums[name] = {"dtype": str(parameters[name].dtype).removeprefix("torch."), "sha256": digest}
    return checksums


@contextmanager
def loaded_parameter(model, name: str):
    """``model``'s parameter ``name``, loaded for the block when accelerate offloaded it (only its own module's
    tensors, so the model never has to fit at once); a meta tensor where it has no values anywhere."""
    owner_name, _, attribute = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    with offloaded_weights_loaded(owner):
        yield getattr(owner, attribute)


def _parameter_checksum(model, name: str, dtype: torch.dtype | None = None) -> str | None:
    """:func:`tensor_checksum` of ``model``'s parameter ``name``, offloaded or not; None where it has no values."""
    with loaded_parameter(model, name) as parameter:
        return None if parameter.is_meta else tensor_checksum(parameter, dtype)


def changed_base_tensors(model, recorded: Mapping[str, Mapping[str, str]]) -> list[str]:
    """The recorded base tensors whose values in ``model`` differ from the recorded checksums. Tensors the model
    lacks, or holds at a lower precision than recorded (then they cannot be compared), are skipped."""
    parameters = dict(model.named_parameters())
    changed = []
    for name, entry in recorded.items():
        dtype = getattr(torch, str(entry.get("dtype")), None)
        parameter = parameters.get(name)
        if parameter is None or not isinstance(dtype, torch.dtype):
            continue
        comparable = parameter.dtype == dtype or (
            parameter.is_floating_point()
            and dtype.is_floating_point
            and torch.finfo(parameter.dtype).bits > torch.finfo(dtype).bits
        )
        if not comparable:
            continue
        digest = _parameter_checksum(model, name, dtype)
        if digest is not None and digest != entry.get("sha256"):
            changed.append(name)
    return changed


# --------------------------------------------------------------------------------------- load, patch, fill


def fill_scorer_weights(
    model, saved: Mapping[str, torch.Tensor], *, describe: str, hint: str, exact: bool = False
) -> None:
    """Copy the scorer tensors ``saved`` (by their names on disk) into the patched ``model``'s scorers.

    Args:
        saved: on-disk name -> tensor; each scorer parameter is looked up under :func:`names_on_disk`.
        describe: the subject of the error messages ("The checkpoint X", "The adapter X").
        hint: what to check or do, appended to every error.
        exact: every tensor of ``saved`` must find a place (an adapter holds scorer tensors only).

    Raises:
        ValueError: a scorer tensor is missing or has another shape, or (``exact``) one is left over. The model's
            parameters are not changed then: every check runs before the first copy.
    """
    expected = scorer_parameters(model)
    tensors, used = {}, set()
    for name, candidates in names_on_disk(model, expected).items():
        found = next((candidate for candidate in candidates if candidate in saved), None)
        if found is not None:
            tensors[name] = saved[found]
            used.add(found)
    missing = sorted(set(expected) - set(tensors))
    unused = sorted(set(saved) - used) if exact else []
    problems = [
        f"{label} {len(names)} scorer tensor(s), e.g. {names[:3]}"
        for label, names in (("it lacks", missing), ("the patched model has no place for", unused))
        if names
    ]
    if problems:
        raise ValueError(f"{describe} does not fit the recorded patch: " + "; ".join(problems) + f". {hint}")
    mismatched = [
        f"{name}: saved {tuple(tensors[name].shape)}, patch builds {tuple(parameter.shape)}"
        for name, parameter in expected.items()
        if tensors[name].shape != parameter.shape
    ]
    if mismatched:
        raise ValueError(
            f"{describe} does not fit the recorded patch: {len(mismatched)} scorer tensor(s) have other shapes, "
            f"e.g. {mismatched[:2]}. {hint}"
        )
    with torch.no_grad():
        for name, parameter in expected.items():
            parameter.copy_(tensors[name])


def load_patched_model(
    model_class,
    weights_source: str,
    config,
    record: dict[str, Any],
    scorer: ScorerConfig,
    loading_kwargs: dict[str, Any],
    read_scorer_tensors: Callable[[set[str]], Mapping[str, torch.Tensor]],
    *,
    describe: str,
    hint: str,
    exact: bool = False,
    check_base: Callable[[Any], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Load the base model, patch it as recorded and fill its scorer weights: the one sequence both loaders run.

    Args:
        model_class: the transformers class to build; ``weights_source`` holds its base weights.
        config: the unpatched base config (see :func:`hf_neural_attn.patched_config.base_config`).
        record: the checked patch record (its ``layers`` and ``base_attn_implementation`` are used).
        scorer: the scorer config to patch with (:func:`scorer_config`).
        loading_kwargs: transformers' ``from_pretrained`` keywords (``dtype``, ``device_map``, ...).
        read_scorer_tensors: on-disk names wanted -> the tensors found under those names.
        describe, hint, exact: see :func:`fill_scorer_weights`.
        check_base: called with the base model before it is patched (raise to refuse it).

    Returns:
        (the patched model, transformers' loading info with the scorer weights not listed as unexpected).
    """
    loading_kwargs = dict(loading_kwargs)
    loading_kwargs.pop("output_loading_info", None)
    # Unpatched layers (and unpatch_model) should run what the saved model ran, unless told otherwise.
    if record.get("base_attn_implementation") in ("eager", "sdpa"):
        loading_kwargs.setdefault("attn_implementation", record["base_attn_implementation"])
    narrow_keys = getattr(scorer, "key_dim", None) is not None
    if narrow_keys:
        # QANA's key_dim saved narrower q_proj/k_proj than the base class builds: transformers may not load them
        # into the full-width layers; the patch below puts the narrow ones in place and they are filled from disk.
        loading_kwargs["ignore_mismatched_sizes"] = True
    with unreadable_weights_are_errors(weights_source), quiet_transformers():
        model, info = model_class.from_pretrained(
            weights_source, config=config, output_loading_info=True, **loading_kwargs
        )
    if check_base is not None:
        check_base(model)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # The fresh init is overwritten below: keep the caller's RNG stream and skip init warnings.
        warnings.simplefilter("ignore", UserWarning)
        patch_model(model, scorer, layers=record["layers"])
    disk_names = names_on_disk(model, scorer_parameters(model))
    all_names = {name for names in disk_names.values() for name in names}
    with unreadable_weights_are_errors(weights_source):
        saved = read_scorer_tensors(all_names)
    fill_scorer_weights(model, saved, describe=describe, hint=hint, exact=exact)
    info = dict(info)
    info["unexpected_keys"] = type(info.get("unexpected_keys", []))(
        key for key in info.get("unexpected_keys", []) if key not in all_names
    )
    if narrow_keys:  # the narrow projections were filled above; any other mismatch stays reported
        info["mismatched_keys"] = type(info.get("mismatched_keys", []))(
            entry for entry in info.get("mismatched_keys", []) if _key_name(entry) not in all_names
        )
    return model, info


def _key_name(entry) -> str:
    """The tensor name of an entry of transformers' ``mismatched_keys`` (a name, or (name, shape, shape))."""
    return entry[0] if isinstance(entry, tuple) else entry


def report_base_loading(info: dict, source: str, missing_hint: str = "", stacklevel: int = 3) -> None:
    """Warn about base weights transformers could not match (scorer weights already taken out of ``info``);
    ``missing_hint`` is added when some are missing. ``stacklevel`` points the warning at the user's call."""
    problems = []
    for label in ("missing", "unexpected", "mismatched"):
        names = sorted(str(name) for name in info.get(f"{label}_keys", ()))
        if names:
            problems.append(f"{label}: {names[:5]}{' ...' if len(names) > 5 else ''}")
    if problems:
        hint = f" {missing_hint}" if info.get("missing_keys") and missing_hint else ""
        warnings.warn(
            f"Loading the base model from {source}: " + "; ".join(problems) + "." + hint,
            UserWarning,
            stacklevel=stacklevel,
        )
