"""Adapter-only checkpoints: the patch's own parameters plus a pointer to the base model.

A full checkpoint (``model.save_pretrained``) repeats every base weight. When the base weights did not change
(only the scorer was trained), :func:`save_adapter` writes just

* ``hf_neural_attn_adapter.safetensors``: the scorer tensors (``...attn_scorer...``), under the names a full
  checkpoint's safetensors would give them;
* ``hf_neural_attn_adapter.json``: the base model's id (Hub repo id or local folder) and revision, the model
  class, and the patch record (scorer, options, layers, family, original attention implementation);
* ``README.md``: a short model card (only when the folder has none).

:func:`hf_neural_attn.from_pretrained` recognises such a folder or Hub repo by its JSON file: it loads the base
model with transformers, re-applies the recorded patch and fills in the tensors. :func:`push_adapter_to_hub`
uploads the same files to a Hub repo.

The file names differ from PEFT's (``adapter_config.json``, ``adapter_model.safetensors``) on purpose:
transformers and PEFT treat a folder with those names as a PEFT adapter and would misread ours.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import cached_file

from .. import narrow_keys
from .._version import __version__
from .._warnings import warn_user
from ..compat.internals import hub_file_or_none
from ..model_cards import CARD_NAME, adapter_card
from ..parallel.tensor import one_writer, whole_tensor
from ..patched_config import base_config
from ..placement.zero3 import partitioned_weights_gathered
from ..record import (
    PatchRecord,
    inner_transformers_model,
    is_patched,
    patch_record,
    scorer_parameters,
)
from .checksums import base_checksum_names, base_checksums, changed_base_tensors, loaded_parameter
from .files import FILE_KWARGS, load_config, names_on_disk, read_tensors, unreadable_weights_are_errors
from .rebuild import load_patched_model, read_record, warn_missing_base_weights

ADAPTER_CONFIG_NAME = "hf_neural_attn_adapter.json"
ADAPTER_WEIGHTS_NAME = "hf_neural_attn_adapter.safetensors"
ADAPTER_FORMAT_KEY = "hf_neural_attn_adapter"  # its value is the format version
ADAPTER_FORMAT_VERSION = 1

# hf_kwargs that locate the adapter itself; every other keyword goes to the base model's from_pretrained
# (the file-locating ones among them, such as token and cache_dir, to both).
_ADAPTER_ONLY_KWARGS = ("revision", "subfolder")


def save_adapter(
    model: PreTrainedModel,
    save_directory: str | os.PathLike,
    *,
    base_model_name_or_path: str | os.PathLike | None = None,
    base_model_revision: str | None = None,
) -> None:
    """Write an adapter-only checkpoint of a patched model: its scorer tensors and the patch record.

    Args:
        model: a model patched by :func:`patch_model` whose base weights are those of the base model
            (for example trained with only :func:`scorer_parameters` unfrozen), or a sentence-transformers
            ``SentenceTransformer`` holding one (the adapter is that of its transformers model, and loads back as
            that model).
        save_directory: the folder to write (created if needed). It must not hold a full checkpoint.
        base_model_name_or_path: the Hub repo id or local folder of the unpatched base weights. Default: the
            name or path the model was loaded from (``model.config.name_or_path``); a local folder is
            recorded as an absolute path.
        base_model_revision: the base model's revision (branch, tag or commit) to load it at. transformers
            does not record the revision a model was loaded at, so it is recorded only when given here.

    Under tensor parallelism or DeepSpeed ZeRO-3 every process calls it, as every process calls ``save_pretrained``:
    the sharded or partitioned tensors it saves and checks are gathered (collectively), and process 0 writes.

    Raises:
        TypeError: ``model`` is a PEFT model or not a transformers model.
        ValueError: ``model`` is not patched, its base model is unknown, or ``save_directory`` holds a full
            checkpoint. Nothing is written then.
    """
    folder = Path(save_directory)
    metadata, tensors = _adapter_contents(model, base_model_name_or_path, base_model_revision)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"save_directory {str(folder)!r} is a file; pass a folder.")
    if (folder / "config.json").exists():
        raise ValueError(
            f"{str(folder)!r} holds a full model checkpoint (config.json); hf_neural_attn.from_pretrained would no "
            "longer know which of the two to load. Save the adapter to a folder of its own."
        )
    # Under tensor parallelism and ZeRO-3 every process has gathered the tensors, and one writes them.
    with one_writer(scorer_parameters(inner_transformers_model(model) or model).values()) as writes:
        if writes:
            _write_adapter(folder, metadata, tensors)


def _write_adapter(folder: Path, metadata: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write an adapter's files (checked by :func:`_adapter_contents`) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    card = None if (folder / CARD_NAME).exists() else adapter_card(metadata, repo_id=None)
    # Each file is written beside its final name and renamed into place, so a failed write leaves no half file.
    _write_atomically(folder / ADAPTER_WEIGHTS_NAME, lambda path: save_file(tensors, path, metadata={"format": "pt"}))
    _write_atomically(folder / ADAPTER_CONFIG_NAME, lambda path: Path(path).write_text(json.dumps(metadata, indent=2)))
    if card is not None:
        _write_atomically(folder / CARD_NAME, lambda path: Path(path).write_text(card))


def push_adapter_to_hub(
    model: PreTrainedModel,
    repo_id: str,
    *,
    base_model_name_or_path: str | os.PathLike | None = None,
    base_model_revision: str | None = None,
    token: str | bool | None = None,
    private: bool | None = None,
    commit_message: str = "Upload hf_neural_attn adapter",
    revision: str | None = None,
):
    """Upload an adapter-only checkpoint of ``model`` (what :func:`save_adapter` writes) to a Hub model repo.

    The repo is created if it does not exist. ``token``, ``private``, ``commit_message`` and ``revision`` (the
    branch to commit to) mean what they mean in ``huggingface_hub.HfApi``. Everything is checked and written
    to a temporary folder before the Hub is contacted. Warns when the recorded base model is a local folder,
    which nobody else can load.

    Returns:
        the ``CommitInfo`` of the upload.
    """
    from huggingface_hub import HfApi

    with tempfile.TemporaryDirectory() as folder:
        save_adapter(
            model, folder, base_model_name_or_path=base_model_name_or_path, base_model_revision=base_model_revision
        )
        metadata = json.loads((Path(folder) / ADAPTER_CONFIG_NAME).read_text())
        base = metadata["base_model_name_or_path"]
        if os.path.isabs(base):
            warn_user(
                f"The adapter pushed to {repo_id} records its base model as the local folder {base!r}, which "
                "only this machine can load. Pass base_model_name_or_path='<hub repo id>' to record the base "
                "model's Hub id (others can also override it at load time)."
            )
        # The card in the repo shows the repo's own id in its loading example.
        (Path(folder) / CARD_NAME).write_text(adapter_card(metadata, repo_id=repo_id))
        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            repo_type="model",
            commit_message=commit_message,
            revision=revision,
        )


def find_adapter_config(path_or_repo_id: str | os.PathLike, hf_kwargs: dict[str, Any]) -> str | None:
    """The local path of ``path_or_repo_id``'s adapter JSON (downloaded if it is on the Hub), or None when it
    has none or it cannot be looked up; the caller then treats ``path_or_repo_id`` as a full checkpoint, whose
    loading reports an unreachable or unknown repo in transformers' own words."""
    lookup = {key: hf_kwargs[key] for key in FILE_KWARGS if key in hf_kwargs}
    try:
        return hub_file_or_none(
            path_or_repo_id, ADAPTER_CONFIG_NAME, raise_connection_errors=False, raise_gated_errors=False, **lookup
        )
    except OSError:
        return None


