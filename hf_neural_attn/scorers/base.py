"""What every scorer shares: its configuration, the geometry of the attention it joins, and the module API.

A *scorer* replaces the score ``q_i . k_j / sqrt(d)`` of one attention module with a richer function of
``(q_i, k_j)``. It owns only the scoring math and its parameters; how the scores become an attention
output (full matrix, chunked, fused kernel) lives in :mod:`hf_neural_attn.ops`, and how a model family
hands over q, k and RoPE lives in :mod:`hf_neural_attn.families`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import IMPLEMENTATIONS

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}

INITS = ("default", "zero")


@dataclass
class ScorerConfig:
    """Options shared by every scorer.

    Args:
        h: hidden width of the scoring MLP.
        activation: the MLP's nonlinearity, one of ``ACTIVATIONS``.
        init: ``"default"`` keeps the patched model's outputs equal to the original and lets gradients
            reach the new parameters (see ``docs/scorers.md``); ``"zero"`` is the papers' literal
            all-zero init, under which no gradient ever reaches the new parameters (it warns).
        impl: how scores are turned into attention outputs: ``"reference"`` materialises the score matrix
            (simple, the test oracle); ``"chunked"`` processes blocks of queries and recomputes their
            scores in backward, so memory grows with n instead of n². See :mod:`hf_neural_attn.ops`.
    """

    scorer_name: ClassVar[str] = ""

    h: int = 4
    activation: str = "gelu"
    init: str = "default"
    impl: str = "reference"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if isinstance(self.h, bool) or not isinstance(self.h, int) or self.h <= 0:
            raise ValueError(f"h must be a positive integer (the scoring MLP's hidden width), got h={self.h!r}.")
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("init", self.init, INITS)
        _check_choice("impl", self.impl, IMPLEMENTATIONS)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "ScorerConfig":
        """Build a config from keyword options, naming any option this scorer does not have."""
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            raise ValueError(
                f"Unknown option(s) {unknown} for scorer {cls.scorer_name!r}. "
                f"Valid options: {cls.option_names()}."
            )
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        return {name: _jsonable(getattr(self, name)) for name in self.option_names()}


def _check_choice(name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {sorted(choices)}.")


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class AttentionGeometry:
    """The shape facts a scorer needs about the attention module it joins.

    Attributes:
        hidden_size: width of the hidden states the query projection reads.
        num_heads: query heads.
        num_kv_heads: key/value heads (fewer than ``num_heads`` under grouped-query attention).
        head_dim: per-head width D_K of queries and keys.
        query_bias: whether the pretrained query projection has a bias (its widening gets one too).
        query_weight_std: standard deviation of the pretrained query projection's weights, the scale
            new query rows are drawn at.
        dtype, device: where the pretrained query projection lives; new parameters go there too.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    query_bias: bool
    query_weight_std: float
    dtype: torch.dtype
    device: torch.device


class Scorer(nn.Module):
    """Base class: the parameters and math of one attention scoring function.

    Subclasses set ``name`` and ``config_class`` and implement :meth:`scores`. A scorer whose
    parameters are functions of the hidden states (QANA's widened query) sets
    ``needs_hidden_states`` and implements :meth:`query_extras`; the patch then computes those extras
    in the attention module's forward and hands them to :meth:`scores`.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[ScorerConfig]]
    needs_hidden_states: ClassVar[bool] = False

    def __init__(self, config: ScorerConfig, geometry: AttentionGeometry):
        super().__init__()
        self.config = config
        self.geometry = geometry
        self.act = ACTIVATIONS[config.activation]

    def query_extras(
        self, hidden_states: torch.Tensor, rotate: Callable[[torch.Tensor], torch.Tensor] | None
    ) -> Any:
        """Per-query inputs computed from ``hidden_states`` (batch, seq, hidden); ``rotate`` applies the
        model's RoPE at the query positions to a (batch, n, seq, head_dim) tensor, or is None.

        What is returned must be a NamedTuple of tensors with a ``query_block(start, end)`` method giving
        the same inputs for queries ``start:end`` (the chunked path scores one block of queries at a time).
        """
        return None

    def scores(self, query: torch.Tensor, key: torch.Tensor, extras: Any, scaling: float) -> torch.Tensor:
        """Attention logits before masking and softmax.

        Args:
            query: (batch, heads, q_len, head_dim), after the model's RoPE.
            key: (batch, heads, kv_len, head_dim), after RoPE and the KV cache, already repeated to
                ``heads`` under grouped-query attention.
            extras: what :meth:`query_extras` returned for these queries (or None).
            scaling: the model's own dot-product scale (``1/sqrt(head_dim)``, or whatever it uses).

        Returns:
            (batch, heads, q_len, kv_len) logits.
        """
        raise NotImplementedError

    def forward(self, query: torch.Tensor, key: torch.Tensor, extras: Any, scaling: float) -> torch.Tensor:
        """Same as :meth:`scores`; lets ``torch.func.functional_call`` run a scorer with given parameters."""
        return self.scores(query, key, extras, scaling)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.config.to_dict().items())
