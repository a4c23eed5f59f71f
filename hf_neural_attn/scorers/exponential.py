"""Exponentiation-based attention (Ortiz Valencia): NSEA and HEA.

Both replace ``softmax(A) V`` with ``exp(A) V``, ``A = Q K^T * scaling`` per head, where the exponential
is a power series under a matrix product other than the ordinary one, truncated after ``terms`` = K terms:

    exp(A) ~= I + sum_{k=1..K} A^k / k!        (the paper's Eq. 5; K = None keeps the whole series)

There is no softmax and no normalisation: the weights multiply the values as they are.

NSEA uses the paper's product (Definition 1). Written out, ``(A ⊛ B)_ij = sum_k A_kj B_ij``: every row
of B is multiplied elementwise by the column sums of A. Hence, with s = column sums of A (one number per
key) and e = column sums of the non-square identity I (1 for the first min(m, n) columns), the powers are
``A^k = (e * s^(k-1)) ⊙ A`` row by row, and the truncated exponential has the closed form

    exp_⊛(A) = I + A ⊙ (e * phi_K(s)),   phi_K(s) = sum_{k=1..K} s^(k-1) / k!   (= expm1(s)/s when K = inf)

so NSEA's output is ``I V + A diag(e * phi_K(s)) V``. Because A = Q K^T, that is a *linear-time* attention:
``out_i = (I V)_i + scaling * q_i . M`` with ``M = sum_j e_j phi_K(s_j) k_j v_j^T`` and
``s_j = scaling * (sum_i q_i) . k_j``. Every output therefore depends on every query through s: NSEA is
bidirectional by construction and refuses causal models.

HEA takes the Hadamard product instead. Its identity element is the all-ones matrix, not I (with I the
series would keep only the diagonal: I ⊙ A^k), so ``A^0`` is all ones and HEA's exponential is the
elementwise truncated exponential ``sum_{k=0..K} A^k / k!``: softmax's numerator, never normalised.

Masks act as softmax masks do, multiplicatively: an additive mask m contributes a factor exp(m), so a
blocked pair (m = large negative) gets weight exactly 0. Padded positions are also left out of NSEA's
column sums (a padded query must not change the real tokens' outputs); a query counts as padding when
its own position is a key nobody may attend to, which needs q_len == kv_len (self-attention).

Neither has a function-preserving init (a pretrained model's softmax attention is not a special case),
and neither has parameters: they are for training from scratch, so ``mode="replace"`` must be stated.
See ``docs/scorers.md`` for which of the paper's algebraic properties hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Scorer, ScorerConfig, option

MODES = ("replace",)
# Softmax attention paths; these scorers compute their output themselves, so only these defaults pass.
_IMPLS_THAT_DO_NOT_APPLY = ("chunked", "triton")


@dataclass
class ExponentialConfig(ScorerConfig):
    """Options of NSEA and HEA. The default ``terms=2`` keeps HEA's weights positive (an even-degree
    truncation of exp has no real root) and NSEA's phi_K a low-degree polynomial of its column sums, which grow
    with the sequence length."""

    terms: int | None = option(
        2,
        "K, the series terms kept after the identity (Eq. 5); None keeps the whole series "
        "(closed form: expm1(s)/s for NSEA, exp for HEA)",
        minimum=1,
        nullable=True,
    )
    mode: str | None = option(
        None,
        "must be replace: these scorers replace softmax attention and change a pretrained model's outputs, so the "
        "caller states that it trains from scratch",
        choices=MODES,
        nullable=True,
    )

    def validate(self) -> None:
        if self.mode is None:
            raise ValueError(
                f"{self.scorer_name!r} has no function-preserving form: it replaces softmax attention, so a "
                f"pretrained model's outputs change. Pass mode='replace' to train it from scratch."
            )
        super().validate()
        if self.impl in _IMPLS_THAT_DO_NOT_APPLY:
            raise ValueError(
                f"impl={self.impl!r} does not apply to {self.scorer_name!r}: it is not softmax attention and "
                "computes its output itself. Leave impl at its default."
            )


@dataclass
class NseaConfig(ExponentialConfig):
    scorer_name = "nsea"


@dataclass
class HeaConfig(ExponentialConfig):
    scorer_name = "hea"


def nonsquare_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The paper's product ``a ⊛ b`` of two (..., m, n) matrices: each row of ``b`` times the column sums
    of ``a``."""
    return a.sum(dim=-2, keepdim=True) * b


