"""PEFT adapters (LoRA and the scorers as ``modules_to_save``) saved over a patched checkpoint.

A patched model that was loaded from a patched checkpoint and then given PEFT adapters through transformers'
integration (``model.add_adapter``, or sentence-transformers' ``st.add_adapter``) saves only the adapter:
``adapter_config.json``, whose ``base_model_name_or_path`` is that patched checkpoint, and the adapter weights (the
LoRA matrices and the trained scorer copies). transformers loads such a folder by loading the base and then the
adapter onto it; here the base is loaded patched (its scorers are the modules the adapter's ``modules_to_save``
names), then transformers' ``load_adapter`` does the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..compat.internals import hub_file_or_none
from .files import FILE_KWARGS, is_patched_config_dict, saved_config_dict

PEFT_CONFIG_NAME = "adapter_config.json"  # PEFT's name for its adapter config


def peft_adapter_base(path_or_repo_id: str, hf_kwargs: dict[str, Any]) -> str | None:
    """The base model a PEFT adapter at ``path_or_repo_id`` names, when that folder or repo holds a PEFT adapter
    and no model of its own (no config.json: transformers then loads the named base, and so do we); else None."""
    lookup = {key: hf_kwargs[key] for key in FILE_KWARGS if key in hf_kwargs}
    found = {
        name: hub_file_or_none(path_or_repo_id, name, raise_connection_errors=False, **lookup)
        for name in (PEFT_CONFIG_NAME, "config.json")
    }
    if found[PEFT_CONFIG_NAME] is None or found["config.json"] is not None:
        return None
    with open(found[PEFT_CONFIG_NAME], encoding="utf-8") as handle:
        base = json.load(handle).get("base_model_name_or_path")
    return base if isinstance(base, str) and base else None


def load_peft_adapter_model(
    source: str, base: str, model_class, impl: str | None, hf_kwargs: dict[str, Any], *, load_base: Callable
):
    """Load the patched checkpoint ``base`` with ``load_base`` (``hf_neural_attn.from_pretrained``) and the PEFT
    adapter at ``source`` onto it (see the module doc).

    Raises:
        ValueError: ``base`` is not a patched checkpoint (the adapter's scorers would have nowhere to go).
    """
    hf_kwargs = dict(hf_kwargs)
    output_loading_info = hf_kwargs.pop("output_loading_info", False)
    adapter_name = hf_kwargs.pop("adapter_name", "default")
    adapter_kwargs = dict(hf_kwargs.pop("adapter_kwargs", None) or {})
    for key in ("token", "revision", "subfolder", "cache_dir", "local_files_only"):  # they locate the adapter
        if key in hf_kwargs:
            adapter_kwargs.setdefault(key, hf_kwargs[key])
    base_kwargs = {key: value for key, value in hf_kwargs.items() if key not in ("revision", "subfolder")}
    if not is_patched_config_dict(saved_config_dict(base, base_kwargs, quiet=False)):
        raise ValueError(
            f"{source} is a PEFT adapter whose base model {base!r} is not a patched checkpoint, so hf_neural_attn has "
            "no patch to apply. Load it with transformers (or peft), after patching the base by hand: docs/peft.md."
        )
    model = load_base(base, model_class=model_class, impl=impl, **base_kwargs)
    info = model.load_adapter(source, adapter_name=adapter_name, adapter_kwargs=adapter_kwargs)
    return (model, info.to_dict() if hasattr(info, "to_dict") else info) if output_loading_info else model
