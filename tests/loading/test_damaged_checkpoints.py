"""Contract 6, damaged checkpoints: whatever is damaged in a checkpoint of either kind (helpers.checkpoints.CHECKPOINT_KINDS:
full, adapter), loading raises a ``ValueError`` that says what is wrong; a damaged patch record names its file and
field. One table of damages, each run on every kind it applies to."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import CHECKPOINT_KINDS, edit_json, edit_record, save_checkpoint
from safetensors.torch import load_file, save_file

import hf_neural_attn
from hf_neural_attn.loading.adapters import ADAPTER_FORMAT_KEY


@dataclass(frozen=True)
class Damage:
    """One way a checkpoint can be damaged, and the error that loading it must raise."""

    id: str
    apply: Callable[[Path, str], None]  # apply(folder, kind) damages the checkpoint of that kind in folder
    # The regular expression the ValueError's message matches: one for every kind, or one per kind. "{record}"
    # stands for the file holding the record (config.json, or the adapter JSON).
    message: str | dict[str, str]
    kinds: tuple[str, ...] = tuple(CHECKPOINT_KINDS)

    def expected(self, kind: str) -> str:
        message = self.message if isinstance(self.message, str) else self.message[kind]
        return message.replace("{record}", re.escape(CHECKPOINT_KINDS[kind].record_file))


def in_record(edit: Callable[[dict], None]) -> Callable[[Path, str], None]:
    return lambda folder, kind: edit_record(folder, kind, edit)


def in_record_file(edit: Callable[[dict, str], None]) -> Callable[[Path, str], None]:
    """A damage of the JSON file holding the record: ``edit(content, field holding the record)``."""

    def apply(folder: Path, kind: str) -> None:
        checkpoint = CHECKPOINT_KINDS[kind]
        edit_json(folder / checkpoint.record_file, lambda content: edit(content, checkpoint.record_field))

    return apply


def in_weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path, str], None]:
    """A damage of the safetensors file holding the scorer tensors: ``edit`` changes the name -> tensor dict."""

    def apply(folder: Path, kind: str) -> None:
        path = folder / CHECKPOINT_KINDS[kind].weights_file
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path, metadata={"format": "pt"})

    return apply


def drop_first_scorer_tensor(tensors: dict[str, torch.Tensor]) -> None:
    tensors.pop(min(name for name in tensors if ".attn_scorer." in name))


def add_scorer_tensor(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.layers.7.self_attn.attn_scorer.gate"] = torch.zeros(4)  # the tiny Llama has 2 layers


def add_stray_scorer_tensor(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.layers.1.self_attn.attn_scorer.bogus"] = torch.zeros(4)  # a patched layer, a name it lacks


def rename_scorers_as_peft_wraps_them(tensors: dict[str, torch.Tensor]) -> None:
    """The names a model saved while PEFT's ModulesToSaveWrapper held its scorers gives them."""
    for name in [name for name in tensors if ".attn_scorer." in name]:
        head, _, tail = name.partition(".attn_scorer.")
        tensors[f"{head}.attn_scorer.modules_to_save.default.{tail}"] = tensors.pop(name)


def truncate_weights(folder: Path, kind: str) -> None:
    path = folder / CHECKPOINT_KINDS[kind].weights_file
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# A record field holding a value of the wrong type.
BAD_FIELD_VALUES = {
    "options": [1, 2],
    "layers": "all",
    "scorer": 3,
    "version": 1,
    "family": 5,
    "base_attn_implementation": ["sdpa"],
    "format": "two",
}

