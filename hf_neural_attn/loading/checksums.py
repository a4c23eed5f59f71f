"""Checksums of a few base tensors: what an adapter-only checkpoint records of the base model it was trained on,
so that loading it on other base weights is refused instead of silently giving another model."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from contextlib import contextmanager

import torch

from ..parallel.tensor import whole_tensor
from ..placement.offload import offloaded_weights_loaded
from ..placement.quantized import is_quantized
from ..placement.zero3 import partitioned_weights_gathered
from ..record import scorer_parameters

# At most this many elements of each base tensor go into its checksum (evenly strided): training moves every
# element of a weight it touches, so a sample catches it, and hashing stays cheap for large embeddings.
CHECKSUM_SAMPLE = 1 << 16


def base_checksum_names(model) -> list[str]:
    """A few base parameters that see the usual ways of training a base (full fine-tuning, merged LoRA, training
    the top or bottom layers): the first and the last of each kind (names with the layer numbers taken out:
    ``model.layers.#.self_attn.q_proj.weight``), so every module type, and the first and last layer, are covered.
    A change confined to middle layers goes unseen: a cheap check, not a proof.

    Quantized tensors (bitsandbytes, torchao) are left out: a quantized copy of a weight never equals the weight it was
    made from, so neither side could be checked against the other; the float tensors of a quantized model (embeddings,
    norms) still are."""
    scorers = set(scorer_parameters(model))
    chosen: dict[str, list[str]] = {}
    for name, parameter in model.named_parameters():
        if name not in scorers and not is_quantized(parameter):
            kind = chosen.setdefault(re.sub(r"\.\d+\.", ".#.", name), [name])
            kind[1:] = [name] if name != kind[0] else []
    return [name for names in chosen.values() for name in names]


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """sha256 (hex, first 16 digits) of up to :data:`CHECKSUM_SAMPLE` evenly strided elements of ``tensor``,
    cast to ``dtype`` first (a cast to a lower precision is deterministic, so a base loaded in bf16 from fp32
    files hashes like one cast after loading)."""
    flat = tensor.detach().reshape(-1)
    flat = flat[:: max(1, flat.numel() // CHECKSUM_SAMPLE)][:CHECKSUM_SAMPLE]
    flat = flat.to(device="cpu", dtype=dtype or flat.dtype).contiguous()
    digest = hashlib.sha256(str(tuple(tensor.shape)).encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return digest.hexdigest()[:16]


def base_checksums(model) -> dict[str, dict[str, str]]:
    """``{name: {"dtype": ..., "sha256": ...}}`` of :func:`base_checksum_names`, for an adapter's JSON."""
    parameters = dict(model.named_parameters())
    checksums = {}
    for name in base_checksum_names(model):
        digest = _parameter_checksum(model, name)
        if digest is not None:
            checksums[name] = {"dtype": str(parameters[name].dtype).removeprefix("torch."), "sha256": digest}
    return checksums


@contextmanager
def loaded_parameter(model, name: str):
    """``model``'s parameter ``name``, loaded for the block when accelerate offloaded it (only its own module's
    tensors, so the model never has to fit at once), whole when tensor parallelism sharded it or DeepSpeed ZeRO-3
    partitioned it (collective then: every process asks for the same names); a meta tensor where it has no values
    anywhere."""
    owner_name, _, attribute = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    with offloaded_weights_loaded(owner), partitioned_weights_gathered([getattr(owner, attribute)]):
        yield whole_tensor(getattr(owner, attribute))


def _parameter_checksum(model, name: str, dtype: torch.dtype | None = None) -> str | None:
    """:func:`tensor_checksum` of ``model``'s parameter ``name``, offloaded or not; None where it has no values."""
    with loaded_parameter(model, name) as parameter:
        return None if parameter.is_meta else tensor_checksum(parameter, dtype)


def changed_base_tensors(model, recorded: Mapping[str, Mapping[str, str]]) -> list[str]:
    """The recorded base tensors whose values in ``model`` differ from the recorded checksums. Tensors the model
    lacks, holds at a lower precision than recorded or holds quantized (then they cannot be compared) are skipped."""
    parameters = dict(model.named_parameters())
    changed = []
    for name, entry in recorded.items():
        dtype = getattr(torch, str(entry.get("dtype")), None)
        parameter = parameters.get(name)
        if parameter is None or not isinstance(dtype, torch.dtype) or is_quantized(parameter):
            continue
        comparable = parameter.dtype == dtype or (
            parameter.is_floating_point()
            and dtype.is_floating_point
            and torch.finfo(parameter.dtype).bits > torch.finfo(dtype).bits
        )
        if not comparable:
            continue
        digest = _parameter_checksum(model, name, dtype)
        if digest is not None and digest != entry.get("sha256"):
            changed.append(name)
    return changed
