"""Loading patched checkpoints: :func:`from_pretrained` dispatches full checkpoints and adapter-only ones.

Saving a full checkpoint needs nothing of ours: a patched model's ``save_pretrained`` / ``push_to_hub``
writes its safetensors (scorer weights included, under ``...attn_scorer...``) and its config, which carries the
patch record. Loading one, transformers loads the base model (so ``dtype``, ``device_map``, ``revision``,
``token`` ... behave as usual), the recorded patch is applied again, and the scorer weights are read from the
same safetensors files. Adapter-only checkpoints (scorer tensors plus the base model's id) are written and read
by :mod:`hf_neural_attn.adapters`. Both loaders share :mod:`hf_neural_attn.checkpoint_io`.
"""

from __future__ import annotations

import os
from typing import Any

from .adapters import find_adapter_config, load_adapter_model
from .checkpoint_io import (
    FILE_KWARGS,
    load_config,
    load_patched_model,
    model_class_for,
    read_config_record,
    read_tensors,
    report_base_loading,
    scorer_config,
)
from .patched_config import base_config


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
        impl: the compute path to run (``"reference"``, ``"chunked"``, ``"triton"``, ``"auto"``) instead of the
            recorded one. The path is a run-time choice: every path computes the same scores. A recorded
            ``"triton"`` that cannot run here (no CUDA or no triton) loads as ``"auto"``, with a warning.
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
        ValueError: the folder is not a patched checkpoint (no ``hf_neural_attn`` record in its config),
            the record is damaged (the message names the file and field), the scorer weights are missing or do
            not fit, or an adapter does not fit its base model (other family, fewer layers, other shapes, or base
            weights that changed since the adapter was saved).
        OSError: an adapter's base model cannot be loaded (the message says how to point at it).
    """
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
    return _load_full_checkpoint(str(path_or_repo_id), model_class, impl, hf_kwargs)


def _load_full_checkpoint(source: str, model_class, impl: str | None, hf_kwargs: dict[str, Any]):
    output_loading_info = hf_kwargs.get("output_loading_info", False)
    config, loading_kwargs = load_config(source, hf_kwargs)
    record = read_config_record(config, source)
    scorer = scorer_config(record, source, "config.json", impl)
    model_class = model_class_for(config, source, model_class)
    file_kwargs = {key: loading_kwargs[key] for key in FILE_KWARGS if key in loading_kwargs}
    model, info = load_patched_model(
        model_class,
        source,
        base_config(config),  # the record describes a patch still to apply: the base model loads unpatched
        record,
        scorer,
        loading_kwargs,
        lambda names: read_tensors(source, names, file_kwargs),
        describe=f"The checkpoint {source}",
        hint="The checkpoint is incomplete, or its config.json and weights come from different models.",
    )
    architectures = getattr(config, "architectures", None) or [None]
    # Another class than the checkpoint's (a bare LlamaModel from a LlamaForCausalLM checkpoint) leaves the
    # weights of the parts it lacks over, as intended: transformers does not warn about them either.
    report = info if type(model).__name__ == architectures[0] else {**info, "unexpected_keys": []}
    report_base_loading(report, source, stacklevel=4)  # user -> from_pretrained -> _load_full_checkpoint -> here
    return (model, info) if output_loading_info else model
