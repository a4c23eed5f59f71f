"""Composing the patch with PEFT (LoRA and the other PEFT methods that take ``modules_to_save``).

Patch first, then wrap: ``patch_model`` adds an ``attn_scorer`` submodule to each patched attention module, and
PEFT's ``modules_to_save`` trains a full copy of each such module beside the adapters (the original stays
frozen, and is what runs when the adapters are disabled). The patch's forward pre-hook and attention function
look the scorer up as ``module.attn_scorer``; PEFT's ``ModulesToSaveWrapper`` forwards attribute look-ups to
its active copy, so the scorer that runs, and gets the gradients, is the copy PEFT trains and saves.
"""

from __future__ import annotations

from torch import nn

from .record import SCORER_ATTR, is_patched, patched_key_dim


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
        model: the patched transformers model (or a PEFT model wrapping it; the names are then those inside
            its base model, which is what PEFT matches against).

    Raises:
        ValueError: ``model`` is not patched.
    """
    if hasattr(model, "get_base_model"):  # a PeftModel: PEFT matches names inside the wrapped model
        model = model.get_base_model()
    if not is_patched(model):
        raise ValueError(
            "This model is not patched by hf_neural_attn, so it has no scorer modules for PEFT to train. "
            "Call hf_neural_attn.patch_model(model, ...) before peft.get_peft_model."
        )
    if patched_key_dim(model) is not None:
        raise ValueError(
            f"This model was patched with key_dim={patched_key_dim(model)}, a from-scratch option whose new query and "
            "key projections must train in full: train all its parameters rather than adapters."
        )
    suffix = f".{SCORER_ATTR}"
    return [name for name, _ in model.named_modules() if name.endswith(suffix)]
