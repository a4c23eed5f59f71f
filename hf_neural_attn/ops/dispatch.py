"""How scores become attention outputs, behind one function: :func:`scored_attention`, which resolves the ``impl``
choice into a path for each call and calls it.

Every path computes the same thing, ``softmax(scorer.scores(q, k) + mask) @ v``; they differ in memory and speed:

=============  ====================================================================  ===============================
path           how                                                                   serves
=============  ====================================================================  ===============================
``reference``  materialises the scores (:mod:`.reference`); the oracle of the tests   every scorer, every call
``chunked``    query blocks through the scorer's own autograd (:mod:`.chunked`)       every scorer
``blockwise``  query blocks of a fused term, hand-written backward (:mod:`.blockwise`)  scorers with a fused form
``triton``     fused kernels (:mod:`.triton`), CUDA or Triton's CPU interpreter       scorers with a fused form
=============  ====================================================================  ===============================

The ``impl`` option names a choice, not a path (:data:`IMPL_OPTIONS`): ``"chunked"`` is the blockwise path for a
scorer with a fused form (QANA, one-layer Neural Attention: ``Scorer.fused_inputs`` hands over a
:class:`~.terms.FusedInputs`) and the generic chunked path for the others; ``"auto"`` picks by the size of each
call. :func:`resolve_impl` is the one place that turns a choice and a call into a path, and :data:`PATHS` is the one
table of paths. Scorers that are not softmax attention (``scorer.uses_softmax`` False: NSEA, HEA) compute their
output themselves in ``scorer.attend``.

Every path enters a ``torch.compile``'d graph whole, with no graph break: the blockwise path and the Triton kernels as
torch operators, the generic chunked path as checkpointed blocks (:mod:`.chunked`), the dropout seed as a tensor
drawn in the graph (:mod:`.dropout`). Here, compiled calls make no choice that reads a mask's values
(:func:`scored_attention`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import torch

from .blockwise import blockwise_attention, blockwise_unsupported_reason
from .chunked import chunked_attention
from .dropout import DEFAULT_SOURCE as DEFAULT_DROPOUT_SOURCE
from .dropout import AttentionDropout, DropoutPlacement
from .grouped import repeat_kv
from .masks import as_additive_mask, query_rows_seeing_all, zero_rows_without_keys
from .reference import reference_attention
from .sequences import SequenceSlice, padded_sequences
from .triton import (
    TRITON_INSTALL_HINT,
    KernelDropout,
    kernel_unsupported_reason,
    triton_attention,
    triton_unavailable_reason,
)

# impl="auto" on CUDA picks the fused Triton kernels for the calls they support: verified on an H100 (2026-11-27,
# tests/ops/test_cuda.py: fp32 within 1e-5 of float64, bf16 closer than the reference path in bf16, whole-model
# gradients and cached generation equal) and 1.6-5.3x faster than the chunked path there (docs/benchmarks.md#gpu).
# Training with attention dropout and torch.compile'd models included: the kernels apply the dropout every path
# applies, and are opaque operators in compiled graphs (ops/triton/custom_ops.py says why). False gives CUDA the
# CPU's rule.
TRITON_IN_AUTO = True


def check_impl(impl: str, device: torch.device | str | None = None) -> None:
    """Raise ``ValueError`` when the ``impl`` choice cannot run on this machine (``device`` None: on any of its
    devices), naming what is missing. Only ``"triton"`` can fail here. For ``patch_model``, so that a bad choice
    fails at patch time rather than at the first forward."""
    if impl == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ValueError(reason)


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
) -> str:
    """The path (a key of :data:`PATHS`) that serves one call of ``scorer`` under the ``impl`` choice.

    * Calls that need the probabilities returned (``output_attentions``) go to ``"reference"``, the only path that
      materialises them; an explicit ``"chunked"`` or ``"triton"`` says so once (a warning).
    * ``"triton"``: the kernels, or a clear error when they cannot serve the call (``ImportError`` without
      triton, ``ValueError`` naming the reason otherwise), never a silent fallback.
    * ``"auto"`` (the default): with :data:`TRITON_IN_AUTO` set (it is), the kernels for every CUDA call they
      support: training with attention dropout, calls inside a ``torch.compile``'d model, padded batches, each
      sequence of a packed call and decoding steps included. Otherwise ``"reference"`` while the call's score
      tensor, ``batch * heads * q_len * kv_len`` numbers times the scorer's hidden width h, is at most the scorer's
      ``reference_max_scores`` (materialising it is then the faster choice; where the paths cross depends on the
      scorer, which measured it), else as ``"chunked"``. Dropout does not change the rule: every path applies it,
      and drops the same entries for a seed.
    * ``"chunked"``: ``"blockwise"`` for a scorer with a fused form, ``"chunked"`` for the others; memory linear
      in the sequence length either way.

    Only shapes, dtype and device are read, so the choice can be checked for any device (tests pass
    ``device="cuda"`` on machines without one). ``impl`` was checked when the scorer's config was made.
    """
    if need_weights:
        if impl in ("chunked", "triton"):
            warn_once(
                f"impl={impl!r} does not materialise the attention probabilities, so calls that return them "
                "(output_attentions=True) run the reference path."
            )
        return "reference"
    if impl == "reference":
        return "reference"
    auto_kernels = TRITON_IN_AUTO and torch.device(device).type == "cuda"
    if impl == "triton" or (impl == "auto" and auto_kernels):
        reason = triton_unavailable_reason(device) or _fused_form_missing(scorer)
        if reason is None:
            reason = kernel_unsupported_reason(
                scorer.config.activation,
                scorer.config.h,
                dtype=dtype,
                q_len=q_len,
                kv_len=kv_len,
                head_dim=head_dim,
                is_causal=is_causal,
                attention_mask=attention_mask,
                value_head_dim=value_head_dim,
            )
        if kernels_serve(impl, reason, "run this call"):
            return "triton"
    if impl == "auto":
        hidden = getattr(scorer.config, "h", None) or 1
        if batch * heads * q_len * kv_len * hidden <= scorer.reference_max_scores:
            return "reference"
    elif impl != "chunked":
        # A value set on the config after it was made: the option's own error, from the config's one check.
        dataclasses.replace(scorer.config, impl=impl)
    return "blockwise" if _fused_form_missing(scorer, blockwise=True) is None else "chunked"


def resolve_paged_impl(impl: str, scorer, *, device: torch.device | str) -> str:
    """The path of a serving step over a paged cache (:mod:`hf_neural_attn.paged_attention`) for ``scorer`` under
    the ``impl`` choice: ``"triton"``, the paged kernel that walks the block table, or ``"torch"``, the keys gathered
    back and scored on the torch paths (each call then resolved by :func:`resolve_impl`).

    ``"triton"`` is the kernel, or the error :func:`resolve_impl` gives when it cannot run; ``"auto"`` takes it on
    CUDA (with :data:`TRITON_IN_AUTO`) for a scorer with a fused form; ``"reference"`` and ``"chunked"`` name torch
    paths. Whether the kernel serves the step's shapes is asked of the step (``paged_kernel_unsupported_reason``).
    """
    if impl == "triton" or (impl == "auto" and TRITON_IN_AUTO and torch.device(device).type == "cuda"):
        reason = triton_unavailable_reason(device) or _fused_form_missing(scorer)
        if kernels_serve(impl, reason, "serve a paged step", warn_fallback=True):
            return "triton"
    return "torch"


def kernels_serve(impl: str, reason: str | None, what: str, *, warn_fallback: bool = False) -> bool:
    """Whether the Triton kernels serve ``what`` under the ``impl`` choice, given why they cannot (``reason``; None
    when they can). Under ``impl="triton"`` a reason is an error naming it (``ImportError`` without triton), never a
    silent fallback; under ``"auto"`` the torch paths serve, with one warning where triton is missing (or, with
    ``warn_fallback``, for any reason: a paged step on the torch paths on a GPU is a large slowdown)."""
    if reason is None:
        return True
    if impl == "triton":
        if reason == TRITON_INSTALL_HINT:
            raise ImportError(reason)
        raise ValueError(f"impl='triton' cannot {what}: {reason}.")
    if reason == TRITON_INSTALL_HINT:
        warn_once("impl='auto' on CUDA found no triton and uses the torch paths instead: pip install triton")
    elif warn_fallback:
        warn_once(f"impl='auto' on CUDA cannot {what} on the kernels and uses the torch paths: {reason}.")
    return False


def _fused_form_missing(scorer, blockwise: bool = False) -> str | None:
    """Why ``scorer`` has no fused form the Triton kernels (or, with ``blockwise``, the blockwise path) can take,
    or None if it has one."""
    reason = scorer.fused_unsupported_reason()
    if reason is not None:
        return f"{reason}; use impl='chunked'"
    return blockwise_unsupported_reason(scorer.config.activation) if blockwise else None


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def blockwise_path(
    scorer, query, key, value, attention_mask, *, scaling, dropout, extras, is_causal=False, rows_seeing_all=()
) -> tuple[torch.Tensor, None]:
    """The blockwise path with the signature of :func:`.reference.reference_attention`: the scorer's fused term
    (``scorer.fused_inputs``), a block of queries at a time."""
    inputs = scorer.fused_inputs(query, key, extras)
    output = blockwise_attention(
        inputs, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal, dropout=dropout,
        rows_seeing_all=rows_seeing_all,
    )  # fmt: skip
    return output, None


def triton_path(
    scorer, query, key, value, attention_mask, *, scaling, dropout, extras, is_causal=False, rows_seeing_all=()
) -> tuple[torch.Tensor, None]:
    """The Triton kernels with the signature of :func:`.reference.reference_attention`."""
    # Under autocast everything arrives in the autocast dtype already; otherwise align on the query's.
    key, value = key.to(query.dtype), value.to(query.dtype)
    inputs = scorer.fused_inputs(query, key, extras)
    # The kernels skip the keys a causal mask hides from a whole tile; rows that see no key at all must see every
    # key (see .masks.query_blocks), and the mask carries the causal part, so such a call is run without the skip.
    is_causal = is_causal and not rows_seeing_all
    kernel_dropout = None if dropout is None else KernelDropout(dropout.seed, dropout.p, tuple(dropout.offsets()))
    output = triton_attention(
        inputs, query, key, value, attention_mask, scaling=scaling, is_causal=is_causal, dropout=kernel_dropout
    )
    return output, None


# Every path takes keys and values with their kv heads (grouped-query attention), any mask form and the call's
# AttentionDropout or None, and returns (output (batch, heads, q_len, head_dim), probabilities or None).
PATHS = {
    "reference": reference_attention,
    "chunked": chunked_attention,
    "blockwise": blockwise_path,
    "triton": triton_path,
}


def scored_attention(
    scorer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    dropout: float = 0.0,
    dropout_source: str = DEFAULT_DROPOUT_SOURCE,
    training: bool = False,
    extras: Any = None,
    is_causal: bool = False,
    need_weights: bool = False,
    dropout_placement: DropoutPlacement | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with ``scorer``'s logits, on the path :func:`resolve_impl` picks for the call.

    Args:
        query: (batch, heads, q_len, head_dim); key, value: (batch, kv_heads, kv_len, head_dim).
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            (batch, heads, q_len, kv_len) (see :mod:`.masks`).
        is_causal: causal, queries aligned to the end of the keys. With a mask it is a hint (paths skip the
            blocks it hides); with ``attention_mask`` None it is the mask, built by each path where needed.
        need_weights: the caller wants the probabilities (``output_attentions``).

        dropout, training: attention dropout probability, applied in training mode (one seed per call,
            :mod:`.dropout`: every path drops the same entries for a seed). In training mode a value outside
            [0, 1] (or NaN) is a ``ValueError`` naming ``dropout_source`` (the config field it came from).
        dropout_placement: this call is a part (some heads, a block of query rows) of an attention computed in parts
            on several processes: it drops what the whole would drop there (:class:`.dropout.DropoutPlacement`).

    Returns:
        output (batch, q_len, heads, head_dim), the layout transformers' attention functions return,
        and the attention probabilities (batch, heads, q_len, kv_len) when the path keeps them.
    """
    attention_dropout = AttentionDropout.for_call(dropout, training, dropout_source, dropout_placement)
    if not scorer.uses_softmax:
        return _attend_without_softmax(
            scorer, query, key, value, attention_mask, scaling=scaling, dropout=attention_dropout, is_causal=is_causal,
            need_weights=need_weights,
        )  # fmt: skip
    path = _path_for_call(scorer, query, key, value, attention_mask, is_causal=is_causal, need_weights=need_weights)
    blocked, scored_in_blocks = path in ("chunked", "blockwise"), path != "reference"
    # Inside a torch.compile'd model nothing below may depend on the mask's values, which reading would break the
    # graph: a padded batch is not split into its sequences (the same outputs, to rounding, at the cost of the keys
    # the split skips), and a causal call under an additive mask, whose rows seeing no key cannot be found, scores
    # every key in every block (the mask carries the causal part; with a mask is_causal is only a hint).
    compiling = torch.compiler.is_compiling()
    additive_mask = attention_mask is not None and attention_mask.dtype != torch.bool
    if compiling and scored_in_blocks and is_causal and additive_mask:
        is_causal = False
    # Rows whose mask allows no key get what the unpatched model gives them (see .masks): zero under a boolean mask,
    # uniform weights over every key under an additive one, whose blocks the causal skip must then not cut short.
    rows_by_sequence = query_rows_seeing_all(attention_mask, query.shape[-2]) if is_causal and scored_in_blocks else []
    run = functools.partial(PATHS[path], scorer, scaling=scaling, is_causal=is_causal)
    # Where the sequences of a batch differ, the blockwise paths run one sequence at a time: the "padded" call shape
    # (ops.call_shapes), told here because only these paths gain from the split and only uncompiled calls may read it.
    sequences = None
    if blocked and not compiling:
        sequences = padded_sequences(
            attention_mask, query.shape[0], key.shape[-2], is_causal=is_causal, rows_by_sequence=rows_by_sequence
        )
    if sequences is not None:
        output = _run_per_sequence(run, sequences, query, key, value, attention_mask, attention_dropout, extras)
        return output.transpose(1, 2).contiguous(), None
    rows_seeing_all = tuple(sorted(set().union(*rows_by_sequence)))
    output, probs = run(
        query, key, value, attention_mask, dropout=attention_dropout, extras=extras, rows_seeing_all=rows_seeing_all
    )
    output, probs = zero_rows_without_keys(attention_mask, output, probs)
    return output.transpose(1, 2).contiguous(), probs


