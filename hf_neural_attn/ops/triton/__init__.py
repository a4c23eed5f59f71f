"""Fused Triton attention, the ``impl="triton"`` path: what :mod:`hf_neural_attn.ops` calls.

This package imports without triton. Layout (after flash-linear-attention's ``fla/ops``):

* ``__init__.py`` (here): availability checks and the two functions dispatch calls. A scorer reaches the
  kernels only through two methods of :class:`~hf_neural_attn.scorers.base.Scorer`:
  ``fused_unsupported_reason()`` (why its configuration cannot run fused, or None) and
  ``fused_inputs(query, key, extras)`` (a :class:`FusedInputs`: plain tensors and a few static values).
  Nothing below this file knows scorers.
* ``fused.py``: the torch side; :class:`FusedInputs`, the limits, the ``torch.autograd.Function`` and the
  kernel launches (imports the kernels only when one runs).
* ``common.py``: the forward and the two backward kernels, and :func:`common.tile_scores`, the one place
  they compute a tile's scores.
* ``qana.py``, ``neural.py``: the score terms the kernels fuse (query network; pair MLP), their loads,
  gradients and stores.
* ``utils.py``: leaf Triton helpers (activations, tile loads, masking, softmax backward).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from .fused import (
    MAX_HEAD_DIM,
    MAX_HIDDEN,
    SUPPORTED_ACTIVATIONS,
    SUPPORTED_DTYPES,
    FusedInputs,
    fused_attention,
    inputs_unsupported_reason,
    mlp_unsupported_reason,
)

__all__ = [
    "MAX_HEAD_DIM",
    "MAX_HIDDEN",
    "SUPPORTED_ACTIVATIONS",
    "SUPPORTED_DTYPES",
    "TRITON_INSTALL_HINT",
    "FusedInputs",
    "check_triton",
    "fused_attention",
    "inputs_unsupported_reason",
    "mlp_unsupported_reason",
    "triton_attention",
    "triton_available",
    "triton_interpreting",
    "triton_unsupported_reason",
]

TRITON_INSTALL_HINT = "impl='triton' needs the triton package, which is not installed: pip install triton"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``import triton`` works (cached: importing it is not free)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to run kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def check_triton(device: torch.device | str | None = None) -> None:
    """Raise ``ValueError`` naming what is missing when the fused kernels cannot run here: the triton
    package, or a CUDA device (``device`` None: any; else that one) when Triton's CPU interpreter is not
    enabled (``TRITON_INTERPRET=1``). Checks the machine only; each call still checks its scorer and
    tensors."""
    if not triton_available():
        raise ValueError(TRITON_INSTALL_HINT)
    if triton_interpreting():
        return
    hint = "or set TRITON_INTERPRET=1 to run them, slowly, in Triton's CPU interpreter, which is not enabled"
    if device is None:
        if not torch.cuda.is_available():
            raise ValueError(f"impl='triton' needs a CUDA device, and torch sees none ({hint}); use impl='auto'")
        return
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"impl='triton' runs on CUDA tensors, the model is on {device.type!r} ({hint}); use impl='auto'"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"impl='triton' needs a CUDA device, and torch sees none ({hint}); use impl='auto'")


def triton_unsupported_reason(scorer, *, device: torch.device | str, **call: Any) -> str | None:
    """Why the fused kernels cannot serve this call, or None if they can.

    ``call``: the call's shapes, dtype and mask, the keywords of :func:`.fused.inputs_unsupported_reason`
    (``dtype``, ``q_len``, ``kv_len``, ``head_dim``, ``is_causal``, ``attention_mask``,
    ``value_head_dim``). The checks need only those, the device and the scorer's configuration, so
    ``impl="auto"`` can decide before any work.
    """
    if not triton_available():
        return TRITON_INSTALL_HINT
    device = torch.device(device)
    if device.type != "cuda" and not triton_interpreting():
        return (
            f"the Triton kernels run on CUDA tensors, these are on {device.type!r}; use impl='auto' or "
            "impl='chunked' (or set TRITON_INTERPRET=1 to run them, slowly, in Triton's CPU interpreter)"
        )
    reason = scorer.fused_unsupported_reason()
    if reason is not None:
        return f"{reason}; use impl='chunked'"
    return mlp_unsupported_reason(scorer.config.activation, scorer.config.h) or inputs_unsupported_reason(**call)


def triton_attention(
    scorer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    dropout: float,
    training: bool,
    extras: Any,
    is_causal: bool = False,
) -> tuple[torch.Tensor, None]:
    """softmax(scorer.scores(q, k) + mask) @ v with fused kernels (see :func:`.fused.fused_attention`).

    Args:
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing heads (grouped-query
            attention); repeated keys (kv_heads == heads) work too.
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            (batch, heads, q_len, kv_len).
        is_causal: causal, with queries aligned to the end of the keys (the kernels mask the diagonal).

    Returns:
        output (batch, heads, q_len, head_dim) and None (no probabilities are materialised).

    Raises:
        ImportError: triton is not installed.
        ValueError: the kernels cannot serve this scorer or these inputs (the message says why).
    """
    if training and dropout > 0:
        raise ValueError("The Triton path applies no attention dropout; use the reference path for it.")
    reason = triton_unsupported_reason(
        scorer,
        device=query.device,
        dtype=query.dtype,
        q_len=query.shape[2],
        kv_len=key.shape[2],
        head_dim=query.shape[3],
        is_causal=is_causal,
        attention_mask=attention_mask,
        value_head_dim=value.shape[-1],
    )
    if reason is not None:
        if reason == TRITON_INSTALL_HINT:
            raise ImportError(reason)
        raise ValueError(f"impl='triton' cannot run this call: {reason}.")
    # Under autocast everything arrives in the autocast dtype already; otherwise align on the query's.
    key, value = key.to(query.dtype), value.to(query.dtype)
    # The kernels add a float mask. (Converted here rather than with ops.masks: this package imports on its own.)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        blocked = torch.finfo(query.dtype).min
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~attention_mask, blocked
        )
    inputs = scorer.fused_inputs(query, key, extras)
    output = fused_attention(inputs, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal)
    return output, None