def load_adapter_model(
    path_or_repo_id: str | os.PathLike,
    adapter_config_file: str,
    *,
    model_class=None,
    base_model_name_or_path: str | os.PathLike | None,
    base_model_revision: str | None,
    impl: str | None = None,
    hf_kwargs: dict[str, Any],
):
    """The body of :func:`hf_neural_attn.from_pretrained` for an adapter folder or repo (see its arguments)."""
    source = str(path_or_repo_id)
    metadata = _read_adapter_config(adapter_config_file, source)
    record: PatchRecord = metadata["patch"]
    scorer = record.scorer_config(impl)
    base, revision = _adapter_base(source, metadata, base_model_name_or_path, base_model_revision)
    model_class = _adapter_model_class(source, metadata, model_class)

    adapter_lookup = {key: hf_kwargs[key] for key in FILE_KWARGS if key in hf_kwargs}
    # Read the tensors before loading the base model, so a broken adapter fails fast.
    weights_file = cached_file(path_or_repo_id, ADAPTER_WEIGHTS_NAME, **adapter_lookup)
    with unreadable_weights_are_errors(source), safe_open(weights_file, framework="pt") as weights:
        saved = {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118 (safe_open is not a dict)

    base_kwargs = {key: value for key, value in hf_kwargs.items() if key not in _ADAPTER_ONLY_KWARGS}
    if revision is not None:
        base_kwargs["revision"] = revision
    describe = f"The adapter {source}"

    with _base_model_errors(source, base, revision):
        if os.path.isabs(base) and not os.path.isdir(base):
            raise FileNotFoundError("that folder does not exist on this machine.")
        config, loading_kwargs = load_config(base, base_kwargs)
        # The base may itself be a patched full checkpoint, to load unpatched: its record describes another patch.
        config = base_config(config)
        # Checked before the model is built: the adapter's class on another model type's config would build a
        # model of that class's default size (billions of parameters for LlamaForCausalLM).
        if metadata.get("model_type") not in (None, config.model_type):
            raise ValueError(
                f"The adapter {source} was saved from a {metadata['model_type']!r} model "
                f"({metadata['architectures'][0]}), but the base model {base!r} is a {config.model_type!r} model; "
                "check base_model_name_or_path."
            )
        model, info = load_patched_model(
            model_class,
            base,
            config,
            record,
            scorer,
            loading_kwargs,
            lambda names: saved,
            describe=describe,
            hint=f"Its record patches attention layers {list(record.layers)}. The adapter was saved from another base "
            "model (another size, heads or layers), its record was edited, or it is incomplete; check "
            "base_model_name_or_path.",
            misfit=lambda field, found: _other_base(f"{describe} (base model {base!r})", record, field, found),
            exact=True,
        )
    # After the structural checks (family, layers, shapes), which say more; weights the base checkpoint lacks
    # are reported below as missing, with their own hint.
    _check_base_checksums(model, metadata, info, describe, base, revision)
    warn_missing_base_weights(info, base)
    return (model, info) if hf_kwargs.get("output_loading_info", False) else model


def _adapter_base(
    source: str, metadata: dict[str, Any], base_model_name_or_path, base_model_revision
) -> tuple[str, str | None]:
    """(the base model to load the adapter ``source`` on, its revision): the caller's, else the adapter's own.

    Raises:
        ValueError: the adapter's JSON names no valid base or revision (damaged).
    """
    if base_model_name_or_path is not None:
        return str(base_model_name_or_path), base_model_revision
    base, revision = metadata["base_model_name_or_path"], base_model_revision or metadata["base_model_revision"]
    if not (isinstance(base, str) and base):
        raise ValueError(
            f"{source}/{ADAPTER_CONFIG_NAME} is damaged: base_model_name_or_path must name the base model (a "
            f"Hub repo id or a folder), got {base!r}. Restore the file, or pass base_model_name_or_path= to "
            "hf_neural_attn.from_pretrained."
        )
    if revision is not None and not isinstance(revision, str):
        raise ValueError(
            f"{source}/{ADAPTER_CONFIG_NAME} is damaged: base_model_revision must be a revision name or null, "
            f"got {revision!r}. Restore the file, or pass base_model_revision=."
        )
    return base, revision


def _adapter_model_class(source: str, metadata: dict[str, Any], model_class):
    """The class to build: the caller's, else the transformers class the adapter was saved from.

    Raises:
        ValueError: this version of transformers has no class of that name.
    """
    if model_class is None:
        model_class = getattr(transformers, metadata["architectures"][0], None)
    if model_class is None:
        raise ValueError(
            f"The adapter {source} was saved from a {metadata['architectures'][0]}, which this version of "
            f"transformers ({transformers.__version__}) does not have; pass model_class=."
        )
    return model_class


def _check_base_checksums(model, metadata: dict[str, Any], info, describe: str, base: str, revision) -> None:
    """The loaded base weights are those the adapter was saved on (its checksums; weights the base checkpoint lacks
    are left to :func:`~.rebuild.warn_missing_base_weights`).

    Raises:
        ValueError: a checked base tensor differs.
    """
    recorded = {k: v for k, v in (metadata["base_checksums"] or {}).items() if k not in set(info["missing_keys"])}
    changed = changed_base_tensors(model, recorded)
    if changed:
        raise ValueError(
            f"{describe} was saved on base weights other than those of {base!r}"
            f"{f' at revision {revision!r}' if revision else ''}: {len(changed)} checked base tensor(s) "
            f"differ, e.g. {changed[:3]}. It would not reproduce the saved model. Load the base it was saved "
            "on (base_model_name_or_path= / base_model_revision=), or save the full model instead."
        )


# ---------------------------------------------------------------------------------------------- internals


def _adapter_contents(
    model: nn.Module, base_model_name_or_path, base_model_revision
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What :func:`save_adapter` writes: the JSON metadata and the tensors. Checks everything first."""
    inner = inner_transformers_model(model)
    if inner is not None:  # a SentenceTransformer: the adapter is that of the transformers model it holds
        model = inner
    if hasattr(model, "peft_config") and not isinstance(model, PreTrainedModel):
        raise TypeError(
            "save_adapter takes the patched transformers model, not a PEFT model. For LoRA plus scorers use the "
            "PEFT model's own save_pretrained; for a model with LoRA merged in (merge_and_unload) save the full "
            "model with model.save_pretrained, since its base weights changed."
        )
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"save_adapter expects a transformers PreTrainedModel, got {type(model).__name__}.")
    if not is_patched(model):
        raise ValueError(
            "This model is not patched by hf_neural_attn, so it has no adapter to save. "
            "Patch it with hf_neural_attn.patch_model, or save it with model.save_pretrained."
        )
    narrow_keys.refuse(model, "save an adapter")
    architecture = type(model).__name__
    if getattr(transformers, architecture, None) is not type(model):
        raise ValueError(
            f"{architecture} is not a model class of transformers, so an adapter could not name the class to "
            "rebuild. Save the full model with model.save_pretrained instead."
        )
    base = _base_model_id(model, base_model_name_or_path)
    if base_model_revision is not None and not isinstance(base_model_revision, str):
        raise TypeError(f"base_model_revision must be a string, got {type(base_model_revision).__name__}.")
    _warn_if_base_was_trained(model, base, base_model_revision)
    parameters = scorer_parameters(model)
    disk_name = {name: candidates[0] for name, candidates in names_on_disk(model, parameters).items()}
    # Whole tensors: a scorer tensor parallelism sharded or DeepSpeed ZeRO-3 partitioned is gathered (every process
    # saves, as with save_pretrained), and copied, since ZeRO-3 frees the gathered tensors after the block.
    with partitioned_weights_gathered(parameters.values()):
        tensors = {
            disk_name[name]: whole_tensor(p).detach().to("cpu", copy=True).contiguous()
            for name, p in parameters.items()
        }
    metadata = {
        ADAPTER_FORMAT_KEY: ADAPTER_FORMAT_VERSION,
        "base_model_name_or_path": base,
        "base_model_revision": base_model_revision,
        "architectures": [architecture],
        "model_type": getattr(base_config(model.config), "model_type", None),
        "patch": patch_record(model).to_dict(),
        "num_parameters": sum(tensor.numel() for tensor in tensors.values()),
        # What the adapter needs its base to be: loading checks the base against these (see .checksums).
        "base_checksums": base_checksums(model),
    }
    return metadata, tensors


def _other_base(describe: str, record: PatchRecord, field: str, found) -> ValueError:
    """An adapter's words for a base model that does not fit its record (:func:`.rebuild.check_base_fits`): the
    adapter was saved from another base model."""
    messages = {
        "family": f"was saved from a {record.family!r} model, but the base model is a {found!r} model; check "
        "base_model_name_or_path.",
        "layers": f"patches attention layers {list(record.layers)}, but the base model has {found}; it was saved "
        "from another base model (check base_model_name_or_path).",
    }
    return ValueError(f"{describe} {messages[field]}")


def _warn_if_base_was_trained(model: PreTrainedModel, base: str, revision: str | None) -> None:
    """Warn when the checked base tensors of ``model`` differ from those at ``base`` (read only when it is a
    local folder or already in the Hub cache: saving never downloads), since the adapter then cannot reproduce
    the model."""
    parameters = dict(model.named_parameters())
    names = [name for name in base_checksum_names(model) if name in parameters]
    on_disk = names_on_disk(model, {name: parameters[name] for name in names})
    lookup = {"local_files_only": True, **({"revision": revision} if revision else {})}
    try:
        files = read_tensors(base, {n for candidates in on_disk.values() for n in candidates}, lookup)
    except (OSError, ValueError, SafetensorError):
        return  # the base's files are not here to compare with; loading still checks the recorded checksums
    changed = []
    for name, candidates in on_disk.items():
        found = next((files[c] for c in candidates if c in files), None)
        with loaded_parameter(model, name) as parameter:
            if (
                found is not None
                and not parameter.is_meta
                and (
                    found.shape != parameter.shape
                    or not torch.equal(found.to(parameter.dtype), parameter.detach().cpu())
                )
            ):
                changed.append(name)
    if changed:
        warn_user(
            f"The base weights of this model differ from those of its base model {base!r} ({len(changed)} checked "
            f"tensor(s), e.g. {changed[:3]}): more than the scorers was trained, so an adapter cannot reproduce "
            "it, and hf_neural_attn.from_pretrained will refuse it on that base. Save the full model with "
            "model.save_pretrained instead."
        )


def _base_model_id(model: PreTrainedModel, given) -> str:
    if given is None:
        base = getattr(model.config, "name_or_path", "") or ""
        if not base:
            raise ValueError(
                "The base model of this model is unknown: it was not loaded with from_pretrained, so "
                "model.config.name_or_path is empty. Pass base_model_name_or_path= (the Hub repo id or local "
                "folder holding its unpatched weights)."
            )
    elif isinstance(given, (str, os.PathLike)) and str(given):
        base = str(given)
    else:
        raise ValueError(f"base_model_name_or_path must be a Hub repo id or a folder, got {given!r}.")
    # transformers loads a local folder before a Hub repo of the same name; record which one it was.
    return str(Path(base).resolve()) if os.path.isdir(base) else base


def _read_adapter_config(path: str, source: str) -> dict[str, Any]:
    try:
        metadata = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{source}/{ADAPTER_CONFIG_NAME} cannot be read as JSON ({error}).") from error
    fields = (ADAPTER_FORMAT_KEY, "base_model_name_or_path", "architectures", "patch")
    if not isinstance(metadata, dict) or any(field not in metadata for field in fields):
        raise ValueError(
            f"{source}/{ADAPTER_CONFIG_NAME} is damaged: expected a mapping with {list(fields)}, got {metadata!r}."
        )
    if metadata[ADAPTER_FORMAT_KEY] != ADAPTER_FORMAT_VERSION:
        raise ValueError(
            f"{source} is an adapter of format {metadata[ADAPTER_FORMAT_KEY]!r}; this version of hf_neural_attn "
            f"({__version__}) reads format {ADAPTER_FORMAT_VERSION}."
        )
    architectures = metadata["architectures"]
    if not (isinstance(architectures, list) and architectures and isinstance(architectures[0], str)):
        raise ValueError(
            f"{source}/{ADAPTER_CONFIG_NAME}: architectures must name the model class, got {architectures!r}."
        )
    metadata.setdefault("base_model_revision", None)
    checksums = metadata.setdefault("base_checksums", None)  # absent in adapters saved before it was recorded
    if checksums is not None and not (
        isinstance(checksums, dict)
        and all(isinstance(entry, dict) and {"dtype", "sha256"} <= set(entry) for entry in checksums.values())
    ):
        raise ValueError(
            f"{source}/{ADAPTER_CONFIG_NAME} is damaged: base_checksums must map base tensor names to "
            f"{{'dtype': ..., 'sha256': ...}}, got {checksums!r}."
        )
    metadata["patch"] = read_record(metadata["patch"], source, ADAPTER_CONFIG_NAME)
    return metadata


@contextmanager
def _base_model_errors(source: str, base: str, revision: str | None):
    """Say which adapter needed the base model that transformers could not find or read."""
    try:
        yield
    except OSError as error:
        raise OSError(
            f"The adapter {source} needs its base model {base!r}"
            f"{f' at revision {revision!r}' if revision else ''}, which could not be loaded: {error}\n"
            "If the base model lives elsewhere (another machine's folder, a Hub copy), pass "
            "base_model_name_or_path= (and base_model_revision=) to hf_neural_attn.from_pretrained."
        ) from error


def _write_atomically(path: Path, write) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        write(str(temporary))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
