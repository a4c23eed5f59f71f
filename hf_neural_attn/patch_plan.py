"""A patch as a plan, then its application: what :func:`~hf_neural_attn.patching.patch_model` and the loaders run.

:func:`plan_patch` does every check and builds every new module (the scorers, narrow query and key projections,
the scorers' tensor-parallel head shards, the record) without touching the model: a call that raises leaves the
model as it was. The :class:`PatchPlan` it returns is frozen; :func:`apply_patch` puts it into the model, and cannot
fail on user input. The plan carries the attention search it was made from (:func:`~hf_neural_attn.families.
find_attention`): a loader that searched the model before patching it (to check it fits a checkpoint's record)
hands its search in, so that a load searches once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from . import narrow_keys, placements
from ._version import __version__
from ._warnings import warn_user
from .families import FAMILIES, ModelFamily, find_attention
from .model_cards import checkpoint_tags
from .ops.dispatch import check_impl
from .ops.dropout import check_probability
from .patched_config import base_config_as_recorded, implementation_under_patch, make_patched, model_type_under_patch
from .record import (
    ADDED_MODULE_ATTR,
    EXTRAS_KWARG,
    FALLBACK_ATTR,
    SCORER_ATTR,
    PatchRecord,
    is_patched,
    patch_record,
)
from .scorers import Scorer, ScorerConfig, scorer_class

# What find_attention returns: the family, its patchable attention modules in layer order, and every module that
# reads the model's attention implementation.
AttentionSearch = tuple[ModelFamily, list[nn.Module], list[nn.Module]]


@dataclass(frozen=True)
class PatchPlan:
    """Everything a patch changes in ``model``, built and checked, nothing of it applied yet.

    Attributes:
        model: the transformers model to patch.
        family: its model family.
        attention_modules: its patchable attention modules, in layer order (the search the plan was made from).
        config_readers: every attention module that reads the model's attention implementation.
        record: the patch record the model's config will carry.
        scorers: layer index -> the new scorer module of that layer's attention module.
        narrow_projections: layer index -> the narrow query and key projections by attribute name (empty without
            narrow keys, :mod:`hf_neural_attn.narrow_keys`).
        narrow_width: the narrow keys' width, or None.
        placement_plans: layer index -> what each way of holding weights planned for that layer, by its name
            (:mod:`hf_neural_attn.placements`: how the scorer shards with the heads under tensor parallelism, ...).
        needs_hidden_states: whether the scorers read the attention modules' hidden states (a forward pre-hook).
        config_is_private: the model's config is already its own (a loader built the model from a copy): applying
            the plan patches it in place instead of copying it first.
    """

    # The modules are left out of the repr, which names the patch (its record) rather than print the model.
    model: PreTrainedModel = field(repr=False)
    family: ModelFamily
    attention_modules: tuple[nn.Module, ...] = field(repr=False)
    config_readers: tuple[nn.Module, ...] = field(repr=False)
    record: PatchRecord
    scorers: Mapping[int, Scorer] = field(repr=False)
    narrow_projections: Mapping[int, Mapping[str, nn.Module]] = field(repr=False)
    narrow_width: int | None
    placement_plans: Mapping[int, Mapping[str, Any]] = field(repr=False)
    needs_hidden_states: bool
    config_is_private: bool = False


def plan_patch(
    model: PreTrainedModel,
    scorer: str | ScorerConfig,
    *,
    h: int | None = None,
    layers: Any = None,
    options: Mapping[str, Any] | None = None,
    attention: AttentionSearch | None = None,
    config_is_private: bool = False,
) -> PatchPlan:
    """The plan of patching ``model`` with ``scorer`` (``h``, ``layers`` and the scorer ``options`` as
    :func:`~hf_neural_attn.patching.patch_model` takes them), every check done and every new module built; ``model``
    is not changed. ``attention``: :func:`find_attention`'s answer for ``model``, where the caller already searched.

    Raises:
        ValueError, TypeError: as :func:`~hf_neural_attn.patching.patch_model` says.
    """
    _check_patchable(model)
    config = _scorer_config(scorer, h, dict(options or {}))
    family, attention_modules, config_readers = attention if attention is not None else find_attention(model)
    selected = _normalise_layers(layers, len(attention_modules))
    _check_attention_dropout(model.config, family)
    scorer_type = scorer_class(config.scorer_name)
    if getattr(config, "init", None) == "zero":
        warn_user(
            "init='zero' is the papers' literal init: the model stays exact, but no gradient ever reaches the "
            "new parameters, so it cannot leave plain attention. Use init='default' to train."
        )
    # impl="triton" where Triton cannot run fails here, not at the first forward. Only the machine is checked:
    # models are often patched on the CPU and moved to the GPU afterwards.
    check_impl(getattr(config, "impl", "reference"))
    narrow_keys.check_base(model, config)
    dtype = placements.scorer_dtype(model)
    built = {
        index: _build_layer(model, family, attention_modules[index], scorer_type, config, dtype) for index in selected
    }
    # Options the model decides ("auto") are recorded as what was computed, so that a saved record does not depend
    # on the loading version's rule; where the layers differ (SmolLM3's layers without RoPE), "auto" stays.
    resolved = [layer.config for layer in built.values()]
    if all(layer_config == resolved[0] for layer_config in resolved):
        config = resolved[0]
    from_scratch = config.from_scratch_reason()
    if from_scratch:
        warn_user(
            f"{from_scratch}: the patched model's outputs differ from the original's from the start. This option is "
            "for training from scratch (the papers' ablations); leave it out to fine-tune a pretrained model."
        )
    return PatchPlan(
        model=model,
        family=family,
        attention_modules=tuple(attention_modules),
        config_readers=tuple(config_readers),
        record=PatchRecord(
            scorer=config.scorer_name,
            options=config.to_dict(),
            layers=tuple(selected),
            family=family.name,
            base_attn_implementation=implementation_under_patch(model.config),
            base_model_type=model_type_under_patch(model.config),
            version=__version__,
        ),
        scorers={index: layer.scorer for index, layer in built.items()},
        narrow_projections={index: layer.narrow_projections for index, layer in built.items()},
        narrow_width=config.narrow_key_dim,
        placement_plans={index: layer.placement_plan for index, layer in built.items()},
        needs_hidden_states=scorer_type.needs_hidden_states,
        config_is_private=config_is_private,
    )


def _check_patchable(model: PreTrainedModel) -> None:
    """``model`` is a transformers model and not patched yet."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"patch_model expects a transformers PreTrainedModel, got {type(model).__name__}. "
            f"Supported families: {sorted(FAMILIES)}."
        )
    if is_patched(model):
        record = patch_record(model)
        raise ValueError(
            f"This model is already patched with scorer {record.scorer!r} on layers {list(record.layers)}. "
            "Call hf_neural_attn.unpatch_model(model) first to patch it differently."
        )


