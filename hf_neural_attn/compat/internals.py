"""Every private name of another library the library reads or writes, each behind one accessor.

transformers, torch and the others promise nothing about names with a leading underscore, and a release may move
or drop any of them. The library still needs a few (where a config keeps its attention implementation, the flag that
keeps transformers' init off a tensor, the tensor-parallel plan of a model, ...): reading them here, and only here
(``tests/architecture/test_architecture.py`` checks it), makes an upgrade of those libraries a review of this file.
Each accessor says what it stands for, so that its callers read as what they mean.

This module imports nothing of the library, of transformers only what ``import transformers`` has loaded already
(the library's version check imports it), of torch its functional module (transformers imported torch), and of
DeepSpeed only what a caller's process has imported: any floor may use it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------- transformers

# Where a PretrainedConfig keeps the attention implementation it was given (``_attn_implementation`` is the property
# that reads it, falling back to transformers' default). The patched config class defines its own descriptor under
# this name (hf_neural_attn.patched_config), so that setting an implementation on it sets the base one.
IMPLEMENTATION_FIELD = "_attn_implementation_internal"
# The attribute transformers' attention modules read to pick their attention function: a forward that reads it
# dispatches through ALL_ATTENTION_FUNCTIONS (what the generic family checks in a forward's source).
DISPATCH_ATTRIBUTE = "_attn_implementation"


def attn_implementation_of(config: Any) -> str | None:
    """The attention implementation ``config`` dispatches to (``config._attn_implementation``)."""
    return getattr(config, DISPATCH_ATTRIBUTE, None)


def saved_implementation(config: Any) -> str | None:
    """The implementation stored on ``config`` itself (None: none was chosen, transformers' default applies)."""
    return vars(config).get(IMPLEMENTATION_FIELD)


def store_implementation(config: Any, implementation: str | None) -> None:
    """Store ``implementation`` on ``config`` itself, past any descriptor its class defines for the field."""
    vars(config)[IMPLEMENTATION_FIELD] = implementation


def define_implementation_descriptor(config_class: type, descriptor: Any) -> None:
    """Make ``descriptor`` (a property) what ``config_class``'s instances read and write as their implementation."""
    setattr(config_class, IMPLEMENTATION_FIELD, descriptor)


def mark_initialized(parameter: Any) -> None:
    """Flag a tensor as initialised: transformers' ``init_weights`` / ``_init_weights`` then leave it as it is."""
    parameter._is_hf_initialized = True


def tensor_parallel_plan(model: Any) -> dict[str, str]:
    """A copy of ``model``'s tensor-parallel plan (module name pattern -> style), empty when it has none."""
    return dict(getattr(model, "_tp_plan", None) or {})


def set_tensor_parallel_plan(model: Any, plan: dict[str, str]) -> None:
    """Replace ``model``'s tensor-parallel plan, which transformers reads when it shards the model."""
    model._tp_plan = plan


def sharded_by_tensor_parallelism(module: Any) -> bool:
    """Whether transformers' ``apply_tensor_parallelism`` hooked ``module`` (it marks what it shards: ``_is_hooked``)."""
    return bool(getattr(module, "_is_hooked", False))


# Where a PretrainedConfig keeps ``output_attentions`` behind its property (whose setter refuses the flag for an
# implementation that returns no probabilities; the patched config class defines a property of its own over it).
OUTPUT_ATTENTIONS_FIELD = "_output_attentions"


def output_attentions_flag(config: Any) -> bool:
    """The ``output_attentions`` value stored on ``config`` (what transformers' property returns)."""
    return getattr(config, OUTPUT_ATTENTIONS_FIELD)


def store_output_attentions_flag(config: Any, value: bool) -> None:
    """Store ``output_attentions`` on ``config`` without transformers' check of the implementation."""
    setattr(config, OUTPUT_ATTENTIONS_FIELD, value)


# The private keywords transformers' ``PreTrainedModel.from_pretrained`` pops before it reads the rest as config
# overrides (the loaders split a call's keywords as it does: hf_neural_attn.loading.files).
PRIVATE_LOADING_KWARGS = ("_from_pipeline", "_from_auto", "_commit_hash", "_fast_init")


def with_load_report_adjusted(model_class: type, adjust: Callable[[Any, Any], None]) -> type:
    """A subclass of ``model_class`` whose ``from_pretrained`` load report (transformers' log and
    ``output_loading_info``) is then passed to ``adjust(model, loading_info)`` (the ``LoadingInfo`` whose
    ``missing_keys``, ``unexpected_keys`` and ``mismatched_keys`` sets it may edit), after transformers' own
    adjustment (its private ``_adjust_missing_and_unexpected_keys``, called once the weights are loaded)."""

    class AdjustedReport(model_class):
        def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
            super()._adjust_missing_and_unexpected_keys(loading_info)
            adjust(self, loading_info)

    return AdjustedReport


try:  # where transformers 5 collects output_attentions (forward hooks on the attention modules)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # another layout: models then say it through the output_attentions kwarg only
    _active_collector = None


def output_attentions_collector() -> Any:
    """The collector transformers 5 gathers ``output_attentions`` in while a forward runs, or None when none is
    active or this transformers has no such collector. Called on every attention call: a context-variable read."""
    return _active_collector.get() if _active_collector is not None else None


def auto_model_classes(modeling_auto: Any) -> list[type]:
    """The Auto model classes of ``transformers.models.auto.modeling_auto`` that hold a model mapping."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return [
        value
        for value in vars(modeling_auto).values()
        if isinstance(value, type)
        and issubclass(value, _BaseAutoModelClass)
        and getattr(value, "_model_mapping", None) is not None
    ]


def auto_model_mapping(auto_class: type) -> Any:
    """``auto_class``'s mapping of config classes to model classes (``register``-able, lazily filled)."""
    return auto_class._model_mapping


def forget_registered(registry: Any, key: Any) -> None:
    """Take ``key`` out of one of transformers' lazy mappings (Auto classes, ``CONFIG_MAPPING``, tokenizers), where
    ``register`` put it; the mappings have no public way back."""
    registry._extra_content.pop(key, None)


def hub_file_or_none(
    source: str, filename: str, *, raise_connection_errors: bool = True, raise_gated_errors: bool = True, **lookup: Any
) -> str | None:
    """transformers' ``cached_file`` of ``filename`` in ``source`` (a folder or Hub repo; ``lookup``: revision,
    subfolder, token, ...), None where it has no such file. Connection errors and gated repos raise only when asked
    (transformers' private keywords say it)."""
    from transformers.utils import cached_file

    return cached_file(
        source, filename, _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=raise_connection_errors,
        _raise_exceptions_for_gated_repo=raise_gated_errors, **lookup,
    )  # fmt: skip


def with_reversible_conversions_only(model: Any) -> Any:
    """A stand-in for ``model`` in ``revert_weight_conversion``: its config, and only those of the weight converters
    its load attached (``model._weight_conversions``) that have a reverse."""
    reversible = []
    for conversion in getattr(model, "_weight_conversions", None) or []:
        try:
            conversion.reverse_transform()
        except NotImplementedError:
            continue
        reversible.append(conversion)
    return SimpleNamespace(_weight_conversions=reversible, config=model.config)


def pop_adapter_model_path(adapter_kwargs: dict[str, Any]) -> str | None:
    """Take out of ``from_pretrained``'s ``adapter_kwargs`` the PEFT adapter path transformers keeps there under a
    private key (sentence-transformers passes an adapter folder that way)."""
    return adapter_kwargs.pop("_adapter_model_path", None)


def gpt2_reordered_attention(module: Any) -> Callable:
    """GPT-2's attention with its ``reorder_and_upcast_attn`` option (the module's own eager variant)."""
    return module._upcast_and_reordered_attn


def keys_ignored_on_load(model: Any) -> list[str]:
    """The patterns of checkpoint keys ``model`` skips when it loads (``_keys_to_ignore_on_load_unexpected``), empty
    when it has none. vLLM's Transformers backend drops every checkpoint weight one of them matches (``re.search``)."""
    return list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])