def _attend_without_softmax(
    scorer, query, key, value, attention_mask, *, scaling, dropout: AttentionDropout | None, is_causal, need_weights
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`scored_attention` for a scorer that is not softmax attention (NSEA, HEA: its weights are not a softmax
    of logits, so none of the paths applies): its own ``attend``, with repeated kv heads and one additive mask."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
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
        dropout=dropout.p if dropout is not None else 0.0,
        is_causal=is_causal,
        need_weights=need_weights,
    )
    return output.transpose(1, 2).contiguous(), weights


def _path_for_call(scorer, query, key, value, attention_mask, *, is_causal: bool, need_weights: bool) -> str:
    """:func:`resolve_impl` for the scorer's ``impl`` and this call's tensors (shapes, dtype and device)."""
    return resolve_impl(
        scorer.config.impl,
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
    )


def _run_per_sequence(
    run,
    sequences: list[tuple[SequenceSlice, tuple[int, ...]]],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: AttentionDropout | None,
    extras: Any,
) -> torch.Tensor:
    """``run`` (a path with the call's scorer and options bound) on each sequence of a padded batch, with its rows
    seeing all keys (:func:`.sequences.padded_sequences`): the outputs back together, (batch, heads, q_len,
    head_dim), zero in the rows a boolean mask allows no key."""
    outputs = [
        run(
            sequence.query_of(query),
            sequence.keys_of(key),
            sequence.keys_of(value),
            sequence.mask_of(attention_mask),
            dropout=sequence.dropout_of(dropout),
            extras=sequence.extras_of(extras, query.shape[0]),
            rows_seeing_all=rows,
        )[0]
        for sequence, rows in sequences
    ]
    (output,) = zero_rows_without_keys(attention_mask, torch.cat(outputs))
    return output