class _LayerPatch(NamedTuple):
    """What the patch of one attention module is made of, built without changing the module."""

    config: ScorerConfig  # the scorer config resolved for the module
    scorer: Scorer
    narrow_projections: dict[str, nn.Module]  # empty without narrow keys
    placement_plan: Mapping[str, Any]  # what each placement planned for the module (placements.plan_layer)


def _build_layer(
    model, family: ModelFamily, module: nn.Module, scorer_type: type[Scorer], config: ScorerConfig, dtype
) -> _LayerPatch:
    """The patch of attention ``module``, built without changing it.

    The module's weights are read however they are held (offloaded weights loaded as accelerate loads them for a
    call, ZeRO-3 partitions gathered); the scorer is created on the module's execution device. ``dtype``: the one a
    placement decides for the scorers (a quantized base's activations'; None: the weights' own). Then every
    placement checks and prepares the new modules (tensor parallelism's head shards, ZeRO-3's partitioning):
    :mod:`hf_neural_attn.placements`.
    """
    projections = {}
    with placements.weights_readable(module):
        scorer_type.check_module(config, module)
        geometry = family.geometry(module)
        if dtype is not None:
            geometry = dataclasses.replace(geometry, dtype=dtype)
        resolved = config.resolved(geometry)
        scorer = scorer_type(resolved, geometry)
        if config.narrow_key_dim is not None:
            projections = narrow_keys.narrow_key_projections(family, module, config.narrow_key_dim)
    planned = placements.plan_layer(model, module, scorer, projections.values())
    return _LayerPatch(resolved, scorer, projections, planned)


def apply_patch(plan: PatchPlan) -> PreTrainedModel:
    """Put ``plan`` into its model (every check was done when it was made: nothing here fails on user input) and
    return the model."""
    model = plan.model
    if not plan.config_is_private:
        adopt_private_configs(model)
    # The base implementation is read from each module's config at call time (set_attn_implementation changes it);
    # the one at patch time serves modules that hold no config.
    fallback = (plan.family.name, plan.record.base_attn_implementation)
    for module in plan.config_readers:
        setattr(module, FALLBACK_ATTR, fallback)
    for index, scorer_module in plan.scorers.items():
        module = plan.attention_modules[index]
        module.add_module(SCORER_ATTR, scorer_module)
        projections = plan.narrow_projections[index]
        if projections:
            narrow_keys.use_narrow_keys(module, plan.narrow_width, dict(projections))
            for projection in projections.values():
                setattr(projection, ADDED_MODULE_ATTR, True)
        placements.apply_layer(model, module, scorer_module, dict(projections), plan.placement_plans[index])
        if plan.needs_hidden_states:
            module.register_forward_pre_hook(partial(add_query_extras, plan.family), with_kwargs=True)
    for config_object in configs_read_by(model, plan.config_readers):
        make_patched(config_object)
    plan.record.write_to(model.config)
    # transformers' own card writers (push_to_hub's, the Trainer's) add a model's model_tags to the cards they write.
    model.add_model_tags(checkpoint_tags(plan.record.scorer))
    placements.apply_model(model)  # last: a placement may warn about the patched model (placement/quantized.py)
    return model


