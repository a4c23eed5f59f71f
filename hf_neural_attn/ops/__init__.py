"""How scores become attention outputs, behind one function.

Every path computes the same thing, ``softmax(scorer.scores(q, k) + mask) @ v``; they differ in memory
and speed. ``scored_attention`` picks the path named by the scorer's ``impl`` option, so a new path (a
chunked autograd function, a fused kernel) is one entry in ``IMPLEMENTATIONS``. Scorers that are not
softmax attention (``scorer.uses_softmax`` False: NSEA, HEA) compute their output themselves in
``scorer.attend``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .chunked import chunked_attention, repeat_kv
from .masks import as_additive_mask
from .reference import reference_attention
from .triton import TRITON_INSTALL_HINT, check_triton, triton_attention, triton_unsupported_reason


def check_impl(impl: str, device: torch.device | None = None) -> None:
    """Raise ``ValueError`` when ``impl`` cannot run here, naming what is missing: for ``"triton"`` the
    triton package, or a CUDA device (``device`` None: any; else that one) unless Triton's CPU interpreter
    is enabled (``TRITON_INTERPRET=1``). Other paths run anywhere. For ``patch_model``, so that a bad
    ``impl`` fails at patch time rather than at the first forward."""
    if impl == "triton":
        check_triton(device)


# impl="auto" on CUDA picks the fused Triton kernels only once they are verified on a GPU (they have run
# under Triton's CPU interpreter only). Until then CUDA gets the same rule as the CPU. The GPU work flips this.
TRITON_IN_AUTO = False

# impl="auto" materialises the scores (the reference path) while batch * heads * q_len * kv_len * h is at most
# this many numbers, and computes them blockwise (the chunked path) above. Measured with
# benchmarks/auto_threshold.py (docs/benchmarks.md, 2-core CPU, fp32, one causal call forward + backward, 4 heads
# of 64, h = 4, three runs): the paths cross between 128 and 256 tokens for QANA (0.26M and 1.0M numbers) and
# between 192 and 320 for Neural Attention (0.6M and 1.6M); with 2^20 (256 tokens there) the default was within
# 10 % of the faster path at every length in every run but one (QANA at 256 tokens, 21 % in one run of three).
REFERENCE_MAX_SCORES = 2**20


def resolve_impl(
    impl: str,
    scorer,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    q_len: int,
    kv_len: int,
    head_dim: int,
    is_causal: bool,
    batch: int = 1,
    heads: int = 1,
    attention_mask: torch.Tensor | None = None,
    value_head_dim: int | None = None,
    need_weights: bool = False,
    dropout_active: bool = False,
) -> str:
    """The path (a key of ``IMPLEMENTATIONS``) that serves one call.

    * Calls that need the probabilities or attention dropout go to ``"reference"``, the only path that
      materialises them, whatever ``impl`` says.
    * ``"auto"`` (the default): with :data:`TRITON_IN_AUTO` set, ``"triton"`` for CUDA tensors when triton is
      installed and the kernels support the scorer and inputs. Otherwise ``"reference"`` when the call's score
      tensor, ``batch * heads * q_len * kv_len`` numbers times the scorer's hidden width h, is at most
      :data:`REFERENCE_MAX_SCORES` (materialising it is then the faster choice), else ``"chunked"``, whose
      memory grows linearly in the sequence length.
    * ``"triton"`` raises a clear error when the kernels cannot run (ImportError without triton,
      ValueError otherwise) instead of silently falling back.

    Only shapes, dtype and device are read, so the choice can be checked for any device (tests pass
    ``device="cuda"`` on machines without one).
    """
    if need_weights or dropout_active:
        return "reference"
    if impl not in IMPL_OPTIONS:
        raise ValueError(f"impl={impl!r} is not supported; choose one of {sorted(IMPL_OPTIONS)}.")
    if impl not in ("auto", "triton"):
        return impl
    on_cuda = torch.device(device).type == "cuda"
    if impl == "triton" or (on_cuda and TRITON_IN_AUTO):
        reason = triton_unsupported_reason(
            scorer,
            device=device,
            dtype=dtype,
            q_len=q_len,
            kv_len=kv_len,
            head_dim=head_dim,
            is_causal=is_causal,
            attention_mask=attention_mask,
            value_head_dim=value_head_dim,
        )
        if impl == "triton":
            if reason == TRITON_INSTALL_HINT:
                raise ImportError(reason)
            if reason is not None:
                raise ValueError(f"impl='triton' cannot run this call: {reason}.")
            return "triton"
        if reason is None:
            return "triton"
        if reason == TRITON_INSTALL_HINT:
            _warn_once("impl='auto' on CUDA found no triton and uses the torch paths instead: pip install triton")
    hidden = getattr(scorer.config, "h", None) or 1
    return "reference" if batch * heads * q_len * kv_len * hidden <= REFERENCE_MAX_SCORES else "chunked"


def _resolve_call(
    impl, scorer, query, key, value, attention_mask, is_causal, dropout_active, need_weights=False
) -> str:
    """:func:`resolve_impl` for one call's tensors (keys and values with their kv heads, not repeated)."""
    return resolve_impl(
        impl,
        scorer,
        device=query.device,
        dtype=query.dtype,
        q_len=query.shape[-2],
        kv_len=key.shape[-2],
        head_dim=query.shape[-1],
        is_causal=is_causal,
        batch=query.shape[0],
        heads=query.shape[1],
        attention_mask=attention_mask,
        value_head_dim=value.shape[-1],
        need_weights=need_weights,
        dropout_active=dropout_active,
    )


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