def phi(s: torch.Tensor, terms: int | None) -> torch.Tensor:
    """``sum_{k=1..K} s^(k-1) / k!`` elementwise (K = ``terms``), or ``expm1(s)/s`` for the whole series."""
    if terms is None:
        small = s.abs() < 1e-4
        safe = torch.where(small, torch.ones_like(s), s)  # keeps the unused branch (and its gradient) finite
        return torch.where(small, 1 + s / 2 + s * s / 6, torch.expm1(safe) / safe)
    result = torch.full_like(s, 1 / math.factorial(terms))
    for k in range(terms - 1, 0, -1):  # Horner
        result = result * s + 1 / math.factorial(k)
    return result


def truncated_exp(x: torch.Tensor, terms: int | None) -> torch.Tensor:
    """``sum_{k=0..K} x^k / k!`` elementwise (K = ``terms``), or ``exp(x)`` for the whole series."""
    if terms is None:
        return torch.exp(x)
    return 1 + x * phi(x, terms)


def nonsquare_identity(m: int, n: int, *, like: torch.Tensor) -> torch.Tensor:
    """The (m, n) matrix with ones on its main diagonal (the paper's I_{m x n})."""
    return torch.eye(m, n, dtype=like.dtype, device=like.device)


def nonsquare_exp(a: torch.Tensor, terms: int | None) -> torch.Tensor:
    """The truncated ⊛-exponential of (..., m, n) matrices in closed form (see the module doc)."""
    m, n = a.shape[-2:]
    identity = nonsquare_identity(m, n, like=a)
    e = identity.sum(dim=-2)
    return identity + a * (e * phi(a.sum(dim=-2), terms)).unsqueeze(-2)


class ExponentialScorer(Scorer):
    """Shared plumbing of NSEA and HEA: no parameters, weights from :meth:`weights`, output ``W @ V``.

    ``query``, ``key``, ``value``: (batch, heads, seq, head_dim), keys and values already repeated for
    grouped-query attention.
    """

    uses_softmax = False

    def scores(self, query, key, extras, scaling: float) -> torch.Tensor:
        """The exponent A = q . k * scaling, (batch, heads, q, k)."""
        return torch.matmul(query, key.transpose(-1, -2)) * scaling

    def weights(self, query, key, attention_mask, scaling: float) -> torch.Tensor:
        """The (batch, heads, q_len, kv_len) matrix that multiplies the values."""
        raise NotImplementedError

    def attend(self, query, key, value, attention_mask, *, scaling, dropout, is_causal, need_weights):
        # Unnormalised weights in half precision overflow quickly, so the whole computation runs in fp32
        # (fp64 stays fp64, so the float64 tests check the math itself).
        output_dtype = value.dtype
        compute_dtype = torch.promote_types(value.dtype, torch.float32)
        query, key, value = (t.to(compute_dtype) for t in (query, key, value))
        if attention_mask is not None:
            attention_mask = attention_mask.to(compute_dtype)
        weights = None
        output = None if need_weights or dropout > 0 else self._fast_output(query, key, value, attention_mask, scaling)
        if output is None:
            weights = self.weights(query, key, attention_mask, scaling)
            output = torch.matmul(F.dropout(weights, p=dropout, training=dropout > 0), value)
        return output.to(output_dtype), weights

    def _fast_output(self, query, key, value, attention_mask, scaling) -> torch.Tensor | None:
        """An output computed without the weight matrix, or None where there is no such shortcut."""
        return None


