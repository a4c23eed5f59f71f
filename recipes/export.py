"""The model of a training-state checkpoint as an ordinary checkpoint:

    python -m recipes.export outputs/run/step_500 outputs/run-step500

A recipe's ``step_N`` / ``epoch_N`` folder is what ``accelerator.save_state`` writes to resume training: the weights
in the layout of the run's backend, with the optimizer, scheduler and random states, and no model config. The recipe
saves the model's config and preprocessor beside them (``model_files/``, see :mod:`recipes.checkpointing`). This
builds the model from those, loads the checkpoint's weights into it and saves it with its preprocessor: a folder that
``hf_neural_attn.from_pretrained`` loads patched (a patched run's) and transformers loads as any model (a baseline's).

The weights, by backend: ``model.safetensors`` (one process, or DDP, whose wrapper prefixes ``module.``), DeepSpeed's
partitioned files (gathered by DeepSpeed's own ``zero_to_fp32`` functions, as its ``zero_to_fp32.py`` script beside
them does) and FSDP's full state dict (``pytorch_model_fsdp.bin``). FSDP's sharded state dict is merged first with
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

from recipes.checkpointing import MODEL_FILES, STATE_FILE
from recipes.errors import RecipeError, refuse

DEEPSPEED_TAG_FILE = "latest"  # DeepSpeed's checkpoint: names the subfolder (tag) holding the partitioned states
FSDP_FULL_WEIGHTS = "pytorch_model_fsdp.bin"  # FSDP's FULL_STATE_DICT, as accelerate's save_state writes it
FSDP_SHARDED_WEIGHTS = "pytorch_model_fsdp_0"
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")  # save_state's own, with and without safetensors


def export_checkpoint(checkpoint: str | os.PathLike, target: str | os.PathLike, model_files=None) -> Path:
    """Save the model of ``checkpoint`` (a recipe's ``step_N`` folder) with its preprocessor into ``target`` (a new or
    empty folder). ``model_files``: the folder holding its config.json and preprocessor, ``checkpoint/model_files``
    unless given (checkpoints written before the recipe saved them: the run's ``--output_dir`` once the run has
    finished). Returns ``target``."""
    import torch
    import transformers
    from transformers import AutoConfig

    import hf_neural_attn  # noqa: F401 (AutoConfig reads a patched config.json once it is imported)

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
    state = read_weights(checkpoint)
    config = AutoConfig.from_pretrained(files)
    model_class = getattr(transformers, (config.architectures or [""])[0], None)
    if model_class is None:
        raise RecipeError(f"{files}/config.json names no transformers model class (architectures).")
    with torch.random.fork_rng(devices=[]):
        model = model_class(config)  # a patched config builds the patched model (fresh scorers, loaded next)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in (getattr(model, "all_tied_weights_keys", None) or {})]
    if missing or unexpected:
        raise RecipeError(
            f"The weights of {checkpoint} do not fit the model of {files}/config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}. The model files come from another run."
        )
    shutil.copytree(files, target, dirs_exist_ok=True)  # the preprocessor; the model's own files are rewritten next
    model.save_pretrained(target)
    return target


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
    if state and all(name.startswith("module.") for name in state):  # DDP's wrapper
        state = {name.removeprefix("module."): tensor for name, tensor in state.items()}
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.export",
        description="Save the model of a recipe's training-state checkpoint (step_N, epoch_N) as an ordinary "
        "checkpoint: hf_neural_attn.from_pretrained loads a patched run's, transformers a baseline's.",
    )
    parser.add_argument("checkpoint", help="the checkpoint folder: <output_dir>/step_N or epoch_N")
    parser.add_argument("target", help="a new folder for the model and its preprocessor")
    parser.add_argument(
        "--model_files",
        help="a folder with the run's config.json and tokenizer, for checkpoints that hold none (default: "
        f"<checkpoint>/{MODEL_FILES})",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        target = export_checkpoint(args.checkpoint, args.target, args.model_files)
    except RecipeError as error:
        return refuse("export", error)
    print(f"Saved the model of {args.checkpoint} to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
