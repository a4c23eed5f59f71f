"""Additive attention (Bahdanau et al., 2015): ``score(q, k) = v . tanh(W_q q + W_k k)``.

Per head, ``W_q`` and ``W_k`` map queries and keys (after the model's RoPE) to ``h`` hidden units and
``v`` weighs them. The sum ``W_q q_i + W_k k_j`` is formed per (query, key) pair without concatenating
anything: P = q W_q^T once per query, R = k W_k^T once per key, then act(P_i + R_j).

Two modes, as for Neural Attention:
  * ``residual`` (default, for pretrained models): score = q.k * scaling + alpha * v . tanh(...). The
    hidden units start as mirrored pairs (same W_q, W_k rows, opposite v entries), so the additive term
    cancels and outputs equal the pretrained model's, while v, W_q and W_k all get a gradient on the
    first backward; the per-head gate alpha starts at 1.
  * ``replace`` (Bahdanau's own form, for training from scratch): score = v . tanh(...), random init.

Unlike Neural Attention (one MLP shared by every head), each head has its own W_q, W_k and v, as in
multi-head additive attention; and there is no hidden bias, as in Bahdanau's formulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops.grouped import group_heads, grouped_matmul
from .base import ACTIVATIONS, AttentionGeometry, HeadLayout, MLPScorerConfig, Scorer, option, redefault

MODES = ("residual", "replace")


@dataclass
class AdditiveConfig(MLPScorerConfig):
    """Additive attention options: ``h`` is the hidden units per head (Bahdanau's attention width), the
    activation is ``tanh`` by default as in the paper."""

    scorer_name = "additive"

    activation: str = redefault(MLPScorerConfig, "activation", "tanh")
    mode: str = option(
        "residual",
        "residual keeps the dot product and adds the gated additive term (function-preserving); replace scores "
        "with the additive term alone (for training from scratch)",
        choices=MODES,
    )

    def validate(self) -> None:
        super().validate()
        if self.mode == "replace" and self.init == "zero":
            raise ValueError("init='zero' only applies to mode='residual'; mode='replace' trains from a random init.")

    @property
    def has_gates(self) -> bool:
        return self.mode == "residual"

    def from_scratch_reason(self) -> str | None:
        if self.mode == "replace":
            return "mode='replace' scores with the additive term alone, without the dot product"
        return None


class AdditiveScorer(Scorer):
    name = "additive"
    config_class = AdditiveConfig

    def __init__(self, config: AdditiveConfig, geometry: AttentionGeometry):
        super().__init__(config, geometry)
        self.act = ACTIVATIONS[config.activation]
        factory = {"dtype": geometry.dtype, "device": geometry.device}
        heads, h, d = geometry.num_heads, config.h, geometry.head_dim
        self.query_map = nn.Parameter(torch.empty(heads, h, d, **factory))  # W_q per head
        self.key_map = nn.Parameter(torch.empty(heads, h, d, **factory))  # W_k per head
        self.output = nn.Parameter(torch.empty(heads, h, **factory))  # v per head
        if config.has_gates:
            self.gate = nn.Parameter(torch.empty(heads, **factory))
        else:
            self.register_parameter("gate", None)
        self.init_parameters()

    def head_layout(self) -> dict[str, HeadLayout]:
        """Each head has its own W_q, W_k, v and gate, the heads first."""
        return {name: HeadLayout.PER_HEAD for name, _ in self.named_parameters()}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        h, d = self.config.h, self.geometry.head_dim
        # W_q, W_k drawn so W_q q has unit-scale entries: tanh then works in its nonlinear range. A typical
        # q entry is estimated from the pretrained W_Q's scale (unit-scale normalised hidden states).
        q_scale = self.geometry.query_weight_std * self.geometry.hidden_size**0.5
        std = 1.0 / ((q_scale if q_scale > 0 else 1.0) * d**0.5)
        self.query_map.normal_(0.0, std)
        self.key_map.normal_(0.0, std)
        self.output.normal_(0.0, h**-0.5)
        if self.config.mode == "replace":
            return
        if self.config.init == "zero":
            self.output.zero_()
            self.gate.zero_()
            return
        # Mirrored pairs: each pair's two terms cancel exactly; see the module doc.
        pairs = h // 2
        self.query_map[:, pairs : 2 * pairs] = self.query_map[:, :pairs]
        self.key_map[:, pairs : 2 * pairs] = self.key_map[:, :pairs]
        self.output[:, pairs : 2 * pairs] = -self.output[:, :pairs]
        self.output[:, 2 * pairs :] = 0.0  # an odd last unit has no partner
        self.gate.fill_(1.0)

    def additive_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """v . act(W_q q_i + W_k k_j) for (batch, heads, q, d) queries and (batch, kv_heads, k, d) keys
        -> (batch, heads, q, k). Each query head has its own W_k, applied to its group's kv head."""
        kv_heads = key.shape[1]
        per_query = group_heads(torch.einsum("bnqd,nhd->bnqh", query, self.query_map), kv_heads)
        per_key = torch.einsum("bmkd,mghd->bmgkh", key, group_heads(self.key_map[None], kv_heads)[0])
        hidden = self.act(per_query.unsqueeze(-2) + per_key.unsqueeze(-3))  # (batch, kv_heads, groups, q, k, h)
        output = group_heads(self.output[None], kv_heads)[0]
        return torch.einsum("bmgqkh,mgh->bmgqk", hidden, output).flatten(1, 2)

    def scores(self, query, key, extras, scaling: float) -> torch.Tensor:
        additive = self.additive_scores(query, key)
        if self.gate is None:
            return additive
        dot = grouped_matmul(query, key.transpose(-1, -2)) * scaling
        return dot + self.gate.view(1, -1, 1, 1) * additive