def _mask_factor(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """exp(additive mask): 1 where attention is allowed, 0 where it is blocked."""
    return None if attention_mask is None else torch.exp(attention_mask)


class HeaScorer(ExponentialScorer):
    """Hadamard exponential attention: ``out = (exp_K(A) ⊙ exp(mask)) V``, elementwise truncated exp."""

    name = "hea"
    config_class = HeaConfig

    def weights(self, query, key, attention_mask, scaling: float) -> torch.Tensor:
        weights = truncated_exp(self.scores(query, key, None, scaling), self.config.terms)
        factor = _mask_factor(attention_mask)
        return weights if factor is None else weights * factor


class NseaScorer(ExponentialScorer):
    """Non-square exponential attention: ``out = exp_⊛(A ⊙ exp(mask)) V`` (bidirectional only)."""

    name = "nsea"
    config_class = NseaConfig
    mixes_queries = True  # the column sums s run over every query

    @classmethod
    def check_module(cls, config, module: nn.Module) -> None:
        if getattr(module, "is_causal", False):
            raise ValueError(_CAUSAL_ERROR.format(module=type(module).__name__))

    def attend(self, query, key, value, attention_mask, *, scaling, dropout, is_causal, need_weights):
        if is_causal:
            raise ValueError(_CAUSAL_ERROR.format(module="this attention call"))
        return super().attend(
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            is_causal=False,
            need_weights=need_weights,
        )

    def _exponent(self, query, key, attention_mask, scaling) -> torch.Tensor:
        """A ⊙ exp(mask) with padded queries' rows zeroed, (batch, heads, q, k)."""
        exponent = self.scores(query, key, None, scaling)
        factor = _mask_factor(attention_mask)
        if factor is not None:
            exponent = exponent * factor * _real_queries(attention_mask, query.shape[-2], key.shape[-2])
        return exponent

    def weights(self, query, key, attention_mask, scaling: float) -> torch.Tensor:
        return nonsquare_exp(self._exponent(query, key, attention_mask, scaling), self.config.terms)

    def _fast_output(self, query, key, value, attention_mask, scaling) -> torch.Tensor | None:
        """I V + scaling * q (K^T diag(g) V), linear in the sequence length; needs a mask that depends on
        the key only (no mask, or key padding), which is what bidirectional models pass."""
        q_len, kv_len = query.shape[-2], key.shape[-2]
        key_factor = None
        if attention_mask is not None:
            if not bool((attention_mask == attention_mask[..., :1, :]).all()):
                return None
            key_factor = torch.exp(attention_mask[..., 0, :])  # (batch or 1, 1, kv)
            query = query * _real_queries(attention_mask, q_len, kv_len)
        key_sum_weights = scaling * torch.matmul(key, query.sum(dim=-2).unsqueeze(-1)).squeeze(-1)  # (b, n, kv)
        if key_factor is not None:
            key_sum_weights = key_sum_weights * key_factor
        e = nonsquare_identity(q_len, kv_len, like=query).sum(dim=-2)
        g = e * phi(key_sum_weights, self.config.terms)
        if key_factor is not None:
            g = g * key_factor
        memory = torch.matmul(key.transpose(-1, -2), value * g.unsqueeze(-1))  # (batch, heads, d, d_v)
        identity_part = F.pad(value[..., :q_len, :], (0, 0, 0, max(q_len - kv_len, 0)))
        return identity_part + scaling * torch.matmul(query, memory)


def _real_queries(attention_mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """(batch or 1, 1, q_len, 1): 0 for padded queries, 1 otherwise. A query is padding when its own
    position is a key no query may attend to; without q_len == kv_len queries cannot be told apart."""
    if q_len != kv_len:
        return torch.ones((1, 1, q_len, 1), dtype=attention_mask.dtype, device=attention_mask.device)
    blocked = attention_mask <= torch.finfo(attention_mask.dtype).min / 2
    return (~blocked.all(dim=-2)).to(attention_mask.dtype).unsqueeze(-1)


_CAUSAL_ERROR = (
    "nsea cannot serve {module}, a causal (decoder) attention: its product ⊛ sums every query into each "
    "key's weight, so every position would see later tokens. Use it on bidirectional models (BERT, "
    "RoBERTa, ViT), or use 'hea', which is elementwise and can be causal."
)
