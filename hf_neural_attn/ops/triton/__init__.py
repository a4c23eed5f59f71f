"""Fused Triton attention, the ``impl="triton"`` path, and the one answer to "can Triton run here".

This package imports without triton. Layout (after flash-linear-attention's ``fla/ops``):

* ``__init__.py`` (here): whether the kernels can run (:func:`triton_unavailable_reason` for the machine,
  :func:`kernel_unsupported_reason` for one call's term and shapes) and :func:`triton_attention`, what the dispatcher
  (:mod:`hf_neural_attn.ops.dispatch`) calls. It takes a :class:`~hf_neural_attn.ops.terms.FusedInputs` (plain
  tensors and a few static values), never a scorer.
* ``fused.py``: the torch side; the limits and :func:`fused_attention` (imports ``custom_ops.py`` on the first
  call).
* ``custom_ops.py``: the kernels as opaque torch operators (``torch.library.custom_op``: ``torch.ops.hf_neural_attn``'s
  ``fused_attention_forward``, with its autograd, and ``fused_attention_backward``), which torch.compile keeps in
  its graphs; importing it imports triton.
* ``launch.py``: the kernels' launch arguments (tile sizes, pointers, strides, constexprs) from the operators'.
* ``common.py``: the forward and the two backward kernels, and :func:`common.tile_scores`, the one place
  they compute a tile's scores.
* ``paged.py``: the torch side of the paged kernel, for a serving step's requests over a paged KV cache: its limits
  and :func:`paged_fused_attention`; ``paged_kernel.py``: that kernel (forward only), which walks each request's block
  table itself and scores with :func:`common.tile_scores`. :func:`paged_kernel_unsupported_reason` says whether it
  serves a call, the machine included.
* ``query_network.py``, ``pair_mlp.py``: the score terms the kernels fuse, one file each, named as
  :data:`hf_neural_attn.ops.terms.TERMS` names them: their loads, gradients and stores. :data:`.fused.TERM_OPERANDS`
  turns a term's tensors into the kernels' operands.
* ``utils.py``: leaf Triton helpers (activations, tile loads, masking, softmax backward).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..terms import FusedInputs
from .fused import (
    MAX_HEAD_DIM,
    MAX_HIDDEN,
    SUPPORTED_ACTIVATIONS,
    SUPPORTED_DTYPES,
    KernelDropout,
    fused_attention,
    inputs_unsupported_reason,
    mlp_unsupported_reason,
)
from .paged import paged_call_unsupported_reason, paged_fused_attention

__all__ = [
    "MAX_HEAD_DIM",
    "MAX_HIDDEN",
    "SUPPORTED_ACTIVATIONS",
    "SUPPORTED_DTYPES",
    "TRITON_INSTALL_HINT",
    "KernelDropout",
    "fused_attention",
    "kernel_unsupported_reason",
    "paged_fused_attention",
    "paged_kernel_unsupported_reason",
    "triton_attention",
    "triton_available",
    "triton_interpreting",
    "triton_unavailable_reason",
]

TRITON_INSTALL_HINT = "impl='triton' needs the triton package, which is not installed: pip install triton"
_INTERPRETER_HINT = "or set TRITON_INTERPRET=1 to run them, slowly, in Triton's CPU interpreter, which is not enabled"


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


def triton_unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the fused kernels cannot run here, or None if they can: the triton package is missing
    (:data:`TRITON_INSTALL_HINT`), or neither a CUDA device nor Triton's CPU interpreter (``TRITON_INTERPRET=1``)
    is there for them.

    ``device`` None asks about this machine (does torch see a CUDA device); a device asks about tensors on it (a
    CUDA device is taken as given, since the tensors are there, so the choice can be checked for any device). Every
    question of whether Triton can run (choosing ``impl="triton"`` in ``patch_model``, ``from_pretrained`` or
    ``set_impl``, the path of one call) is answered here.
    """
    if not triton_available():
        return TRITON_INSTALL_HINT
    if triton_interpreting():
        return None
    if device is None:
        if not torch.cuda.is_available():
            return f"impl='triton' needs a CUDA device, and torch sees none ({_INTERPRETER_HINT}); use impl='auto'"
        return None
    device_type = torch.device(device).type
    if device_type != "cuda":
        return (
            f"the Triton kernels run on CUDA tensors, and these are on {device_type!r} ({_INTERPRETER_HINT}); "
            "use impl='auto'"
        )
    return None


def kernel_unsupported_reason(activation: str, hidden: int, **call: Any) -> str | None:
    """Why the kernels cannot serve a call of a fused term with this hidden layer, or None if they can (the
    machine aside: see :func:`triton_unavailable_reason`).

    ``call``: the call's shapes, dtype and mask, the keywords of :func:`.fused.inputs_unsupported_reason`
    (``dtype``, ``q_len``, ``kv_len``, ``head_dim``, ``is_causal``, ``attention_mask``, ``value_head_dim``).
    The checks read only those and the term's static values, so the dispatcher can decide before any work.
    """
    return mlp_unsupported_reason(activation, hidden) or inputs_unsupported_reason(**call)


def triton_attention(
    inputs: FusedInputs,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    is_causal: bool = False,
    dropout: KernelDropout | None = None,
) -> torch.Tensor:
    """softmax(scores + mask) @ v, the scores given by ``inputs``' term, with the fused kernels.

    Args:
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing heads (grouped-query
            attention); repeated keys (kv_heads == heads) work too.
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            (batch, heads, q_len, kv_len).
        is_causal: causal, with queries aligned to the end of the keys (the kernels mask the diagonal).
        dropout: the call's attention dropout (:class:`.fused.KernelDropout`), or None.

    Returns:
        output (batch, heads, q_len, head_dim). The caller has checked the machine and the call with
        :func:`triton_unavailable_reason` and :func:`kernel_unsupported_reason`.
    """
    # The kernels add a float mask. (Converted here rather than with ops.masks: this package imports on its own.)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        blocked = torch.finfo(query.dtype).min
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~attention_mask, blocked
        )
    return fused_attention(
        inputs, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal, dropout=dropout
    )


def paged_kernel_unsupported_reason(
    fused: FusedInputs,
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    key_side_blocks: torch.Tensor | None = None,
) -> str | None:
    """Why :func:`paged_fused_attention` cannot serve this call, or None if it can: the machine
    (:func:`triton_unavailable_reason` for the query's device), then the term's hidden layer, the dtypes, shapes and
    devices of the call (:func:`.paged.paged_call_unsupported_reason`). The arguments are
    :func:`paged_fused_attention`'s, without ``scaling``; nothing is computed and the device is not synchronised."""
    return triton_unavailable_reason(query.device) or paged_call_unsupported_reason(
        fused, query, key_blocks, value_blocks, block_table, seq_lens, query_start_loc, key_side_blocks
    )
