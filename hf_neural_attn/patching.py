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

import dataclasses
from functools import partial
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from . import narrow_keys, placements
from .compat.internals import remove_forward_pre_hooks
from .model_cards import checkpoint_tags
from .ops.dispatch import check_impl
from .patch_plan import (
    add_query_extras,
    adopt_private_configs,
    apply_patch,
    configs_read_by,
    configs_restored_on_error,
    plan_patch,
)
from .patched_config import make_unpatched
from .record import FALLBACK_ATTR, SCORER_ATTR, PatchRecord, inner_transformers_model, is_patched, patch_record
from .scorers import Scorer, ScorerConfig


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
    Every argument is checked before the model is touched (:func:`~hf_neural_attn.patch_plan.plan_patch` builds
    the whole patch first): a call that raises leaves it as it was.

    Raises:
        ValueError: unknown scorer or option, invalid value, layer index out of range, already patched.
        TypeError: ``model`` is not a transformers model with a supported attention family.
    """
    inner = inner_transformers_model(model)
    if inner is not None:  # patched in place: the SentenceTransformer runs, saves and loads it as its own
        patch_model(inner, scorer, h=h, layers=layers, **options)
        return model
    plan = plan_patch(model, scorer, h=h, layers=layers, options=options)
    return apply_patch(plan)


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
    narrow_keys.refuse(model, "unpatch")
    _remove_model_tags(model, checkpoint_tags(patch_record(model).scorer))
    config_readers = [module for module in model.modules() if hasattr(module, FALLBACK_ATTR)]
    for module in config_readers:
        if hasattr(module, SCORER_ATTR):
            placements.remove_layer(model, module, getattr(module, SCORER_ATTR))
            delattr(module, SCORER_ATTR)
        _remove_query_extras_hooks(module)
        delattr(module, FALLBACK_ATTR)
    # The configs stay the model's private copies: handing the caller's shared object back is not possible
    # without undoing changes the caller may have made since. Their own implementation shows again.
    for config_object in configs_read_by(model, config_readers):
        make_unpatched(config_object)
    placements.remove_model(model)
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


def patch_as_recorded(
    model: PreTrainedModel, config: PretrainedConfig, *, config_is_private: bool = False
) -> PreTrainedModel:
    """Patch ``model``, just built from ``config`` (a patched model's, or a patched checkpoint's) or from a plain copy
    of it, as the record ``config`` carries says: the same scorer, options and layers, with freshly initialised
    scorers, as any model built from a config is freshly initialised. The one rule for a model built from a patched
    config, whichever way it was built: ``AutoModel*.from_config(config)`` (:mod:`hf_neural_attn.integrations.auto_classes`) and
    the model's own class, ``LlamaForCausalLM(config)`` (:mod:`hf_neural_attn.integrations.transformers_loading`).

    A model built from ``config`` itself shares it, and its modules run ``"hf_neural_attn"`` without scorers: it
    gets a plain copy of the config first, on the base implementation ``config`` runs (the record's where it names
    none, as a config read from a checkpoint does), so that the patch records that base and ``config``, with the model
    it came from, stays as it was. ``config_is_private``: ``model`` was built from a plain copy made for it alone (the
    Auto classes' ``from_config``), which the patch then goes into rather than into another copy.

    Raises:
        ValueError: ``config`` carries no record, or one that does not read (:func:`recorded_patch`).
    """
    scorer, layers = recorded_patch(config)  # read first: a record that does not read leaves the model as it was
    with configs_restored_on_error(model):  # a plan that fails leaves the model on the configs it had
        if model.config is config:
            adopt_private_configs(model, unpatched=True)
            config_is_private = True  # the copy just made is the model's own: the patch goes into it
        plan = plan_patch(model, scorer, layers=layers, config_is_private=config_is_private)
    return apply_patch(plan)


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


def _remove_query_extras_hooks(module) -> None:
    remove_forward_pre_hooks(module, lambda hook: isinstance(hook, partial) and hook.func is add_query_extras)
