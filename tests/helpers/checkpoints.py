"""The kinds of patched checkpoint (full, adapter) in CHECKPOINT_KINDS: saving a patched model as either, reading and
editing the patch record where that kind keeps it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

import hf_neural_attn
from hf_neural_attn.loading.adapters import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from hf_neural_attn.record import RECORD_KEY

from .models import perturb_scorers, tiny_model

# --- Checkpoints -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointKind:
    """One kind of patched checkpoint: how a patched model is saved as one and loaded back, and where the files keep
    the patch record and the scorer tensors."""

    save: Callable[[nn.Module, Path], None]  # save(patched model, folder)
    load: Callable[..., nn.Module]  # load(folder, **keywords): the patched model back
    record_file: str  # the JSON file holding the record
    record_field: str  # its field holding the record
    weights_file: str  # the safetensors file holding the scorer tensors
    on_saved_base: bool  # the patched model must come from a base model saved on disk, which the checkpoint names


# A full checkpoint (save_pretrained: the whole model, the patch record in config.json) and an adapter-only one
# (save_adapter: the scorer tensors, the record in the adapter JSON's "patch" field, the base model's id). Tests
# take a kind's name as their parameter (``@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)``).
CHECKPOINT_KINDS: dict[str, CheckpointKind] = {
    "full": CheckpointKind(
        save=lambda model, folder: model.save_pretrained(folder),
        load=hf_neural_attn.from_pretrained,
        record_file="config.json",
        record_field=RECORD_KEY,
        weights_file="model.safetensors",
        on_saved_base=False,
    ),
    "adapter": CheckpointKind(
        save=hf_neural_attn.save_adapter,
        load=hf_neural_attn.from_pretrained,
        record_file=ADAPTER_CONFIG_NAME,
        record_field="patch",
        weights_file=ADAPTER_WEIGHTS_NAME,
        on_saved_base=True,
    ),
}


def save_base(folder: Path, family: str = "llama", **overrides) -> Path:
    """A tiny model of ``family`` (config ``overrides`` applied) saved to ``folder``, as a user's base model sits
    on disk; returns the folder."""
    tiny_model(family, **overrides).save_pretrained(folder)
    return folder


def load_patched(base: Path, family: str = "llama", scorer: str = "qana", **options) -> nn.Module:
    """The base model saved in ``base`` as a user would have it: loaded from its folder, patched with ``scorer`` and
    ``options``, trained (here: its scorers moved off their init)."""
    model = type(tiny_model(family)).from_pretrained(base).eval()
    hf_neural_attn.patch_model(model, scorer, **options)
    perturb_scorers(model)
    return model


def save_checkpoint(
    root: Path, kind: str, family: str = "llama", scorer: str = "qana", **options
) -> tuple[nn.Module, Path]:
    """A tiny model of ``family`` patched with ``scorer`` and ``options``, its scorers moved off their init
    ("trained"), saved as a checkpoint of ``kind`` (a CHECKPOINT_KINDS name) in ``root / kind``. A kind that names
    its base (an adapter) gets it saved to ``root / "base"`` first, and the model loaded from there. Returns the
    patched model and the checkpoint's folder."""
    checkpoint = CHECKPOINT_KINDS[kind]
    if checkpoint.on_saved_base:
        model = load_patched(save_base(root / "base", family), family, scorer, **options)
    else:
        model = tiny_model(family)
        hf_neural_attn.patch_model(model, scorer, **options)
        perturb_scorers(model)
    checkpoint.save(model, root / kind)
    return model, root / kind


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    """Change a JSON file in place: ``edit`` mutates its content."""
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))


def saved_record(folder: Path, kind: str) -> dict:
    """The patch record a ``kind`` checkpoint in ``folder`` saved, as the file holds it."""
    checkpoint = CHECKPOINT_KINDS[kind]
    return json.loads((folder / checkpoint.record_file).read_text())[checkpoint.record_field]


def edit_record(folder: Path, kind: str, edit: Callable[[dict], None]) -> None:
    """Change the patch record of a ``kind`` checkpoint in ``folder`` where that kind keeps it (config.json's
    "hf_neural_attn" field, the adapter JSON's "patch" field): ``edit`` mutates the record."""
    checkpoint = CHECKPOINT_KINDS[kind]
    edit_json(folder / checkpoint.record_file, lambda content: edit(content[checkpoint.record_field]))
