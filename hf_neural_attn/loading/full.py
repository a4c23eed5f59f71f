"""Full checkpoints: what a patched model's ``save_pretrained`` / ``push_to_hub`` writes, loaded back patched.

Saving needs nothing of ours: a patched model's safetensors hold its scorer weights (under ``...attn_scorer...``)
and its config.json the patch record. Loading, transformers loads the base model (so ``dtype``, ``device_map``,
``revision``, ``token`` ... behave as usual), the recorded patch is applied again, and the scorer weights are read
from the same safetensors files (:func:`.rebuild.load_patched_model`).
"""

from __future__ import annotations

from typing import Any

from ..patched_config import base_config
from ..record import SCORER_ATTR, PatchRecord, damaged
from .files import FILE_KWARGS, load_config, model_class_for, read_tensors
from .rebuild import load_patched_model, read_config_record


def load_full_checkpoint(source: str, model_class, impl: str | None, hf_kwargs: dict[str, Any]):
    """The body of :func:`hf_neural_attn.from_pretrained` for a full checkpoint (see its arguments)."""
    output_loading_info = hf_kwargs.get("output_loading_info", False)
    config, loading_kwargs = load_config(source, hf_kwargs)
    record = read_config_record(config, source)
    scorer = record.scorer_config(impl)
    model_class = model_class_for(config, source, model_class)
    file_kwargs = {key: loading_kwargs[key] for key in FILE_KWARGS if key in loading_kwargs}

    def is_scorer_tensor(name: str) -> bool:
        return f".{SCORER_ATTR}." in f".{name}"

    model, info = load_patched_model(
        model_class,
        source,
        base_config(config),  # the record describes a patch still to apply: the base model loads unpatched
        record,
        scorer,
        loading_kwargs,
        # Every scorer tensor of the files, not only those the record asks for: one the record does not patch (a
        # layer left out of an edited record, a stray name) is refused by `exact` rather than dropped.
        lambda names: read_tensors(source, names, file_kwargs, also=is_scorer_tensor),
        describe=f"The checkpoint {source}",
        hint=(
            f"Its config.json's record patches attention layers {list(record.layers)}. The checkpoint is incomplete, "
            "its config.json was edited, or its config.json and weights come from different models."
        ),
        misfit=lambda field, found: _edited_record(record, source, field, found),
        exact=True,
    )
    # transformers has logged its load report for the base model (missing, unexpected, mismatched weights).
    return (model, info) if output_loading_info else model


def _edited_record(record: PatchRecord, source: str, field: str, found) -> ValueError:
    """A full checkpoint's words for a base model that does not fit its record (:func:`.rebuild.check_base_fits`):
    the checkpoint builds its own base from its config.json, so the record there was edited (the error names the
    field)."""
    problems = {
        "family": f"says {record.family!r}, but the model it builds is a {found!r} model",
        "layers": f"names attention layer {record.layers[-1]}, but the model has {found}",
    }
    return damaged(source, "config.json", field, problems[field])
