"""The model of a training-state checkpoint as an ordinary checkpoint:

    python -m recipes.export outputs/run/step_500 outputs/run-step500

A recipe's ``step_N`` / ``epoch_N`` folder is what ``accelerator.save_state`` writes to resume training: the weights
in the layout of the run's backend, with the optimizer, scheduler and random states, and no model config. The recipe
saves the model's config and preprocessor beside them (``model_files/``, see :mod:`recipes.checkpointing`). This
writes the model of the checkpoint as the run writes its final one, with its preprocessor and a README.md saying how
to load it:

* a full checkpoint, the model built from the config with the checkpoint's weights loaded and saved: a folder that
  ``hf_neural_attn.from_pretrained`` loads patched (a patched run's) and transformers loads as any model (a
  baseline's);
* of a run on a quantized base that trained the scorers alone (``--train_only_new_params``), a full checkpoint whose
  base stays quantized: the config with its ``quantization_config`` and the checkpoint's weights in the layout
  ``save_pretrained`` writes (bitsandbytes': as they are, checked by loading the model from them; torchao's: its
  quantized weights and the rest in one file again, in torchao's safetensors layout, checked against the model's
  skeleton);
* of a LoRA run (``--lora_r``), PEFT's adapter: the model's skeleton (meta device) wrapped by PEFT as the run wrapped
  it, from the ``--lora_*`` settings in ``trainer_state.json``, and the adapter's weights taken from the checkpoint.

The weights, by backend: ``model.safetensors`` (one process, or DDP, whose wrapper prefixes ``module.``), DeepSpeed's
partitioned files (gathered by DeepSpeed's own ``zero_to_fp32`` functions, as its ``zero_to_fp32.py`` script beside
them does) and FSDP's full state dict (``pytorch_model_fsdp.bin``); over a torchao base, ``pytorch_model.bin`` and
the torchao weights set aside in ``torchao_weights.safetensors``. FSDP's sharded state dict is merged first with
``accelerate merge-weights``. Weights the checkpoint stores once for two names (GPT-2's LM head, tied to the input
embeddings) are tied again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import hf_neural_attn
from recipes import qlora, quiet, report
from recipes.checkpointing import MODEL_FILES, STATE_FILE, read_progress
from recipes.errors import RecipeError, refuse
from recipes.modeling import model_class_for, patch_record_of
from recipes.report import CARD_FILE
from recipes.tasks import get_task

DEEPSPEED_TAG_FILE = "latest"  # DeepSpeed's checkpoint: names the subfolder (tag) holding the partitioned states
FSDP_FULL_WEIGHTS = "pytorch_model_fsdp.bin"  # FSDP's FULL_STATE_DICT, as accelerate's save_state writes it
FSDP_SHARDED_WEIGHTS = "pytorch_model_fsdp_0"
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")  # save_state's own, with and without safetensors
PEFT_MODEL_CLASS = "PeftModel"  # what LoRA checkpoints' config.json named before the recipe recorded the model's class
PEFT_PREFIX = "base_model.model."  # PEFT's wrapper's prefix of the transformers model's names
MODULES_TO_SAVE = ".modules_to_save."  # PEFT's name of the trained copy of a module in modules_to_save
LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
TORCHAO_METHOD = "torchao"  # a torchao base's quant_method in its config's quantization_config


def export_checkpoint(checkpoint: str | os.PathLike, target: str | os.PathLike, model_files=None) -> Path:
    """Save the model of ``checkpoint`` (a recipe's ``step_N`` folder) with its preprocessor into ``target`` (a new or
    empty folder), as the kind of folder the run's final output is: PEFT's adapter for a LoRA run, a full checkpoint
    (its base weights quantized as the run loaded them, if it did) otherwise. ``model_files``: the folder holding its
    config.json and preprocessor, ``checkpoint/model_files`` unless given (checkpoints written before the recipe saved
    them: the run's ``--output_dir`` once the run has finished). Returns ``target``; a failed export leaves no
    ``target`` behind."""
    import transformers
    from transformers import AutoConfig

    checkpoint, target = Path(checkpoint), Path(target)
    if not (checkpoint / STATE_FILE).is_file():
        raise RecipeError(
            f"{checkpoint} is not a complete checkpoint of a recipe's run (no {STATE_FILE}): pass a step_N or "
            "epoch_N folder of its --output_dir (a hidden .partial one is half-written)."
        )
    files = Path(model_files) if model_files is not None else checkpoint / MODEL_FILES
    if not (files / "config.json").is_file():
        raise RecipeError(
            f"{files} holds no config.json, so the model of {checkpoint} cannot be rebuilt: checkpoints written "
            "before the recipe saved its model files lack them. Pass --model_files with a folder holding the run's "
            "config.json and tokenizer (its --output_dir once the run has finished)."
        )
    if target.exists() and any(target.iterdir()):
        raise RecipeError(f"{target} is not empty; export into a new folder.")
    settings = read_progress(checkpoint).settings
    task = get_task(settings["task"])  # recorded by every run since the recipes began
    state = read_weights(checkpoint)
    config = AutoConfig.from_pretrained(files)
    model_class = _model_class(config, task, files)
    quantization = getattr(config, "quantization_config", None)
    if settings.get("lora_r") is not None:
        write = _write_adapter
    elif quantization is not None:
        # config.json's dict, as AutoConfig reads it
        write = _write_torchao if quantization.get("quant_method") == TORCHAO_METHOD else _write_quantized
    else:
        write = _write_full
    staging = target.parent / f".{target.name}.partial"  # renamed into place once complete
    shutil.rmtree(staging, ignore_errors=True)
    try:
        # The preprocessor alone (--model_files may be a finished run's --output_dir, holding much else).
        getattr(transformers, task.preprocessor_class).from_pretrained(files).save_pretrained(staging)
        misfit = f"The weights of {checkpoint} do not fit the model of {files}/config.json"
        write(staging, model_class, config, settings, state, misfit)
        patch = patch_record_of(config, source=str(files))
        card = report.checkpoint_card(settings, model_class.__name__, patch, checkpoint.name, exported=True)
        (staging / CARD_FILE).write_text(card)
        os.replace(staging, target)  # onto an empty target folder too
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _model_class(config, task, files: Path):
    """The transformers class of the checkpoint's model: its config's, or (LoRA checkpoints written before the recipe
    recorded the class inside PEFT's wrapper, whose config names ``PeftModel``) the run's ``task``'s for its model
    type."""
    import transformers

    name = (config.architectures or [""])[0]
    if name == PEFT_MODEL_CLASS:
        return model_class_for(config, task)
    model_class = getattr(transformers, name, None)
    if model_class is None:
        raise RecipeError(f"{files}/config.json names no transformers model class (architectures: {name!r}).")
    return model_class


def _write_full(folder: Path, model_class, config, settings, state: dict[str, Any], misfit: str) -> None:
    """The model built from ``config``, ``state`` loaded into it, saved with ``save_pretrained``."""
    import torch

    with torch.random.fork_rng(devices=[]):
        model = model_class(config)  # a patched config builds the patched model (fresh scorers, loaded next)
    _check_model_fit(misfit, model, state)
    model.load_state_dict(state, strict=False)
    model.save_pretrained(folder)


def _write_quantized(folder: Path, model_class, config, settings, state: dict[str, Any], misfit: str) -> None:
    """A full checkpoint of a quantized base, as ``save_pretrained`` of the run's model writes it: the config (its
    ``quantization_config`` included) and ``state`` as it is, which holds the quantized weights in the layout
    ``save_pretrained`` writes (bitsandbytes': each 4-bit weight packed, its quantization state beside it). The model
    is loaded from them first, which checks that they fit; transformers cannot save a model loaded pre-quantized
    itself (its bitsandbytes loading step has no reverse)."""
    import torch
    from safetensors.torch import save_file

    with torch.device("meta"):  # no weights, no memory
        expected = dict(model_class(config).named_parameters())
    # transformers refuses a float tensor of another shape (an embedding, a norm) with a message that names none ("look
    # at the above report", which it does not print): named here first. Quantized storage has shapes of its own.
    float_shapes = [
        name
        for name, tensor in state.items()
        if name in expected and tensor.is_floating_point() and tensor.shape != expected[name].shape
    ]
    _check_fit(misfit, missing=[], unexpected=[], other_shapes=float_shapes)
    try:
        model, info = model_class.from_pretrained(None, config=config, state_dict=dict(state), output_loading_info=True)
    except RuntimeError as error:  # anything else transformers refuses
        raise RecipeError(f"{misfit}: {str(error).splitlines()[0]}") from None
    # bitsandbytes' loader takes a 4-bit weight of another shape without a word (its packed storage has a shape of
    # its own; full_shape reads the weight's from its quant_state): compared here.
    other_shapes = [
        name
        for name, parameter in model.named_parameters()
        if name in expected and hf_neural_attn.full_shape(parameter) != expected[name].shape
    ]
    _check_fit(misfit, sorted(info["missing_keys"]), sorted(info["unexpected_keys"]), other_shapes)
    _save_configs(folder, model_class, config)
    save_file(state, folder / WEIGHTS_FILES[0], metadata={"format": "pt"})


def _write_torchao(folder: Path, model_class, config, settings, state: dict[str, Any], misfit: str) -> None:
    """A full checkpoint of a torchao-quantized base, as ``save_pretrained`` of the run's model writes it: the config
    (its ``quantization_config`` included) and ``model.safetensors`` in torchao's safetensors layout, which
    transformers' torchao loader reads: ``state`` (its quantized weights the tensor subclasses of
    ``qlora.read_torchao_weights``) flattened by torchao, each quantized weight as its plain tensors
    (``<module>._weight_qdata``, ...) with what rebuilds it in the file's metadata, in the model's order.

    The weights are checked against the model's skeleton (meta device), not by loading them: transformers' torchao
    loader takes a quantized weight of another shape without a word. Not loaded and saved with ``save_pretrained``
    either: transformers cannot save a model torchao loaded pre-quantized (a ``NotImplementedError`` from its weight
    converter)."""
    import torch
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    with torch.device("meta"):  # no weights, no memory
        skeleton = model_class(config)
    _check_model_fit(misfit, skeleton, state)
    # As save_pretrained writes it: the model's whole state dict flattened in its order, the weights tied to another
    # (left out of the checkpoint) named in the metadata, their tensors left out of the file.
    tied = getattr(skeleton, "all_tied_weights_keys", None) or {}
    whole = {name: state.get(name, state.get(tied.get(name, ""))) for name in skeleton.state_dict()}
    tensors, metadata = flatten_tensor_state_dict(
        {name: tensor for name, tensor in whole.items() if tensor is not None}
    )
    tensors = {name: tensor for name, tensor in tensors.items() if name not in tied}
    _save_configs(folder, model_class, config)
    save_file(tensors, folder / WEIGHTS_FILES[0], metadata={**metadata, "format": "pt"})


def _save_configs(folder: Path, model_class, config) -> None:
    """The model's config and, for a model that generates, its generation config, as ``save_pretrained`` writes them."""
    config.save_pretrained(folder)
    if model_class.can_generate():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(folder)


def _write_adapter(folder: Path, model_class, config, settings, state: dict[str, Any], misfit: str) -> None:
    """PEFT's adapter of a LoRA run, as the run saves it: the model's skeleton (on the meta device: no weights, no
    memory) wrapped by PEFT as the run wrapped it (``recipes.qlora.add_lora``, from the run's ``--lora_*`` settings
    and the modules the checkpoint holds trained in full), saved by PEFT from ``state``."""
    import torch
    from peft import get_peft_model_state_dict

    with torch.device("meta"):
        skeleton = model_class(config)
    skeleton.name_or_path = settings.get("model")  # PEFT records it as the adapter's base model
    flags = argparse.Namespace(**{flag: settings.get(flag) for flag in LORA_FLAGS})
    in_full = {name.removeprefix(PEFT_PREFIX).split(MODULES_TO_SAVE)[0] for name in state if MODULES_TO_SAVE in name}
    model = qlora.wrap_with_lora(skeleton, flags, in_full)
    expected = get_peft_model_state_dict(model, save_embedding_layers=False)
    found = get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False)
    _check_fit(
        misfit,
        missing=[name for name in expected if name not in found],
        unexpected=[name for name in found if name not in expected],
        other_shapes=[name for name in expected if name in found and found[name].shape != expected[name].shape],
    )
    model.save_pretrained(folder, state_dict=state)


