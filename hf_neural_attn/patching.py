"""``patch_model`` / ``unpatch_model``: swap the attention scoring of a transformers model in place; ``set_impl``:
choose how the scorers compute it.

How the swap works, using transformers' own extension points rather than copies of model forwards:

* One attention function, registered in ``AttentionInterface`` as ``"hf_neural_attn"``, becomes the
  model's ``attn_implementation``. For a module that carries a scorer it computes attention with that
  scorer; every other module (layers left out by ``layers=``, cross-attention) is sent to the model's
  base implementation (the one it ran before the patch, or the one ``set_attn_implementation`` chose since).
* The same name is registered in ``AttentionMaskInterface`` with a builder that makes the base implementation's
  mask. (An attention name without a registered mask gets *no mask at all* from transformers, which would
  silently make a causal model bidirectional.)
* QANA's extra query rows read the attention module's hidden states, which transformers does not pass
  to attention functions. A forward pre-hook on each patched module computes the query slices (with
  row-wise RoPE) and adds them to the call's kwargs; the model's attention forward passes its kwargs on
  to the attention function, so no state is stashed on modules.
* New parameters live in a submodule ``attn_scorer`` of each patched attention module, so they appear in
  ``state_dict`` / ``named_parameters`` and save with the model.
* The patched model gets its own copy of its config (transformers 5 models share the config object they
  were built from), of a subclass that records the patch in ``config.hf_neural_attn``, takes another
  ``attn_implementation`` as the new base (the scorers keep running), and saves a config.json that transformers' Auto classes load patched once the
  library is imported and refuse to load without it (:mod:`hf_neural_attn.patched_config`).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Mapping
from functools import partial
from typing import Any

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ._version import __version__
from ._warnings import warn_user
from .families import FAMILIES, ModelFamily, find_attention
from .integrations.internals import remove_forward_pre_hooks
from .integrations.parallelism import forget_scorer_plan, shard_scorer, sharded_parameters_local, tensor_parallel_heads
from .model_cards import checkpoint_tags
from .ops.dispatch import check_impl
from .ops.dropout import check_probability
from .patched_config import (
    base_config_as_recorded,
    implementation_under_patch,
    make_patched,
    make_unpatched,
    model_type_under_patch,
)
from .placement.offload import offloaded_weights_loaded
from .placement.quantized import activation_dtype
from .placement.zero3 import (
    partition_like,
    partitioned_weights_gathered,
    register_scorer_parameters,
    unregister_scorer_parameters,
)
from .record import (
    ADDED_MODULE_ATTR,
    EXTRAS_KWARG,
    FALLBACK_ATTR,
    SCORER_ATTR,
    PatchRecord,
    inner_transformers_model,
    is_patched,
    patch_record,
    patched_key_dim,
)
from .scorers import Scorer, ScorerConfig, scorer_class


def patch_model(
    model: PreTrainedModel,
    scorer: str | ScorerConfig,
    *,
    h: int | None = None,
    layers: list[int] | None = None,
    **options: Any,
) -> PreTrainedModel:
    """Replace the attention scoring of ``model`` in place and return it.

    Args:
        model: a transformers model (any head) of a supported family, see ``docs/families.md``, or a
            sentence-transformers ``SentenceTransformer`` (its transformers model is patched in place; the
            ``SentenceTransformer`` is returned).
        scorer: a name from ``hf_neural_attn.scorers.SCORERS`` (``"qana"``, ``"neural"``, ``"additive"``,
            ``"general"``, ``"nsea"``, ``"hea"``), or a ready config object (:class:`QanaConfig`, ...).
        h: hidden width of the scoring MLP (default 4).
        layers: indices of the attention layers to patch (negative indices count from the end);
            None patches all. ``[0]`` is the Neural Attention paper's first-layer-only setup.
        **options: scorer options (``impl`` for all; ``activation``, ``init`` for the MLP scorers; for
            ``"neural"`` ``proj_dim``, ``mode``, ``depth``; ``mode`` for ``"additive"``; ``terms`` and the
            required ``mode="replace"`` for ``"nsea"``/``"hea"``). See ``docs/scorers.md``. ``impl``, how
            attention is computed, is a run-time setting: the record leaves it out, and :func:`set_impl`
            changes it.

    With the default options of ``"qana"``, ``"neural"``, ``"additive"`` and ``"general"`` the patched model's
    outputs equal the original's, and training moves them; ``"nsea"`` and ``"hea"`` are for training from
    scratch.
    Every argument is checked before the model is touched: a call that raises leaves it as it was.

    Raises:
        ValueError: unknown scorer or option, invalid value, layer index out of range, already patched.
        TypeError: ``model`` is not a transformers model with a supported attention family.
    """
    inner = inner_transformers_model(model)
    if inner is not None:  # patched in place: the SentenceTransformer runs, saves and loads it as its own
        patch_model(inner, scorer, h=h, layers=layers, **options)
        return model
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
    config = _scorer_config(scorer, h, options)
    family, attention_modules, config_readers = find_attention(model)
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
    # Build every new module before touching the model, so a failure here changes nothing. Offloaded weights
    # are loaded while their module is read (as accelerate loads them for a call); the scorers are created on the
    # module's execution device and stay there, outside the offloading. Weights DeepSpeed ZeRO-3 partitioned are
    # gathered the same way, and the new modules are partitioned like them once built (see families/zero3.py).
    new_scorers, narrow_projections, resolved, head_shards = {}, {}, {}, {}
    key_dim = getattr(config, "key_dim", None)
    # A quantized base (bitsandbytes, torchao) keeps its projections in packed storage: the scorers are built in the
    # dtype its activations run in (families/quantized.py).
    quantized_dtype = activation_dtype(model)
    if quantized_dtype is not None and key_dim is not None:
        raise ValueError(_KEY_DIM_ON_QUANTIZED.format(key_dim=key_dim))
    for index in selected:
        module = attention_modules[index]
        with offloaded_weights_loaded(module), partitioned_weights_gathered(module.parameters()):
            scorer_type.check_module(config, module)
            geometry = family.geometry(module)
            if quantized_dtype is not None:
                geometry = dataclasses.replace(geometry, dtype=quantized_dtype)
            resolved[index] = config.resolved(geometry)
            new_scorers[index] = scorer_type(resolved[index], geometry)
            if key_dim is not None:
                narrow_projections[index] = family.narrow_key_projections(module, key_dim)
        # Under tensor parallelism the scorer shards with the module's heads, or the patch is refused here.
        head_shards[index] = tensor_parallel_heads(model, module, new_scorers[index])
        partition_like(module, [new_scorers[index], *narrow_projections.get(index, {}).values()])
    # Options the model decides ("auto") are recorded as what was computed, so that a saved record does not depend
    # on the loading version's rule; where the layers differ (SmolLM3's layers without RoPE), "auto" stays.
    if all(options == resolved[selected[0]] for options in resolved.values()):
        config = resolved[selected[0]]

    from_scratch = config.from_scratch_reason()
    if from_scratch:
        warn_user(
            f"{from_scratch}: the patched model's outputs differ from the original's from the start. This option is "
            "for training from scratch (the papers' ablations); leave it out to fine-tune a pretrained model."
        )
    base_implementation = implementation_under_patch(model.config)
    record = PatchRecord(
        scorer=config.scorer_name,
        options=config.to_dict(),
        layers=tuple(selected),
        family=family.name,
        base_attn_implementation=base_implementation,
        base_model_type=model_type_under_patch(model.config),
        version=__version__,
    )
    # From here on the model changes; nothing below can fail on user input.
    _adopt_private_configs(model)
    # The base implementation is read from each module's config at call time (set_attn_implementation changes it);
    # the one at patch time serves modules that hold no config.
    fallback = (family.name, base_implementation)
    for module in config_readers:
        setattr(module, FALLBACK_ATTR, fallback)
    for index, scorer_module in new_scorers.items():
        module = attention_modules[index]
        module.add_module(SCORER_ATTR, scorer_module)
        register_scorer_parameters(model, module, scorer_module)
        if index in narrow_projections:
            family.use_narrow_keys(module, key_dim, narrow_projections[index])
            for projection in narrow_projections[index].values():
                setattr(projection, ADDED_MODULE_ATTR, True)
        if head_shards[index] is not None:
            shard_scorer(model, module, scorer_module, head_shards[index], narrow_projections.get(index, {}))
        if scorer_type.needs_hidden_states:
            module.register_forward_pre_hook(partial(_add_query_extras, family), with_kwargs=True)
    for config_object in _configs(model, config_readers):
        make_patched(config_object)
    record.write_to(model.config)
    # transformers' own card writers (push_to_hub's, the Trainer's) add a model's model_tags to the cards they write.
    model.add_model_tags(checkpoint_tags(record.scorer))
    return model


_KEY_DIM_ON_QUANTIZED = (
    "hf_neural_attn cannot patch a quantized model with key_dim={key_dim}: key_dim replaces the query and key "
    "projections by narrower ones trained from scratch, which a quantized base cannot hold. Leave key_dim out (the "
    "scorers train beside the quantized projections), or build the model in float to train key_dim from scratch. The "
    "model was not changed."
)


def _check_attention_dropout(config: PretrainedConfig, family: ModelFamily) -> None:
    """The config's attention dropout is a probability. The scorers apply it, so a value the unpatched model would
    refuse at its first training step (above 1, negative, NaN) is refused here, before the model changes."""
    value = getattr(config, family.attention_dropout_field, None)
    if value is not None:
        check_probability(value, f"config.{family.attention_dropout_field}")


def unpatch_model(model: PreTrainedModel) -> PreTrainedModel:
    """Remove the patch in place and return the model: original parameter names, shapes and outputs.

    Raises:
        ValueError: if ``model`` is not patched.
    """
    inner = inner_transformers_model(model)
    if inner is not None:
        unpatch_model(inner)
        return model
    if not is_patched(model):
        raise ValueError("This model is not patched by hf_neural_attn; there is nothing to unpatch.")
    key_dim = patched_key_dim(model)
    if key_dim is not None:
        raise ValueError(
            f"This model was patched with key_dim={key_dim}, which replaced its query and key projections by narrower "
            "ones: there is no original model to go back to. Reload the original checkpoint instead."
        )
    _remove_model_tags(model, checkpoint_tags(patch_record(model).scorer))
    config_readers = [module for module in model.modules() if hasattr(module, FALLBACK_ATTR)]
    for module in config_readers:
        if hasattr(module, SCORER_ATTR):
            unregister_scorer_parameters(model, module, getattr(module, SCORER_ATTR))
            delattr(module, SCORER_ATTR)
        _remove_query_extras_hooks(module)
        delattr(module, FALLBACK_ATTR)
    # The configs stay the model's private copies: handing the caller's shared object back is not possible
    # without undoing changes the caller may have made since. Their own implementation shows again.
    forget_scorer_plan(model, SCORER_ATTR)
    for config_object in _configs(model, config_readers):
        make_unpatched(config_object)
    return model


def set_impl(model: PreTrainedModel, impl: str) -> PreTrainedModel:
    """Choose how the scorers of the patched ``model`` compute attention from the next call on, and return it.

    The compute path is a run-time setting, like the ``impl`` of :func:`patch_model` and
    :func:`~hf_neural_attn.from_pretrained`: every path computes the same scores, so nothing is saved of it and the
    outputs stay the same (to float rounding). A torch.compile'd model recompiles once for the new path.

    Args:
        model: a model patched by :func:`patch_model` or loaded patched (or a sentence-transformers
            ``SentenceTransformer`` holding one, or a PEFT model around one: its scorers' copies switch too).
        impl: ``"auto"``, ``"reference"``, ``"chunked"`` or ``"triton"`` (see :mod:`hf_neural_attn.ops.dispatch`).

    Raises:
        ValueError: ``model`` is not patched, ``impl`` is not a compute path (the message lists them) or does not
            apply to its scorer, or ``"triton"`` cannot run on this machine. The model is not changed then.
    """
    inner = inner_transformers_model(model)
    if not is_patched(inner if inner is not None else model):
        raise ValueError(
            "This model is not patched by hf_neural_attn, so it has no scorers to compute with. Patch it with "
            "hf_neural_attn.patch_model(model, scorer, impl=...)."
        )
    # Every scorer module, the copies PEFT wraps (modules_to_save) included, each config checked before any changes.
    scorers = [module for module in model.modules() if isinstance(module, Scorer)]
    configs = [dataclasses.replace(scorer.config, impl=impl) for scorer in scorers]
    check_impl(impl)
    for scorer, config in zip(scorers, configs, strict=True):
        scorer.config = config
    return model


def _remove_model_tags(model: PreTrainedModel, tags: list[str]) -> None:
    """Take the patch's tags out of ``model.model_tags`` again (and the list itself when nothing else is left, so the
    model reads transformers' class default, None, as before the patch)."""
    remaining = [tag for tag in model.model_tags or [] if tag not in tags]
    if remaining:
        model.model_tags = remaining
    elif "model_tags" in vars(model):
        del model.model_tags


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


def patch_as_recorded(model: PreTrainedModel, config: PretrainedConfig) -> PreTrainedModel:
    """Patch ``model``, just built from ``config`` (a patched model's, or a patched checkpoint's) or from a plain copy
    of it, as the record ``config`` carries says: the same scorer, options and layers, with freshly initialised
    scorers, as any model built from a config is freshly initialised. The one rule for a model built from a patched
    config, whichever way it was built: ``AutoModel*.from_config(config)`` (:mod:`hf_neural_attn.integrations.auto_classes`) and
    the model's own class, ``LlamaForCausalLM(config)`` (:mod:`hf_neural_attn.integrations.transformers_loading`).

    A model built from ``config`` itself shares it, and its modules run ``"hf_neural_attn"`` without scorers: it
    gets a plain copy of the config first, on the base implementation ``config`` runs (the record's where it names
    none, as a config read from a checkpoint does), so that the patch records that base and ``config``, with the model
    it came from, stays as it was.

    Raises:
        ValueError: ``config`` carries no record, or one that does not read (:func:`recorded_patch`).
    """
    scorer, layers = recorded_patch(config)  # read first: a record that does not read leaves the model as it was
    if model.config is config:
        _adopt_private_configs(model, unpatched=True)
    return patch_model(model, scorer, layers=layers)


def recorded_patch(config: PretrainedConfig) -> tuple[ScorerConfig, list[int]]:
    """The scorer config and layers of the patch ``config``'s record describes.

    Raises:
        ValueError: ``config`` carries no record, or one that does not read (the record's own message).
    """
    record = PatchRecord.of(config)
    if record is None:
        raise ValueError(
            f"{type(config).__name__} carries no hf_neural_attn record, so there is no patch to apply; build the model "
            "with its plain transformers class."
        )
    return record.scorer_config(), list(record.layers)


def _adopt_private_configs(model: nn.Module, *, unpatched: bool = False) -> None:
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


def _configs(model: nn.Module, attention_modules: list[nn.Module]) -> list:
    """Every config object whose ``_attn_implementation`` the model's attention or masks read."""
    seen: dict[int, Any] = {id(model.config): model.config}
    for module in attention_modules:
        config = getattr(module, "config", None)
        if config is not None:
            seen.setdefault(id(config), config)
    return list(seen.values())


def _add_query_extras(family: ModelFamily, module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a patched module whose scorer reads hidden states: compute its per-query inputs."""
    scorer: Scorer = getattr(module, SCORER_ATTR)
    hidden_states = family.hidden_states(module, args, kwargs)
    # A scorer accelerate offloaded (patched, then dispatched); a scorer sharded by tensor parallelism.
    with offloaded_weights_loaded(scorer), sharded_parameters_local(scorer):
        kwargs[EXTRAS_KWARG] = scorer.query_extras(hidden_states, family.rotary(module, args, kwargs))
    return args, kwargs


def _remove_query_extras_hooks(module: nn.Module) -> None:
    remove_forward_pre_hooks(module, lambda hook: isinstance(hook, partial) and hook.func is _add_query_extras)
