"""Full training-state checkpoints with Accelerate, written atomically.

A checkpoint ``<output_dir>/step_<N>`` (or ``epoch_<N>``) holds what ``accelerator.save_state`` writes
(model, optimizer, scheduler, RNG states, gradient scaler) plus ``trainer_state.json``: the training
progress and the loss and evaluation history, so a resumed run continues the same curves. Its ``model_files/``
holds the model's config and preprocessor, what ``python -m recipes.export`` rebuilds the model from around the
checkpoint's weights (a training-state folder is not a model checkpoint: ``save_state`` writes the weights in the
backend's own layout, without a config), and its ``README.md`` says so, with how to export and load the model.

Every process writes into a hidden temporary folder ``.<name>.partial``; only when all of them are done
does the main process write ``trainer_state.json`` last and rename the folder to its final name (an atomic
rename on one filesystem). A crash or SIGKILL while saving therefore leaves at most a ``.partial`` folder,
which :func:`find_latest` never picks and the next save removes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import RecipeError

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MODEL_FILES = "model_files"  # the model's config.json and preprocessor, beside the weights save_state writes
CHECKPOINT_PATTERN = re.compile(r"^(step|epoch)_(\d+)$")


@dataclass
class TrainingProgress:
    """Where training is, and what it has logged so far."""

    completed_steps: int = 0  # optimizer steps
    epoch: int = 0  # current epoch (0-based)
    batches_in_epoch: int = 0  # micro-batches of the current epoch already consumed
    micro_steps: int = 0  # micro-batches consumed in total (seeds the per-step randomness)
    train_loss: list[list[float]] = field(default_factory=list)  # [step, mean loss since the last log]
    evaluations: list[dict[str, float]] = field(default_factory=list)  # {"step": ..., metric: value, ...}
    pending_loss: list[float] = field(default_factory=list)  # [sum, micro-batches] of losses not yet logged
    scorer_history: list[dict[str, Any]] = field(default_factory=list)  # {"step": ..., "layers": [...]}, patched runs
    runtime_s: float = 0.0  # training time so far, across resumes
    settings: dict[str, Any] = field(default_factory=dict)  # what must match on resume

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> TrainingProgress:
        return cls(**{key: values[key] for key in cls.__dataclass_fields__ if key in values})


def save_checkpoint(
    accelerator,
    output_dir: str | os.PathLike,
    name: str,
    progress: TrainingProgress,
    write_model_files: Callable[[Path], None] | None = None,
    state_hooks: Sequence[Callable[[list, list[dict[str, Any]], str], None]] = (),
    safe_serialization: bool = True,
) -> Path:
    """Save the full training state as ``output_dir/name``, atomically. Called by every process;
    ``write_model_files(folder)`` (the main process's) writes the model's config and preprocessor into
    :data:`MODEL_FILES` and the checkpoint's README.md beside it. ``state_hooks``: more ``accelerator.save_state``
    pre-hooks, run after :func:`drop_tied_weights` on the state dicts about to be saved
    (``recipes.qlora.set_aside_torchao_weights``); ``safe_serialization=False``: the model's weights in
    ``pytorch_model.bin`` rather than ``model.safetensors``."""
    output_dir = Path(output_dir)
    final = output_dir / name
    partial = output_dir / f".{name}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    hooks = [accelerator.register_save_state_pre_hook(hook) for hook in (drop_tied_weights, *state_hooks)]
    try:
        accelerator.save_state(str(partial), safe_serialization=safe_serialization)
    finally:
        for hook in hooks:
            hook.remove()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if write_model_files is not None:
            write_model_files(partial / MODEL_FILES)
        state_path = partial / STATE_FILE
        with open(state_path, "w") as handle:
            json.dump(progress.to_json(), handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():  # saving the same step again (e.g. after a resume): swap the old one out
            stale = output_dir / f".{name}.stale"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            os.replace(partial, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(partial, final)
        logger.info("Saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


def drop_tied_weights(models: list, weights: list[dict[str, Any]], output_dir: str) -> None:
    """``accelerator.save_state`` hook: leave out of each model's state dict the weights that are tied to another
    one (GPT-2's ``lm_head.weight``, the same tensor as ``transformer.wte.weight``), as ``save_pretrained`` does.
    safetensors cannot store one tensor under two names, so Accelerate would drop the alias itself, warning on every
    save; loading a checkpoint ties the weight again. Only a name that the model declares tied
    (``all_tied_weights_keys``) and that shares its storage with its source is dropped."""
    from accelerate.utils import extract_model_from_parallel

    for model, state in zip(models, weights):
        tied = getattr(extract_model_from_parallel(model), "all_tied_weights_keys", None) or {}
        for target, source in tied.items():
            for key in [key for key in state if key == target or key.endswith(f".{target}")]:
                source_key = key[: len(key) - len(target)] + source  # the same wrapper prefix (DDP's module.)
                tensor, source_tensor = state[key], state.get(source_key)
                if source_tensor is not None and tensor.untyped_storage().data_ptr() == (
                    source_tensor.untyped_storage().data_ptr()
                ):
                    del state[key]


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``output_dir`` as (completed_steps, path), oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        if not (path.is_dir() and CHECKPOINT_PATTERN.match(path.name) and (path / STATE_FILE).is_file()):
            continue
        try:
            steps = int(json.loads((path / STATE_FILE).read_text())["completed_steps"])
        except (ValueError, KeyError, OSError):
            continue
        found.append((steps, path))
    return sorted(found)


def find_latest(output_dir: str | os.PathLike) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1][1] if checkpoints else None


def prune_checkpoints(output_dir: str | os.PathLike, keep: int | None) -> None:
    """Keep only the newest ``keep`` checkpoints (main process only)."""
    if not keep:
        return
    for _, path in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("Removed old checkpoint %s", path)


def read_progress(checkpoint: str | os.PathLike) -> TrainingProgress:
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        raise RecipeError(
            f"{checkpoint} is not a complete checkpoint of this recipe (no {STATE_FILE}); "
            "it may be a half-written one. Use --resume_from_checkpoint latest to pick the newest complete one."
        )
    return TrainingProgress.from_json(json.loads(path.read_text()))


def resolve_resume(value: str | None, output_dir: str) -> Path | None:
    """The checkpoint to resume from: a path, 'latest' (None when there is none yet), or None."""
    if not value:
        return None
    if value == "latest":
        latest = find_latest(output_dir)
        if latest is None:
            logger.info("No checkpoint in %s yet: starting from scratch.", output_dir)
        return latest
    read_progress(value)  # checks it is complete
    return Path(value)


def check_resume_settings(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """A resumed run must train the same way, or it would not continue the same run."""
    different = {key: (saved[key], current.get(key)) for key in saved if saved[key] != current.get(key)}
    if different:
        details = ", ".join(f"{key}: checkpoint {old!r} vs now {new!r}" for key, (old, new) in different.items())
        raise RecipeError(f"The checkpoint was written by a run with different settings ({details}).")
