"""The mask forms the attention paths accept, and the one conversion to an additive mask.

A call's mask reaches the paths as it came from transformers' mask builder (see
:func:`hf_neural_attn.attention.hf_neural_attention_mask`), without an n x n copy:

* ``None`` with ``is_causal`` False: full attention;
* ``None`` with ``is_causal`` True: causal, queries aligned to the end of the keys. Every path builds the
  causal part itself (the chunked paths block by block), so a plain causal batch never materialises a mask;
* a boolean tensor (True = attend), as SDPA's builder returns with padding or a sliding window;
* an additive float tensor (0 = attend, large negative = blocked), as the eager builder returns.

Tensors have shape (batch or 1, heads or 1, q_len or 1, kv_len).

A query row whose mask allows no key at all (a leading pad of a left-padded causal batch) gets what the unpatched
model gives it, which the mask's form tells: under a boolean mask (SDPA's) an output of zero and no gradient, as
SDPA's safe softmax gives; under an additive mask (eager's) uniform weights over every key, as a softmax of a row
of equal minima gives (:func:`rows_without_keys`).
"""

from __future__ import annotations

import torch


def as_additive_mask(
    attention_mask: torch.Tensor | None, *, q_len: int, kv_len: int, is_causal: bool, dtype: torch.dtype, device
) -> torch.Tensor | None:
    """Any accepted form as an additive float mask of ``dtype`` (None where nothing is masked), for the code
    that needs one tensor (the NSEA/HEA scorers, the Triton kernels, the eager fallback)."""
    if attention_mask is None:
        if not is_causal or q_len == 1:
            return None
        attention_mask = causal_allowed(0, q_len, kv_len, q_len, device)[None, None]
    if attention_mask.dtype == torch.bool:
        blocked = torch.finfo(dtype).min
        return torch.zeros(attention_mask.shape, dtype=dtype, device=device).masked_fill_(~attention_mask, blocked)
    return attention_mask


def causal_allowed(start: int, end: int, kv_len: int, q_len: int, device) -> torch.Tensor:
    """(end - start, kv_len) booleans, True where query rows ``start:end`` of ``q_len`` may see a key: keys up to
    the query's own position, queries aligned to the end of the keys (a KV cache holds earlier positions)."""
    rows = torch.arange(start, end, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


def apply_mask(scores: torch.Tensor, mask: torch.Tensor | None, *, inplace: bool = False) -> torch.Tensor:
    """Add (float) or apply (bool) ``mask`` to ``scores`` (``inplace``: into ``scores`` itself). Blocked logits sit
    at the dtype's minimum, not -inf, so a row with nothing allowed (left padding) gets uniform weights rather
    than NaN, like transformers' finite masks."""
    if mask is None:
        return scores
    lowest = torch.finfo(scores.dtype).min
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, lowest) if inplace else scores.masked_fill(~mask, lowest)
    return (scores.add_(mask) if inplace else scores + mask).clamp_(min=lowest)


def block_mask(
    mask: torch.Tensor | None, is_causal: bool, start: int, end: int, kv_end: int, q_len: int, kv_len: int, device
) -> torch.Tensor | None:
    """The mask of query rows ``start:end`` against keys ``:kv_end``: the given mask's rows, or with none given
    and ``is_causal`` the causal part, built for this block only."""
    if mask is not None:
        return mask[..., start:end, :kv_end] if mask.shape[-2] > 1 else mask[..., :kv_end]
    if not is_causal or start + kv_len - q_len >= kv_end - 1:  # even the block's first row sees every key here
        return None
    return causal_allowed(start, end, kv_len, q_len, device)[:, :kv_end]


def query_blocks(q_len: int, kv_len: int, is_causal: bool, block: int, rows_seeing_all: tuple[int, ...] = ()):
    """(start, end, kv_end) per block of ``block`` queries. Under a causal mask (queries aligned to the end of
    the keys) the keys after a block's last query are hidden from the whole block: ``kv_end`` stops there, except
    in a block holding one of ``rows_seeing_all`` (sorted query rows an additive mask hides every key from, which
    softmax spreads uniformly over every key: :func:`rows_without_keys`)."""
    first_at_or_after = 0  # into rows_seeing_all: its first row at or after the block's start (blocks ascend)
    for start in range(0, q_len, block):
        end = min(start + block, q_len)
        kv_end = min(kv_len, end + kv_len - q_len) if is_causal else kv_len
        # A walk rather than bisect: torch.compile traces this loop (the chunked path's), and not the C bisect.
        while first_at_or_after < len(rows_seeing_all) and rows_seeing_all[first_at_or_after] < start:
            first_at_or_after += 1
        if first_at_or_after < len(rows_seeing_all) and rows_seeing_all[first_at_or_after] < end:
            kv_end = kv_len
        yield start, end, kv_end


def rows_without_keys(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(batch or 1, heads or 1, q_len or 1, 1) booleans, True where the mask allows a query row no key at all; None
    without a mask (then every row sees a key: causal rows are aligned to the end of the keys)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:  # an additive mask blocks with the dtype's minimum (transformers' eager masks), or -inf
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return ~allowed.any(dim=-1, keepdim=True)


def query_rows_seeing_all(attention_mask: torch.Tensor | None, q_len: int) -> list[tuple[int, ...]]:
    """Per sequence of the mask's batch (one entry when the mask broadcasts over it), the query rows an additive mask
    hides every key from, in any head, sorted: the rows whose softmax is uniform over all keys (eager attention's
    behaviour), for which a causal block skip must not stop at the block's own position (:func:`query_blocks`).
    Empty for no mask and for boolean masks: their rows without keys are zeroed instead (:func:`rows_without_keys`)."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return []
    empty = rows_without_keys(attention_mask).any(dim=1)[..., 0]  # (batch or 1, q_len or 1)
    if empty.shape[-1] == 1:  # one mask row for every query
        empty = empty.expand(-1, q_len)
    return [tuple(row.nonzero().flatten().tolist()) for row in empty]


def zero_rows_without_keys(attention_mask: torch.Tensor | None, *tensors: torch.Tensor | None) -> tuple:
    """``tensors`` (each (batch, heads, q_len, …), or None) with zeros in the query rows a boolean mask allows no key:
    SDPA's safe softmax gives them zero, with no gradient (see :func:`rows_without_keys`). The mask is read once for
    all of them; other masks leave them as they are."""
    if attention_mask is None or attention_mask.dtype != torch.bool:
        return tensors
    empty = rows_without_keys(attention_mask)
    return tuple(tensor.masked_fill(empty, 0) if tensor is not None else None for tensor in tensors)
