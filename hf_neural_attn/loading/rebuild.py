"""Rebuilding a patched model from a checkpoint: the record read, then load, check, patch, fill, the one sequence
every loader runs (:func:`load_patched_model`).

A full checkpoint (:mod:`.full`) and an adapter-only one (:mod:`.adapters`) differ only in where the base weights,
the config and the scorer tensors come from, and in the words they use when the base model does not fit the
record (:func:`check_base_fits`, the one fit check). The Auto classes' ``from_config`` (:mod:`.auto`) patches a
fresh model the same way, from the record's scorer config (:meth:`~hf_neural_attn.record.PatchRecord.scorer_config`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import narrow_keys
from .._version import __version__
from .._warnings import warn_user
from ..compat.internals import pop_adapter_model_path, saved_implementation, with_load_report_adjusted
from ..families import FAMILIES, find_attention
from ..parallel.tensor import copy_whole_tensor
from ..patch_plan import AttentionSearch, apply_patch, plan_patch
from ..placement.zero3 import full_shape, partitioned_weights_gathered
from ..record import BASE_LOAD_ATTR, PEFT_WRAPPER_PARTS, SCORER_ATTR, PatchRecord, damaged, scorer_parameters
from ..scorers import ScorerConfig
from .files import check_model_class_fits, names_on_disk, unreadable_weights_are_errors


def read_record(data: Any, source: str, filename: str) -> PatchRecord:
    """The checked patch record read from ``source``'s ``filename`` (an adapter's JSON; config.json:
    :func:`read_config_record`), with a warning when a different major version of the library saved it."""
    return _checked(PatchRecord.from_dict(data, source=source, filename=filename), source, filename)


def read_config_record(config, source: str) -> PatchRecord:
    """The checked patch record of a checkpoint's config (``ValueError`` with a hint when it has none), with a
    warning when a different major version of the library saved it."""
    record = PatchRecord.of(config, source=source, filename="config.json")
    if record is None:
        raise ValueError(
            f"{source} is not a hf_neural_attn checkpoint: its config.json has no hf_neural_attn record. "
            "Load it with transformers and call hf_neural_attn.patch_model(model, ...) to patch it."
        )
    return _checked(record, source, "config.json")


def _checked(record: PatchRecord, source: str, filename: str) -> PatchRecord:
    """``record`` once its family is one this version has (the record reads without the families; a loader needs
    one), with a warning when a different major version of the library saved it."""
    if record.family is not None and record.family not in FAMILIES:
        problem = f"names no model family of this version ({sorted(FAMILIES)}), got {record.family!r}"
        raise damaged(source, filename, "family", problem)
    if record.version.split(".")[0] != __version__.split(".")[0]:
        warn_user(f"{source} was saved by hf_neural_attn {record.version}; this is {__version__}.")
    return record


def check_base_fits(attention: AttentionSearch, record: PatchRecord, misfit: Callable[[str, Any], Exception]) -> None:
    """The base model loaded for ``record`` (not yet patched), whose attention search (:func:`find_attention`) is
    ``attention``, is of the recorded family and has the recorded layers: the one fit check of both kinds of
    checkpoint (the scorer tensors' shapes are checked when they are filled, :func:`fill_scorer_weights`).

    ``misfit(field, found)`` is the error the checkpoint's kind raises where the model contradicts the record's
    ``field``: ``"family"`` (``found``: the model's family name) or ``"layers"`` (``found``: how many attention layers
    it has). A full checkpoint builds its own base, so there the record was edited; an adapter was saved from
    another base model.
    """
    family, attention_modules, _ = attention
    if record.family not in (None, family.name):
        raise misfit("family", family.name)
    if record.layers[-1] >= len(attention_modules):
        raise misfit("layers", len(attention_modules))


def fill_scorer_weights(
    model, saved: Mapping[str, torch.Tensor], *, describe: str, hint: str, exact: bool = False
) -> None:
    """Copy the scorer tensors ``saved`` (by their names on disk) into the patched ``model``'s scorers.

    Args:
        saved: on-disk name -> tensor; each scorer parameter is looked up under :func:`names_on_disk`.
        describe: the subject of the error messages ("The checkpoint X", "The adapter X").
        hint: what to check or do, appended to every error.
        exact: every tensor of ``saved`` must find a place (an adapter holds scorer tensors only; a full checkpoint's
            loader reads every scorer tensor of its files, so one the record does not patch is refused).

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
    if any(part in f".{name}" for name in unused for part in PEFT_WRAPPER_PARTS):
        hint = (
            f"{hint} Its scorer tensors carry PEFT's wrapper names: the model was saved while PEFT wrapped its "
            "scorers. Save the PEFT model instead (peft_model.save_pretrained), or merge first (merge_and_unload)."
        )
    if problems:
        raise ValueError(f"{describe} does not fit the recorded patch: " + "; ".join(problems) + f". {hint}")
    mismatched = [
        f"{name}: saved {tuple(tensors[name].shape)}, patch builds {tuple(full_shape(parameter))}"
        for name, parameter in expected.items()
        if tensors[name].shape != full_shape(parameter)
    ]
    if mismatched:
        raise ValueError(
            f"{describe} does not fit the recorded patch: {len(mismatched)} scorer tensor(s) have other shapes, "
            f"e.g. {mismatched[:2]}. {hint}"
        )
    # Under DeepSpeed ZeRO-3 the parameters are gathered for the copy, and rank 0's copy is what they keep; under
    # tensor parallelism each process copies its shard.
    with torch.no_grad(), partitioned_weights_gathered(expected.values(), modifier_rank=0):
        for name, parameter in expected.items():
            copy_whole_tensor(parameter, tensors[name])


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
    misfit: Callable[[str, Any], Exception],
    exact: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """Load the base model, check that it fits the record, patch it as recorded and fill its scorer weights: the one
    sequence both loaders run.

    Args:
        model_class: the transformers class to build; ``weights_source`` holds its base weights.
        config: the unpatched base config (see :func:`hf_neural_attn.patched_config.base_config`).
        record: the checked patch record (its ``layers`` and ``base_attn_implementation`` are used).
        scorer: the scorer config to patch with: ``record.scorer_config(impl)``, which the caller reads before
            anything heavy so that a damaged record fails fast.
        loading_kwargs: transformers' ``from_pretrained`` keywords (``dtype``, ``device_map``, ...).
        read_scorer_tensors: on-disk names wanted -> the tensors found under those names.
        describe, hint, exact: see :func:`fill_scorer_weights`.
        misfit: the checkpoint kind's error for a base model that does not fit the record (:func:`check_base_fits`).

    Returns:
        (the patched model, transformers' loading info with the scorer weights not listed as unexpected).
    """
    check_model_class_fits(model_class, config, describe)
    loading_kwargs = dict(loading_kwargs)
    loading_kwargs.pop("output_loading_info", None)
    # A PEFT adapter to load on top (sentence-transformers passes its path this way): transformers would load it
    # before the patch exists, and drop the scorer copies it holds. It goes on once the model is patched.
    adapter_name = loading_kwargs.pop("adapter_name", "default")
    adapter_kwargs = dict(loading_kwargs.pop("adapter_kwargs", None) or {})
    adapter_path = pop_adapter_model_path(adapter_kwargs)
    # Unpatched layers (and unpatch_model) should run what the saved model ran, unless told otherwise: by the keyword,
    # or by a config= that names one (the Auto classes hand the keyword to AutoConfig, which sets it on the config).
    told = "attn_implementation" in loading_kwargs or saved_implementation(config) is not None
    asked = loading_kwargs.get("attn_implementation", saved_implementation(config))
    if asked is not None and not isinstance(asked, str):  # transformers' own check fails on it with an AttributeError
        raise TypeError(
            f"attn_implementation must name an attention implementation ('eager', 'sdpa', ...), got {asked!r}."
        )
    if record.base_to_run is not None and not told:
        loading_kwargs["attn_implementation"] = record.base_to_run
    width = scorer.narrow_key_dim
    narrow_keys.refuse_offloading(width, loading_kwargs.get("device_map"), loading_kwargs.get("offload_folder"))
    searches: list[AttentionSearch] = []  # the one attention search of the load, made by whoever needs it first
    with unreadable_weights_are_errors(weights_source):
        model, info = _reporting_class(model_class, record, width, searches).from_pretrained(
            weights_source, config=config, output_loading_info=True, **loading_kwargs
        )
    model.__class__ = model_class
    narrow_keys.refuse_offloading(width, getattr(model, "hf_device_map", None), None)
    attention = searches[0] if searches else find_attention(model)
    check_base_fits(attention, record, misfit)
    with torch.random.fork_rng(devices=[]):
        # The fresh init is overwritten below: keep the caller's RNG stream and skip init warnings (the plan's; what
        # applying it says, bitsandbytes' CPU kernel turned off, is said).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            # The model was built from ``config``, the loader's own copy: the patch goes into it.
            plan = plan_patch(model, scorer, layers=list(record.layers), attention=attention, config_is_private=True)
        apply_patch(plan)
    disk_names = names_on_disk(model, scorer_parameters(model))
    all_names = {name for names in disk_names.values() for name in names}
    with unreadable_weights_are_errors(weights_source):
        saved = read_scorer_tensors(all_names)
    fill_scorer_weights(model, saved, describe=describe, hint=hint, exact=exact)
    if adapter_path is not None:
        if "token" in loading_kwargs:
            adapter_kwargs.setdefault("token", loading_kwargs["token"])
        model.load_adapter(adapter_path, adapter_name=adapter_name, adapter_kwargs=adapter_kwargs)
    return model, info


def _reporting_class(model_class, record: PatchRecord, narrow_width: int | None, searches: list[AttentionSearch]):
    """``model_class`` as transformers should load a patched checkpoint's base: the same class, whose load report
    (transformers' own log, and ``output_loading_info``) leaves out what the patch fills afterwards.

    transformers loads the base model unpatched, so its report would list the scorer tensors in the checkpoint as
    unexpected and, under narrow keys (``narrow_width``, :mod:`hf_neural_attn.narrow_keys`), the narrower query and
    key projections of the patched layers as mismatched (the base class builds them full width). Everything else it
    reports as it would for the base model, and a mismatch it would refuse without ``ignore_mismatched_sizes`` it
    still refuses. The model is handed back as an instance of ``model_class`` itself (:func:`load_patched_model`
    resets its class). The attention search made to find the narrowed layers is appended to ``searches``, for the
    patch to reuse.
    """
    scorer_marker = f".{SCORER_ATTR}."

    def leave_out_what_the_patch_fills(model, loading_info) -> None:
        loading_info.unexpected_keys = {key for key in loading_info.unexpected_keys if scorer_marker not in f".{key}"}
        if narrow_width is not None:
            searches.append(find_attention(model))
            narrowed = _patched_attention_prefixes(model, searches[-1], record)
            loading_info.mismatched_keys = {
                entry for entry in loading_info.mismatched_keys if not _key_name(entry).startswith(narrowed)
            }

    PatchedCheckpointBase = with_load_report_adjusted(model_class, leave_out_what_the_patch_fills)
    for name in ("__name__", "__qualname__", "__module__"):  # transformers names the class in its messages
        setattr(PatchedCheckpointBase, name, getattr(model_class, name))
    setattr(PatchedCheckpointBase, BASE_LOAD_ATTR, True)
    return PatchedCheckpointBase


def _patched_attention_prefixes(model, attention: AttentionSearch, record: PatchRecord) -> tuple[str, ...]:
    """``"<module name>."`` of each attention module ``record`` patches in ``model`` (not yet patched), whose
    attention search is ``attention``."""
    _, attention_modules, _ = attention
    patched = {id(attention_modules[index]) for index in record.layers if index < len(attention_modules)}
    return tuple(f"{name}." for name, module in model.named_modules() if id(module) in patched)


def _key_name(entry) -> str:
    """The tensor name of an entry of transformers' ``mismatched_keys`` (a name, or (name, shape, shape))."""
    return entry[0] if isinstance(entry, tuple) else entry


def warn_missing_base_weights(info: Mapping[str, Any], base: str) -> None:
    """After an adapter's base model loaded with weights missing (transformers' load report lists them): say what it
    means for the adapter, which cannot have them."""
    missing = info.get("missing_keys") or ()
    if missing:
        warn_user(
            f"The base model {base} lacks {len(missing)} weight(s) of this model (transformers' load report above "
            "names them): they were initialised at random and are not in the adapter, so outputs differ from the "
            "saved model's. Save the full model (model.save_pretrained) when more than the scorers was trained."
        )
