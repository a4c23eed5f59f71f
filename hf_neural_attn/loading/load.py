"""Load, patch, fill: the one sequence every loader runs, and the only loading module that calls ``patch_model``.

A full checkpoint (:mod:`.full`) and an adapter-only one (:mod:`.adapters`) differ only in where the base weights,
the config and the scorer tensors come from; both build their model with :func:`load_patched_model`. The Auto
classes' ``from_config`` (:mod:`.auto`) patches a fresh model with :func:`apply_record`, the same record -> scorer
config step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._version import __version__
from .._warnings import warn_user
from ..families import find_attention
from ..patching import patch_model
from ..record import RECORD_KEY, PatchRecord, scorer_parameters
from ..scorers import ScorerConfig
from .files import names_on_disk, quiet_transformers, unreadable_weights_are_errors


def read_record(data: Any, source: str, filename: str) -> PatchRecord:
    """The checked patch record read from ``source``'s ``filename`` (config.json or an adapter's JSON), with a
    warning when a different major version of the library saved it."""
    record = PatchRecord.from_dict(data, source=source, filename=filename)
    if record.version.split(".")[0] != __version__.split(".")[0]:
        warn_user(f"{source} was saved by hf_neural_attn {record.version}; this is {__version__}.")
    return record


def read_config_record(config, source: str) -> PatchRecord:
    """The checked patch record of a checkpoint's config (``ValueError`` with a hint when it has none)."""
    data = getattr(config, RECORD_KEY, None)
    if data is None:
        raise ValueError(
            f"{source} is not a hf_neural_attn checkpoint: its config.json has no hf_neural_attn record. "
            "Load it with transformers and call hf_neural_attn.patch_model(model, ...) to patch it."
        )
    return read_record(data, source, "config.json")


def apply_record(model, record: PatchRecord, scorer: ScorerConfig):
    """Patch ``model`` (unpatched) as ``record`` says, with ``scorer``, the config ``record.scorer_config(impl)``
    gave (read by the caller before anything heavy, so that a damaged record fails fast). Returns the model."""
    return patch_model(model, scorer, layers=list(record.layers))


def check_model_fits_record(model, record: PatchRecord, describe: str) -> None:
    """The freshly loaded base ``model`` is of the recorded family and has the recorded layers (scorer tensor
    shapes are checked when they are filled). ``describe`` starts the messages (e.g. "The adapter X")."""
    try:
        family, attention_modules, _ = find_attention(model)
    except TypeError as error:
        raise ValueError(f"{describe} cannot apply to the base model: {error}") from error
    if record.family not in (None, family.name):
        raise ValueError(
            f"{describe} was saved from a {record.family!r} model, but the base model is a {family.name!r} "
            "model; check base_model_name_or_path."
        )
    if record.layers[-1] >= len(attention_modules):
        raise ValueError(
            f"{describe} patches attention layers {list(record.layers)}, but the base model has "
            f"{len(attention_modules)}; it was saved from another base model (check base_model_name_or_path)."
        )


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
    record: PatchRecord,
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
        scorer: the scorer config to patch with: ``record.scorer_config(impl)``, which the caller reads before
            anything heavy so that a damaged record fails fast.
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
    if record.base_attn_implementation in ("eager", "sdpa"):
        loading_kwargs.setdefault("attn_implementation", record.base_attn_implementation)
    narrow_keys = record.key_dim is not None
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
        apply_record(model, record, scorer)
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


def report_base_loading(info: dict, source: str, missing_hint: str = "") -> None:
    """Warn about base weights transformers could not match (scorer weights already taken out of ``info``);
    ``missing_hint`` is added when some are missing."""
    problems = []
    for label in ("missing", "unexpected", "mismatched"):
        names = sorted(str(name) for name in info.get(f"{label}_keys", ()))
        if names:
            problems.append(f"{label}: {names[:5]}{' ...' if len(names) > 5 else ''}")
    if problems:
        hint = f" {missing_hint}" if info.get("missing_keys") and missing_hint else ""
        warn_user(f"Loading the base model from {source}: " + "; ".join(problems) + "." + hint)