DAMAGES = [
    # The record itself.
    Damage(
        "record-not-a-mapping",
        in_record_file(lambda content, field: content.update({field: "qana"})),
        # A full checkpoint's config.json cannot even name its model type without the record.
        {"full": r"config.json says model_type 'hf_neural_attn'.*record.*damaged", "adapter": r"{record} is damaged"},
    ),
    Damage(
        "record-missing",
        in_record_file(lambda content, field: content.pop(field)),
        {"full": r"config.json says model_type 'hf_neural_attn'.*record.*damaged", "adapter": r"{record} is damaged"},
    ),
    Damage("field-missing", in_record(lambda record: record.pop("layers")), r"{record} is damaged: field 'layers'"),
    *(
        Damage(
            f"field-{field}",
            in_record(lambda record, f=field, v=value: record.update({f: v})),
            rf"{{record}} is damaged: field '{field}'",
        )
        for field, value in BAD_FIELD_VALUES.items()
    ),
    Damage("unknown-scorer", in_record(lambda record: record.update(scorer="cosine")), r"'cosine'.* does not have"),
    # Options that build other shapes than the saved tensors', an unknown option, bad option values.
    Damage("options-shapes", in_record(lambda record: record["options"].update(h=2)), r"other shapes"),
    Damage(
        "option-unknown",
        in_record(lambda record: record["options"].update(bogus=1)),
        r"{record} is damaged: field 'options'.*bogus",
    ),
    Damage(
        "option-h",
        in_record(lambda record: record["options"].update(h="x")),
        r"{record} is damaged: field 'options'.*h must be a positive integer",
    ),
    # impl, which records no longer hold, is still checked where older ones (format 1: no format number) carry it
    # (then ignored); a record of the current format holding it is damaged.
    Damage(
        "option-impl",
        in_record(lambda record: (record.pop("format"), record["options"].update(impl=7))),
        r"{record} is damaged: field 'options'.*impl",
    ),
    Damage(
        "option-impl-in-format-2",
        in_record(lambda record: record["options"].update(impl="auto")),
        r"{record} is damaged: field 'options'.*run-time options \['impl'\], which records of format 2 leave out",
    ),
    # A record format this version does not know: a newer version wrote it, which is no damage.
    Damage(
        "format-newer",
        in_record(lambda record: record.update(format=99)),
        r"{record} is of format 99, written by a newer version of hf_neural_attn; .* reads record formats 1 to 2",
    ),
    # The JSON around the record.
    Damage("no-class", in_record_file(lambda content, _: content.update(architectures=None)), r"architectures"),
    Damage(
        "unknown-class",
        in_record_file(lambda content, _: content.update(architectures=["NoSuchForCausalLM"])),
        r"NoSuchForCausalLM",
    ),
    Damage(
        "adapter-format",
        in_record_file(lambda content, _: content.update({ADAPTER_FORMAT_KEY: 2})),
        r"format 2",
        kinds=("adapter",),
    ),
    # A full checkpoint's config.json is read by transformers, which raises an OSError for it.
    Damage(
        "not-json",
        lambda folder, kind: (folder / CHECKPOINT_KINDS[kind].record_file).write_text("{not json"),
        r"cannot be read as JSON",
        kinds=("adapter",),
    ),
    # The scorer tensors. Every one in the files must be where the record puts one: a tensor the record does not
    # patch (an edited record, a stray name) would otherwise be dropped and the model differ from the saved one.
    Damage("tensor-missing", in_weights(drop_first_scorer_tensor), r"lacks 1 scorer tensor"),
    Damage(
        "tensor-extra",
        in_weights(add_scorer_tensor),
        r"no place for 1 scorer tensor.*layers\.7\.self_attn\.attn_scorer\.gate",
    ),
    Damage(
        "tensor-stray",
        in_weights(add_stray_scorer_tensor),
        r"no place for 1 scorer tensor.*attn_scorer\.bogus",
    ),
    Damage(
        "record-fewer-layers",
        in_record(lambda record: record.update(layers=[0])),
        r"no place for \d+ scorer tensor.*layers\.1\..*patches attention layers \[0\]",
    ),
    Damage(
        "tensors-under-peft-names",
        in_weights(rename_scorers_as_peft_wraps_them),
        r"lacks \d+ scorer tensor.*modules_to_save.*saved while PEFT wrapped its scorers",
        kinds=("full",),
    ),
    Damage("weights-truncated", truncate_weights, r"truncated or corrupt"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One QANA-patched tiny Llama saved as each kind of checkpoint; each test damages a copy."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: save_checkpoint(root, kind)[1] for kind in CHECKPOINT_KINDS}


@pytest.mark.parametrize(
    "damage, kind",
    [pytest.param(damage, kind, id=f"{damage.id}-{kind}") for damage in DAMAGES for kind in damage.kinds],
)
def test_a_damaged_checkpoint_is_refused_saying_what_is_wrong(saved, tmp_path, damage, kind):
    folder = shutil.copytree(saved[kind], tmp_path / kind)  # an adapter names its base by an absolute path
    damage.apply(folder, kind)
    with pytest.raises(ValueError, match=damage.expected(kind)):
        hf_neural_attn.from_pretrained(folder)
