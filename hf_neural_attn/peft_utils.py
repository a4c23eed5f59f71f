"""Composing the patch with PEFT (LoRA and the other PEFT methods that take ``modules_to_save``).

Patch first, then wrap: ``patch_model`` adds an ``attn_scorer`` submodule to each patched attention module, and
PEFT's ``modules_to_save`` trains a full copy of each such module beside the adapters (the original stays
frozen, and is what runs when the adapters are disabled). The patch's forward pre-hook and attention function
look the scorer up as ``module.attn_scorer``; PEFT's ``ModulesToSaveWrapper`` forwards attribute look-ups to
its active copy, so the scorer that runs, and gets the gradients, is the copy PEFT trains and saves.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from . import narrow_keys
from ._warnings import warn_user
from .record import PATCHED_MODEL_TYPE, SCORER_ATTR, inner_transformers_model, is_patched


def peft_modules_to_save(model: nn.Module) -> list[str]:
    """The names of the patch's scorer modules, for ``LoraConfig(modules_to_save=...)``.

        config = LoraConfig(target_modules=["q_proj", "v_proj"],
                            modules_to_save=hf_neural_attn.peft_modules_to_save(model))
        model = get_peft_model(model, config)

    The names are the full module names in ``model`` (e.g. ``model.layers.0.self_attn.attn_scorer``), one per
    patched layer. PEFT matches ``modules_to_save`` entries as name suffixes; full names match these modules and
    nothing else (a bare ``"attn_scorer"`` would also match any other module whose name ends that way). PEFT
    also keeps its adapters (``target_modules``, even ``"all-linear"``) out of these modules. Add your own
    entries (a new classification head, say) to the list as usual.

    Args:
        model: the patched transformers model, a PEFT model wrapping it, or a sentence-transformers
            ``SentenceTransformer`` holding it. The names are those inside the transformers model, which is what
            PEFT matches against (``st.add_adapter(...)`` hands the config to the transformers model).

    Warns when the model's ``name_or_path`` is a checkpoint on disk that is not patched: an adapter saved from the
    model (PEFT, transformers' or sentence-transformers' ``save``) names that checkpoint as its base, and the
    loaders that rebuild the base from that name load it unpatched and drop the trained scorers. Save the patched
    model and load it back before adding adapters (docs/peft.md).

    Raises:
        ValueError: ``model`` is not patched.
    """
    if hasattr(model, "get_base_model"):  # a PeftModel: PEFT matches names inside the wrapped model
        model = model.get_base_model()
    inner = inner_transformers_model(model)
    if inner is not None:  # a SentenceTransformer: its adapters go to the transformers model it holds
        model = inner
    if not is_patched(model):
        raise ValueError(
            "This model is not patched by hf_neural_attn, so it has no scorer modules for PEFT to train. "
            "Call hf_neural_attn.patch_model(model, ...) before peft.get_peft_model."
        )
    narrow_keys.refuse(model, "train PEFT adapters")
    _warn_if_adapters_would_name_an_unpatched_base(model)
    suffix = f".{SCORER_ATTR}"
    return [name for name, _ in model.named_modules() if name.endswith(suffix)]


def _warn_if_adapters_would_name_an_unpatched_base(model: nn.Module) -> None:
    """See :func:`peft_modules_to_save`. Only a checkpoint readable without a download is looked at."""
    base = getattr(getattr(model, "config", None), "name_or_path", None)
    if not base:
        return
    try:
        saved, _ = PretrainedConfig.get_config_dict(base, local_files_only=True)
    except (OSError, ValueError):
        return
    if saved.get("model_type") != PATCHED_MODEL_TYPE:
        warn_user(
            f"Adapters saved from this model will name {base} as their base model, which is not patched: "
            "loaders that rebuild the base from that name (sentence-transformers, peft.AutoPeftModel*) will load it "
            "without the scorers and drop the trained scorer tensors. Save the patched model first and train the "
            "adapters on the model loaded back from it (model.save_pretrained(dir), or st.save(dir) for "
            "sentence-transformers), or patch the base by hand before loading the adapter (docs/peft.md)."
        )