# ------------------------------------------------------------------------------------------------------- torch


def remove_forward_pre_hooks(module: Any, is_ours: Callable[[Callable], bool]) -> None:
    """Remove the forward pre-hooks of ``module`` for which ``is_ours(hook)`` holds. torch hands out a handle per hook;
    a model saved and reloaded, deep-copied or pickled has lost the handles, not the hooks, so they are found here."""
    hooks = module._forward_pre_hooks
    for hook_id, hook in list(hooks.items()):
        if is_ours(hook):
            del hooks[hook_id]
            module._forward_pre_hooks_with_kwargs.pop(hook_id, None)


def parameter_slots(module: Any) -> dict[str, Any]:
    """``module``'s own table of parameters by name (torch's ``_parameters``), which its forward reads them from.
    Putting a tensor that is not a ``Parameter`` in a slot (a shard's local view) makes the forward read that tensor;
    ``setattr`` would refuse it."""
    return module._parameters


# Where torch keeps the state of its ``context_parallel`` context manager (experimental, private in torch 2.x).
CONTEXT_PARALLEL_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"


def torch_context_parallel() -> tuple[Any, bool | None] | None:
    """torch's ``context_parallel`` block as it stands now: None when none is open (SDPA is torch's own), else
    ``(mesh, load_balanced)``: the device mesh the sequence is split over (None where this torch keeps it elsewhere)
    and whether the split is the load-balanced (head-tail) one (None where unreadable). Read, never imported: a
    process that never imported it runs no block."""
    state = sys.modules.get(CONTEXT_PARALLEL_MODULE)
    if state is None or F.scaled_dot_product_attention not in getattr(state, "_replaced_functions", {}):
        return None
    # The ring function torch put in SDPA's place closes over the mesh it was given.
    function = F.scaled_dot_product_attention
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=True))
    mesh = cells["device_mesh"].cell_contents if "device_mesh" in cells else None
    options = getattr(state, "_cp_options", None)
    return mesh, None if options is None else bool(options.enable_load_balance)


# ---------------------------------------------------------------------------------------------------- accelerate

# Where accelerate's ``add_hook_to_module`` (cpu_offload, disk_offload, dispatch_model, device_map loading) keeps the
# hook of a module.
ACCELERATE_HOOK_ATTRIBUTE = "_hf_hook"


def accelerate_hook(module: Any) -> Any:
    """The hook accelerate attached to ``module`` (an ``AlignDevicesHook``, a ``SequentialHook`` of them, ...), or
    None."""
    return getattr(module, ACCELERATE_HOOK_ATTRIBUTE, None)


# ----------------------------------------------------------------------------------------------------- DeepSpeed

# Where DeepSpeed's Ulysses keeps its sequence-parallel process group once ``register_with_transformers`` set it up.
ULYSSES_STATE_MODULE = "deepspeed.runtime.sequence_parallel.parallel_state_sp"


def ulysses_sequence_parallel_group() -> Any:
    """The process group DeepSpeed's Ulysses splits sequences over, or None where none is set up (or DeepSpeed was
    never imported)."""
    state = sys.modules.get(ULYSSES_STATE_MODULE)
    return getattr(state, "_SEQUENCE_PARALLEL_GROUP", None)
