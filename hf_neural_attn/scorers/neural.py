"""Neural Attention (DiGiugno & Mahmood, 2025).

A feed-forward network scores each (query, key) pair:

    q'_i = q_i W_q,  k'_j = k_j W_k                      (optional down-projection to d' = proj_dim)
    A_ij = w_a . act(W_h [q'_i ; k'_j] + b_h)            (Eq. 4; deeper MLPs stack more layers)

The concatenation is never built: W_h = [W_hq | W_hk], so the first layer is P_i + R_j with
P = q' W_hq^T and R = k' W_hk^T + b_h, computed once per query and once per key.

Two modes:
  * ``residual`` (default, for pretrained models): score = q.k * scaling + alpha * A. The last hidden
    layer starts as mirrored pairs of units with opposite output weights, so A cancels and outputs equal
    the pretrained model's, while w_a and the last layer get a gradient on the first backward.
  * ``replace`` (the paper's from-scratch form, Eq. 10): score = A * scaling, with random init (scaled as
    described in ``reset_parameters``). Not function-preserving.

The paper's output bias b_a adds one constant to every score, which softmax removes; it could never
receive a gradient, so it is left out.

Shared across heads like the authors' code: one MLP (and one pair of projections) per layer.
``depth=2`` with ``h = proj_dim`` and ``activation="relu"`` gives the authors' 2d' -> d' -> d'/2 -> 1.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from .base import ACTIVATIONS, AttentionGeometry, MLPScorerConfig, Scorer, option

MODES = ("residual", "replace")


@dataclass
class NeuralAttentionConfig(MLPScorerConfig):
    """Neural Attention options (each field's metadata has its meaning and constraints)."""

    scorer_name = "neural"

    proj_dim: int | None = option(
        None,
        "d', the width q and k are down-projected to before the MLP, at most the head dimension; "
        "None skips the projection (the paper's no-down-projection runs)",
        minimum=1,
        nullable=True,
    )
    mode: str = option(
        "residual",
        "residual keeps the dot product and adds a gated MLP term (function-preserving); replace scores with the "
        "MLP alone (the paper's from-scratch form)",
        choices=MODES,
    )
    depth: int = option(
        1, "hidden layers of the scoring MLP, widths h, h//2, h//4, ...; needs h >= 2**(depth-1)", minimum=1
    )

    def validate(self) -> None:
        super().validate()
        if self.h < 2 ** (self.depth - 1):
            raise ValueError(
                f"depth={self.depth} needs h >= {2 ** (self.depth - 1)}: the hidden widths halve from h={self.h} "
                f"({self.h}, {self.h // 2}, ...) and a width below 1 is not possible. Raise h or lower depth."
            )
        if self.mode == "replace" and self.init == "zero":
            raise ValueError(
                "init='zero' only applies to mode='residual'; mode='replace' trains the MLP from its "
                "default random init."
            )

    def hidden_widths(self) -> list[int]:
        return [self.h // 2**i for i in range(self.depth)]  # validate() keeps every width >= 1


def attention_head_dim(module: nn.Module) -> int | None:
    """The per-head width an attention module states (``head_dim``; ``attention_head_size`` in BERT and ViT), or
    the config's ``hidden_size // num_attention_heads``; None when it states none."""
    for name in ("head_dim", "attention_head_size"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    config = getattr(module, "config", None)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


class NeuralAttentionScorer(Scorer):
    name = "neural"
    config_class = NeuralAttentionConfig

    @classmethod
    def check_module(cls, config: NeuralAttentionConfig, module: nn.Module) -> None:
        head_dim = attention_head_dim(module)
        if config.proj_dim is not None and head_dim is not None and config.proj_dim > head_dim:
            raise ValueError(
                f"proj_dim={config.proj_dim} is larger than the head dimension {head_dim} of "
                f"{type(module).__name__}: the down-projection would widen q and k. Use proj_dim <= {head_dim}."
            )

    def __init__(self, config: NeuralAttentionConfig, geometry: AttentionGeometry):
        super().__init__(config, geometry)
        self.act = ACTIVATIONS[config.activation]
        factory = {"dtype": geometry.dtype, "device": geometry.device}
        d = geometry.head_dim
        widths = config.hidden_widths()
        if config.proj_dim is not None:
            self.query_down = nn.Linear(d, config.proj_dim, bias=False, **factory)
            self.key_down = nn.Linear(d, config.proj_dim, bias=False, **factory)
            d = config.proj_dim
        else:
            self.query_down = self.key_down = None
        # W_h split into its query and key halves; the key half carries b_h.
        self.pair_query = nn.Linear(d, widths[0], bias=False, **factory)
        self.pair_key = nn.Linear(d, widths[0], bias=True, **factory)
        self.deeper = nn.ModuleList(nn.Linear(a, b, **factory) for a, b in itertools.pairwise(widths))
        self.output = nn.Linear(widths[-1], 1, bias=False, **factory)  # w_a
        if config.mode == "residual":
            self.gate = nn.Parameter(torch.empty(geometry.num_heads, **factory))
        else:
            self.register_parameter("gate", None)
        self.init_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        # The first map that reads q and k is drawn so its outputs have unit scale. PyTorch's default
        # ignores the input scale: on a model whose q, k entries are small, P_i + R_j would sit in the
        # activation's linear range, where the pair MLP collapses to a query constant (which softmax
        # drops) plus a key bias. A typical q entry is estimated from the pretrained W_Q's scale,
        # assuming the unit-scale normalised hidden states that attention blocks read.
        q_scale = self.geometry.query_weight_std * self.geometry.hidden_size**0.5
        if q_scale > 0:
            for layer in (
                (self.query_down, self.key_down)
                if self.query_down is not None
                else (
                    self.pair_query,
                    self.pair_key,
                )
            ):
                nn.init.normal_(layer.weight, 0.0, 1.0 / (q_scale * layer.in_features**0.5))
        if self.config.mode == "replace":
            return
        if self.config.init == "zero":
            self.output.weight.zero_()
            self.gate.zero_()
            return
        # Mirrored pairs on the last hidden layer: duplicate the rows that produce it, give the copies
        # opposite output weights. Each pair's terms cancel (outputs unchanged, to rounding) while the
        # output weights and the last layer's rows get a gradient on the first backward.
        producers = [self.deeper[-1]] if len(self.deeper) else [self.pair_query, self.pair_key]
        pairs = self.output.in_features // 2
        output = self.output.weight[0]
        for layer in producers:
            layer.weight[pairs : 2 * pairs] = layer.weight[:pairs]
            if layer.bias is not None:
                layer.bias[pairs : 2 * pairs] = layer.bias[:pairs]
        output[pairs : 2 * pairs] = -output[:pairs]
        output[2 * pairs :] = 0.0  # an odd last unit has no partner
        self.gate.fill_(1.0)

    def pair_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """A_ij for (batch, heads, q, d) queries and (batch, heads, k, d) keys -> (batch, heads, q, k)."""
        if self.query_down is not None:
            query, key = self.query_down(query), self.key_down(key)
        hidden = self.act(self.pair_query(query).unsqueeze(-2) + self.pair_key(key).unsqueeze(-3))
        for layer in self.deeper:
            hidden = self.act(layer(hidden))
        return self.output(hidden).squeeze(-1)

    def scores(self, query, key, extras, scaling: float) -> torch.Tensor:
        mlp = self.pair_scores(query, key)
        if self.gate is None:
            return mlp * scaling
        dot = torch.matmul(query, key.transpose(-1, -2)) * scaling
        return dot + self.gate.view(1, -1, 1, 1) * mlp

    def fused_unsupported_reason(self) -> str | None:
        if self.config.depth != 1:
            return f"the fused Neural Attention term has one hidden layer, this scorer has depth={self.config.depth}"
        return None

    def fused_inputs(self, query, key, extras):
        """The pair-MLP term: the first layer's query half P (batch, heads, q_len, h) and key half
        R (batch, kv_heads, kv_len, h), b_h included in R, the output weights w_a and the gate (None in
        replace mode). ``key`` is not repeated for grouped-query attention, so R costs kv_heads, not heads,
        projections."""
        from ..ops.triton import FusedInputs

        if self.query_down is not None:
            query, key = self.query_down(query), self.key_down(key)
        tensors = (self.pair_query(query), self.pair_key(key), self.output.weight[0], self.gate)
        return FusedInputs("neural", tensors, self.config.activation, self.config.h)
