"""The model cards (README.md) the library writes, and the Hub metadata at their top.

What the Hub shows of a repo comes from its card's YAML: ``library_name`` picks the "Use this model" snippet and the
library filter, ``tags`` the tag filters, ``base_model`` the model tree, ``pipeline_tag`` the task. The rule here is
the one remote-code and PEFT checkpoints follow: ``library_name`` names what loads the folder.

* A **full patched checkpoint** (``save_pretrained`` / ``push_to_hub`` of a patched model) is a transformers folder:
  transformers' Auto classes load it, with the library imported or with ``trust_remote_code=True`` (the loader file
  listed in ``auto_map`` imports the library). So ``library_name: transformers``, and the tags ``hf-neural-attn``,
  the scorer's name and ``custom_code`` (the Hub then shows transformers' snippet with ``trust_remote_code=True``).
* A **scorer-only adapter** (``save_adapter`` / ``push_adapter_to_hub``) loads only through
  ``hf_neural_attn.from_pretrained``: ``library_name: hf-neural-attn``, ``base_model`` with
  ``base_model_relation: adapter``.

The library's name on the Hub is the PyPI distribution's, ``hf-neural-attn``. Every card also names its
``base_model`` where it is a Hub id, its ``pipeline_tag`` (from the model class) and shows a snippet that imports
the library.

transformers writes cards of its own: ``model.push_to_hub`` (and ``save_pretrained(push_to_hub=True)``) save the
card :func:`transformers.utils.hub.create_and_tag_model_card` returns, which is the repo's card when it has one and
otherwise a generic template. :mod:`hf_neural_attn.integrations.transformers_hub` wraps that function (the one place
the library changes how transformers writes cards) so that for a patched checkpoint the template gives way to the card this module writes;
a card already on the repo is kept and only tagged, as transformers does. ``patch_model`` adds the tags to the
model's ``model_tags``, which transformers' card writers (that one, the Trainer's) add to the cards they write.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .record import PatchRecord

LIBRARY_NAME = "hf-neural-attn"  # on the Hub: the PyPI distribution's name (the import name is hf_neural_attn)
CUSTOM_CODE_TAG = "custom_code"  # the Hub's tag for a checkpoint whose auto_map names code files
CARD_NAME = "README.md"
FOLDER_PLACEHOLDER = "path/to/this/folder"  # the loading snippet's source in a card written to a local folder

# (pipeline tag, transformers' mapping of model types to the classes of that task, the Auto class for the snippet),
# most specific first: the bare models (MODEL_MAPPING_NAMES) serve feature extraction.
_TASKS = (
    ("text-generation", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    ("text-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification"),
    ("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "AutoModelForTokenClassification"),
    ("question-answering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "AutoModelForQuestionAnswering"),
    ("fill-mask", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    ("feature-extraction", "MODEL_MAPPING_NAMES", "AutoModel"),
)


def checkpoint_tags(scorer: str) -> list[str]:
    """The tags of a full patched checkpoint (and of a patched model's ``model_tags``)."""
    return [LIBRARY_NAME, scorer, CUSTOM_CODE_TAG]


def pipeline_task(architecture: str | None) -> tuple[str | None, str | None]:
    """``(pipeline tag, Auto class name)`` of a transformers model class name, or ``(None, None)`` if none fits."""
    from transformers.models.auto import modeling_auto

    for task, mapping_name, auto_class in _TASKS:
        for names in getattr(modeling_auto, mapping_name).values():
            if architecture in ((names,) if isinstance(names, str) else names):
                return task, auto_class
    return None, None


def hub_base_model(name_or_path: str | os.PathLike | None, repo_id: str | None = None) -> str | None:
    """``name_or_path`` when it reads as a Hub repo id (not a local folder, not the repo itself), else None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    name = str(name_or_path or "")
    if not name or name == repo_id or os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def full_checkpoint_card(
    record: PatchRecord,
    architecture: str | None,
    *,
    base_model: str | None,
    repo_id: str | None,
    extra_tags: Iterable[str] = (),
) -> str:
    """The card of a full patched checkpoint of ``architecture``; ``repo_id`` None for a local folder."""
    from huggingface_hub import ModelCardData

    pipeline_tag, auto_class = pipeline_task(architecture)
    tags = list(dict.fromkeys([*checkpoint_tags(record.scorer), *extra_tags]))
    card_data = ModelCardData(library_name="transformers", base_model=base_model, pipeline_tag=pipeline_tag, tags=tags)
    where = repo_id or FOLDER_PLACEHOLDER
    model = f"`{architecture}`" if architecture else "model"
    origin = f" of `{base_model}`" if base_model else ""
    snippet = ["import hf_neural_attn"]
    if auto_class:
        snippet.append(f"from transformers import {auto_class}")
    snippet += [
        "",
        f'model = hf_neural_attn.from_pretrained("{where}")  # the patched model, its scorer weights loaded',
    ]
    if auto_class:
        snippet += [
            "# or, with hf_neural_attn imported, transformers' own Auto class:",
            f'model = {auto_class}.from_pretrained("{where}")',
        ]
    return _card(
        card_data,
        f"""# `{record.scorer}` attention scorer on a {model}{origin}

A full checkpoint of `hf_neural_attn`: a {model}{origin} whose attention layers {list(record.layers)} score with the
`{record.scorer}` scorer (options `{json.dumps(dict(record.options))}`), with its trained scorer parameters. Its
`config.json` records the patch.""",
        "\n".join(snippet) + "\n",
        "Without the library, transformers does not load this checkpoint: it asks for `trust_remote_code=True`, and "
        "with it runs the checkpoint's `hf_neural_attn_loader.py`, which needs `hf_neural_attn` installed.",
    )


def adapter_card(metadata: Mapping[str, Any], repo_id: str | None) -> str:
    """The card of a scorer-only adapter (``metadata``: what its ``hf_neural_attn_adapter.json`` holds)."""
    from huggingface_hub import ModelCardData

    base, record = metadata["base_model_name_or_path"], PatchRecord.from_dict(metadata["patch"])
    architecture = metadata["architectures"][0]
    card_data = ModelCardData(
        library_name=LIBRARY_NAME,  # only hf_neural_attn.from_pretrained loads an adapter
        tags=[LIBRARY_NAME, record.scorer],
        pipeline_tag=pipeline_task(architecture)[0],
    )
    if hub_base_model(base, repo_id):
        card_data.base_model = base  # the Hub links the adapter to its base model
        card_data.base_model_relation = "adapter"  # ... as an adapter, not a fine-tune of it
    revision = f" at revision `{metadata['base_model_revision']}`" if metadata.get("base_model_revision") else ""
    return _card(
        card_data,
        f"""# hf_neural_attn adapter: `{record.scorer}` on `{base}`

An adapter-only checkpoint of `hf_neural_attn`: the {metadata["num_parameters"]:,} parameters
of the `{record.scorer}` attention scorer (options `{json.dumps(dict(record.options))}`) on attention layers
{list(record.layers)} of `{base}`{revision} ({architecture}). It holds no base-model weights.""",
        f"""import hf_neural_attn

# loads the base model, patches it, loads these tensors:
model = hf_neural_attn.from_pretrained("{repo_id or FOLDER_PLACEHOLDER}")
""",
    )


def _card(card_data, description: str, snippet: str, note: str = "") -> str:
    from huggingface_hub import ModelCard

    content = f"""---
{card_data.to_yaml()}
---

{description}

## How to load

```bash
pip install {LIBRARY_NAME}
```

```python
{snippet}```
"""
    if note:
        content += f"\n{note}\n"
    return str(ModelCard(content))  # through ModelCard: the metadata is checked as the Hub checks it


def write_full_checkpoint_card(config, save_directory: str | os.PathLike) -> None:
    """Write a patched config's checkpoint card into ``save_directory`` unless the folder has a card already."""
    path = Path(save_directory) / CARD_NAME
    if path.exists():
        return
    record = PatchRecord.of(config)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    base_model = hub_base_model(getattr(config, "name_or_path", None))
    path.write_text(full_checkpoint_card(record, architecture, base_model=base_model, repo_id=None), encoding="utf-8")


def card_of_pushed_folder(folder: Path, repo_id: str, extra_tags: Iterable[str]) -> str | None:
    """The card for ``repo_id`` of the patched checkpoint saved in ``folder``, or None when it holds none. Its base
    model is the one the card :func:`write_full_checkpoint_card` left there names (config.json does not keep it)."""
    from huggingface_hub import ModelCard

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    record = PatchRecord.of(config, source=str(folder), filename="config.json") if isinstance(config, dict) else None
    if record is None:
        return None
    base_model = None
    if (folder / CARD_NAME).exists():
        written = ModelCard.load(folder / CARD_NAME).data
        if LIBRARY_NAME in (written.tags or []):
            base_model = hub_base_model(written.base_model, repo_id)
    architecture = (config.get("architectures") or [None])[0]
    return full_checkpoint_card(record, architecture, base_model=base_model, repo_id=repo_id, extra_tags=extra_tags)