def _check_attention_dropout(config: PretrainedConfig, family: ModelFamily) -> None:
    """The config's attention dropout is a probability. The scorers apply it, so a value the unpatched model would
    refuse at its first training step (above 1, negative, NaN) is refused here, before the model changes."""
    value = getattr(config, family.attention_dropout_field, None)
    if value is not None:
        check_probability(value, f"config.{family.attention_dropout_field}")


def _scorer_config(scorer: str | ScorerConfig, h: int | None, options: dict[str, Any]) -> ScorerConfig:
    if isinstance(scorer, ScorerConfig):
        if h is not None or options:
            raise ValueError(
                "Pass either a scorer config object or a scorer name with options, not both "
                f"(got a {type(scorer).__name__} and h={h!r}, options {sorted(options)})."
            )
        scorer.validate()
        # A private copy: the patched modules and the record must not change if the caller's object does.
        return copy.deepcopy(scorer)
    if not isinstance(scorer, str):
        raise TypeError(f"scorer must be a scorer name or config object, got {type(scorer).__name__}.")
    config_class = scorer_class(scorer).config_class
    if h is not None:
        options = {"h": h, **options}
    return config_class.from_options(options)


def _normalise_layers(layers, num_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, Mapping):  # iterating would read its keys and drop its values in silence
        raise ValueError(
            f"layers must be None (every layer), a layer index or a list of layer indices; got {layers!r}."
        )
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__") or getattr(layers, "ndim", None) == 0:
        layers = [layers]
    selected = []
    for index in layers:
        try:
            if isinstance(index, bool):
                raise TypeError
            index = operator.index(index)  # Python, numpy and 0-d tensor integers
        except TypeError:
            raise ValueError(
                f"layers must be None (every layer), a layer index or a list of layer indices; got {index!r}."
            ) from None
        if not -num_layers <= index < num_layers:
            raise ValueError(
                f"Layer index {index} is out of range: this model has {num_layers} attention layers "
                f"(valid indices 0..{num_layers - 1}, or negative from the end)."
            )
        selected.append(index % num_layers)
    if not selected:
        raise ValueError("layers is empty; pass None to patch every layer or a list of layer indices.")
    return sorted(set(selected))


def adopt_private_configs(model: nn.Module, *, unpatched: bool = False) -> None:
    """Give ``model`` its own deep copy of its config (and of every sub-config its modules hold); ``unpatched``: the
    top config as the unpatched model's, on the base its record names
    (:func:`~hf_neural_attn.patched_config.base_config_as_recorded`).

    In transformers 5 a model keeps the config object it was built from, and models built from one object share
    it. Patching writes into the config, so without a copy it would patch (and break) every sibling model.
    """
    memo: dict[int, Any] = {}
    model.config = base_config_as_recorded(model.config, memo) if unpatched else copy.deepcopy(model.config, memo)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig) and id(value) in memo:
                setattr(module, name, memo[id(value)])


@contextlib.contextmanager
def configs_restored_on_error(model: nn.Module):
    """Put back the config objects ``model`` and its modules hold if the block raises: a patch that fails while
    planning, after :func:`adopt_private_configs` gave the model copies, leaves the model on the configs it had."""
    held = [
        (module, name, value)
        for module in model.modules()
        for name, value in vars(module).items()
        if isinstance(value, PretrainedConfig)
    ]
    try:
        yield
    except BaseException:
        for module, name, value in held:
            setattr(module, name, value)
        raise


def configs_read_by(model: nn.Module, attention_modules) -> list:
    """Every config object whose ``_attn_implementation`` the model's attention or masks read."""
    seen: dict[int, Any] = {id(model.config): model.config}
    for module in attention_modules:
        config = getattr(module, "config", None)
        if config is not None:
            seen.setdefault(id(config), config)
    return list(seen.values())


def add_query_extras(family: ModelFamily, module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a patched module whose scorer reads hidden states: compute its per-query inputs."""
    scorer: Scorer = getattr(module, SCORER_ATTR)
    hidden_states = family.hidden_states(module, args, kwargs)
    with placements.scorer_in_place(scorer):
        kwargs[EXTRAS_KWARG] = scorer.query_extras(hidden_states, family.rotary(module, args, kwargs))
    return args, kwargs
