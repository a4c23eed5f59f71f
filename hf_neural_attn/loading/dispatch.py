"""``hf_neural_attn.from_pretrained``: one entry point for every kind of patched checkpoint, dispatched to its loader.

A folder or Hub repo holding ``hf_neural_attn_adapter.json`` is an adapter-only checkpoint (:mod:`.adapters`); one
holding a PEFT adapter (``adapter_config.json``, no config.json) over a patched checkpoint is loaded as transformers
loads PEFT adapters, on the patched base (:mod:`.peft_adapters`); anything else is read as a full checkpoint
(:mod:`.full`).
"""

from __future__ import annotations

import os
from typing import Any

from ..ops.dispatch import check_impl
from .adapters import find_adapter_config, load_adapter_model
from .files import check_model_class, check_not_training_state, check_source
from .full import load_full_checkpoint
from .peft_adapters import load_peft_adapter_model, peft_adapter_base


def from_pretrained(
    path_or_repo_id: str | os.PathLike,
    *,
    model_class=None,
    base_model_name_or_path: str | os.PathLike | None = None,
    base_model_revision: str | None = None,
    impl: str | None = None,
    **hf_kwargs: Any,
):
    """Load a patched checkpoint: a full one (a patched model's ``save_pretrained`` / ``push_to_hub``) or an
    adapter-only one (:func:`save_adapter` / :func:`push_adapter_to_hub`).

    Args:
        path_or_repo_id: a local folder or a Hub repo id. One holding ``hf_neural_attn_adapter.json`` is an
            adapter-only checkpoint; anything else is read as a full checkpoint.
        model_class: the transformers model class to build (e.g. ``LlamaModel`` for the bare model of a
            ``LlamaForCausalLM`` checkpoint). Default: the recorded one (``config.architectures[0]``, or the
            adapter's).
        base_model_name_or_path: adapters only: load the base model from here instead of the recorded id
            (e.g. the recorded local folder is on another machine). Its revision is then
            ``base_model_revision``, not the recorded one.
        base_model_revision: adapters only: the base model's revision, instead of the recorded one.
        impl: how the loaded model computes attention (``"auto"``, the default, ``"reference"``, ``"chunked"``,
            ``"triton"``), as in :func:`patch_model`. A run-time setting, which checkpoints do not save (every path
            computes the same scores); an ``impl`` that older checkpoints recorded is ignored.
        **hf_kwargs: what transformers' ``from_pretrained`` takes: loading keywords (``dtype``, ``device_map``,
            ``revision``, ``token``, ``local_files_only``, ``ignore_mismatched_sizes``, ``output_loading_info``,
            ...) and config overrides (``num_labels=5``, ``output_hidden_states=True``: keywords that are config
            attributes, applied when no ``config=`` is passed, as transformers does). For an adapter,
            ``revision`` and ``subfolder`` locate the adapter; the other keywords go to the base model
            (``token``, ``cache_dir``, ``local_files_only``, ... to both lookups).

    Returns:
        The model, patched as it was when saved, with its saved scorer weights: its outputs equal the saved
        model's. With ``output_loading_info=True``, ``(model, loading_info)`` as transformers returns them (the
        scorer weights are not listed as unexpected).

    Raises:
        ValueError: ``impl`` is not a compute path or is ``"triton"`` where Triton cannot run (checked before
            any weight loads), the folder is a training state (Accelerate's ``save_state``: the message says how
            to make a checkpoint of it), the folder is not a patched checkpoint (no ``hf_neural_attn`` record in
            its config), the record is damaged (the message names the file and field), the scorer weights are
            missing or do not fit, or an adapter does not fit its base model (other family, fewer layers, other
            shapes, or base weights that changed since the adapter was saved).
        OSError: an adapter's base model cannot be loaded (the message says how to point at it).
    """
    check_model_class(model_class)
    check_source(path_or_repo_id)
    check_not_training_state(path_or_repo_id)
    if impl is not None:
        check_impl(impl)
    adapter_config_file = find_adapter_config(path_or_repo_id, hf_kwargs)
    if adapter_config_file is not None:
        return load_adapter_model(
            path_or_repo_id,
            adapter_config_file,
            model_class=model_class,
            base_model_name_or_path=base_model_name_or_path,
            base_model_revision=base_model_revision,
            impl=impl,
            hf_kwargs=hf_kwargs,
        )
    if base_model_name_or_path is not None or base_model_revision is not None:
        raise ValueError(
            f"{path_or_repo_id} is not an adapter-only checkpoint (it has no hf_neural_attn_adapter.json), so "
            "base_model_name_or_path / base_model_revision do not apply: a full checkpoint holds its base weights."
        )
    peft_base = peft_adapter_base(str(path_or_repo_id), hf_kwargs)
    if peft_base is not None:
        return load_peft_adapter_model(
            str(path_or_repo_id), peft_base, model_class, impl, hf_kwargs, load_base=from_pretrained
        )
    return load_full_checkpoint(str(path_or_repo_id), model_class, impl, hf_kwargs)