def _check_model_fit(misfit: str, model, state: dict[str, Any]) -> None:
    """Refuse ``state`` unless it holds ``model``'s tensors by name and shape (those tied to another may be left out,
    as the checkpoint leaves them out)."""
    expected = model.state_dict()
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    _check_fit(
        misfit,
        missing=[name for name in expected if name not in state and name not in tied],
        unexpected=[name for name in state if name not in expected],
        other_shapes=[
            name for name, tensor in state.items() if name in expected and tensor.shape != expected[name].shape
        ],
    )


def _check_fit(misfit: str, missing: list[str], unexpected: list[str], other_shapes: list[str]) -> None:
    """Refuse weights that do not fit the model (``misfit`` says which of which), naming a few of each kind."""
    if missing or unexpected or other_shapes:
        found = ", ".join(
            f"{kind} {names[:3]}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
            for kind, names in (("missing", missing), ("unexpected", unexpected), ("of other shapes", other_shapes))
            if names
        )
        raise RecipeError(f"{misfit}: {found}. The model files are of another run: pass --model_files this run's.")


def read_weights(checkpoint: Path) -> dict[str, Any]:
    """The model's weights in ``checkpoint``, by the model's own parameter names, whatever backend wrote them."""
    import torch

    if (checkpoint / DEEPSPEED_TAG_FILE).is_file():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint)))
    if (checkpoint / FSDP_SHARDED_WEIGHTS).is_dir():
        raise RecipeError(
            f"{checkpoint} holds FSDP's sharded state dict: merge it first, `accelerate merge-weights "
            f"{checkpoint / FSDP_SHARDED_WEIGHTS} <folder>`, and load that folder's model.safetensors into the model."
        )
    if (checkpoint / FSDP_FULL_WEIGHTS).is_file():
        return torch.load(checkpoint / FSDP_FULL_WEIGHTS, map_location="cpu", weights_only=True)
    weights = next((checkpoint / name for name in WEIGHTS_FILES if (checkpoint / name).is_file()), None)
    if weights is None:
        raise RecipeError(f"{checkpoint} holds no model weights that this command reads ({', '.join(WEIGHTS_FILES)}).")
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(weights)
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    state.update(qlora.read_torchao_weights(checkpoint))  # set aside from the rest (qlora.set_aside_torchao_weights)
    if state and all(name.startswith("module.") for name in state):  # DDP's wrapper
        state = {name.removeprefix("module."): tensor for name, tensor in state.items()}
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.export",
        description="Save the model of a recipe's training-state checkpoint (step_N, epoch_N) as the run saves its "
        "final one: a checkpoint hf_neural_attn.from_pretrained loads (a patched run's; transformers loads a "
        "baseline's), PEFT's adapter for a LoRA run. Its README.md says how to load it.",
    )
    parser.add_argument("checkpoint", help="the checkpoint folder: <output_dir>/step_N or epoch_N")
    parser.add_argument("target", help="a new folder for the model and its preprocessor")
    parser.add_argument(
        "--model_files",
        help="a folder with the run's config.json and tokenizer, for checkpoints that hold none (default: "
        f"<checkpoint>/{MODEL_FILES})",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    quiet.import_quietly()  # loading the checkpoint imports transformers' model code, and with it torchao
    try:
        target = export_checkpoint(args.checkpoint, args.target, args.model_files)
    except RecipeError as error:
        return refuse("export", error)
    print(f"Saved the model of {args.checkpoint} to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