IMPLEMENTATIONS = {
    "reference": reference_attention,
    "chunked": chunked_attention,
    # Fused kernels (CUDA, or CPU under TRITON_INTERPRET=1); keys and values keep their kv heads.
    "triton": triton_attention,
}
# What the ``impl`` option accepts: a path, or "auto", which resolve_impl turns into one per call.
IMPL_OPTIONS = ("auto", *IMPLEMENTATIONS)


def scored_attention(
    scorer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
    extras: Any = None,
    is_causal: bool = False,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with ``scorer``'s logits.

    Args:
        query: (batch, heads, q_len, head_dim); key, value: (batch, kv_heads, kv_len, head_dim).
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            (batch, heads, q_len, kv_len) (see :mod:`.masks`).
        is_causal: causal, queries aligned to the end of the keys. With a mask it is a hint (paths skip the
            blocks it hides); with ``attention_mask`` None it is the mask, built by each path where needed.
        need_weights: the caller wants the probabilities (``output_attentions``).

    Only the reference path materialises the probabilities, so it also serves calls that need them
    returned or need dropout applied to them, whatever ``impl`` says.

    Returns:
        output (batch, q_len, heads, head_dim), the layout transformers' attention functions return,
        and the attention probabilities (batch, heads, q_len, kv_len) when the path keeps them.
    """
    if not scorer.uses_softmax:
        groups = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        # NSEA, HEA: the weights are not a softmax of logits, so none of the paths below applies. Their
        # math takes one additive mask.
        mask = as_additive_mask(
            attention_mask, q_len=query.shape[-2], kv_len=key.shape[-2], is_causal=is_causal, dtype=query.dtype,
            device=query.device,
        )  # fmt: skip
        output, weights = scorer.attend(
            query,
            key,
            value,
            mask,
            scaling=scaling,
            dropout=dropout if training else 0.0,
            is_causal=is_causal,
            need_weights=need_weights,
        )
        return output.transpose(1, 2).contiguous(), weights
    impl = _resolve_call(
        scorer.config.impl, scorer, query, key, value, attention_mask, is_causal, training and dropout > 0, need_weights
    )
    # Every path takes keys and values with their kv heads (grouped-query attention) and any mask form.
    output, probs = IMPLEMENTATIONS[impl](
        scorer,
        query,
        key,
        value,
        attention_mask,
        scaling=scaling,
        dropout=dropout,
        training=training,
        extras=extras,
        is_causal=is_causal,
    )
    return output.transpose(1, 2).contiguous(), probs
