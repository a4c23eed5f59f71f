"""QANA, Query-As-Network Attention (Vermillion, 2025).

Each query is widened from D_K to D_Q = D_K + h*D_K + 2h + 1 and sliced, per head, into

    s (D_K) | U (h x D_K) | V (h) | b (h) | c (1)

and the score of query i against key j is

    score(i, j) = s~_i . k~_j / sqrt(D_K) + alpha * ( sum_l V_il * act(U~_il . k~_j + b_il) + c_i )

where ~ marks RoPE: s and k get the model's ordinary RoPE, and every row of U gets RoPE at the *query*
position (row-wise RoPE), so each U_il . k_j keeps depending on j - i only.

Here ``s`` is the model's own query (its pretrained W_Q rows, untouched); the extra rows of W_Q that
produce U, V, b, c live in ``query_extension``, one block of h*D_K + 2h + 1 rows per head.

Init (``init="default"``): hidden units in mirrored pairs, the same random U rows and opposite random V
rows (b, c zero, alpha = 1). Each pair's two terms cancel, so outputs equal the pretrained model's (to
rounding), while U, V and b all get a non-zero gradient on the first backward. Only alpha (and c, which
softmax ignores) must wait a step: no function-preserving init can give the gate a gradient at once,
see ``docs/scorers.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .base import ACTIVATIONS, AttentionGeometry, MLPScorerConfig, Scorer


@dataclass
class QanaConfig(MLPScorerConfig):
    """QANA options: ``h`` hidden units per query network, ``activation``, ``init``, ``impl``."""

    scorer_name = "qana"


class QanaQueryParts(NamedTuple):
    """The query-network slices of every query, each (batch, heads, ...)."""

    U: torch.Tensor  # (batch, heads, h, q_len, head_dim), row-wise RoPE already applied
    V: torch.Tensor  # (batch, heads, q_len, h)
    b: torch.Tensor  # (batch, heads, q_len, h)
    c: torch.Tensor  # (batch, heads, q_len, 1)

    def query_block(self, start: int, end: int) -> QanaQueryParts:
        """The slices of queries ``start:end``."""
        return QanaQueryParts(
            self.U[:, :, :, start:end], self.V[:, :, start:end], self.b[:, :, start:end], self.c[:, :, start:end]
        )


class QanaScorer(Scorer):
    name = "qana"
    config_class = QanaConfig
    needs_hidden_states = True

    def __init__(self, config: QanaConfig, geometry: AttentionGeometry):
        super().__init__(config, geometry)
        self.act = ACTIVATIONS[config.activation]
        h, d = config.h, geometry.head_dim
        # Per head: h*D_K rows for U, then h for V, h for b, 1 for c.
        self.rows_per_head = h * d + 2 * h + 1
        self.query_extension = nn.Linear(
            geometry.hidden_size,
            geometry.num_heads * self.rows_per_head,
            bias=geometry.query_bias,
            dtype=geometry.dtype,
            device=geometry.device,
        )
        self.gate = nn.Parameter(torch.empty(geometry.num_heads, dtype=geometry.dtype, device=geometry.device))
        self.init_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Mirrored pairs of hidden units: the same U (and b) rows, opposite V rows; see module doc."""
        h, d, heads = self.config.h, self.geometry.head_dim, self.geometry.num_heads
        weight = self.query_extension.weight.view(heads, self.rows_per_head, -1)
        weight.zero_()
        if self.query_extension.bias is not None:
            self.query_extension.bias.zero_()
        if self.config.init == "zero":
            self.gate.zero_()
            return
        U = weight[:, : h * d].view(heads, h, d, -1)
        V = weight[:, h * d : h * d + h]
        pairs = h // 2
        # U rows at the scale of the pretrained W_Q rows times 1/sqrt(D_K): U~ . k~ then has the magnitude
        # of the model's own scaled scores, inside the activation's nonlinear range. V rows at the scale
        # of W_Q rows, so V has the magnitude of a query entry.
        U.normal_(0.0, self.geometry.query_weight_std * d**-0.5)
        V[:, :pairs].normal_(0.0, self.geometry.query_weight_std)
        U[:, pairs : 2 * pairs] = U[:, :pairs]
        V[:, pairs : 2 * pairs] = -V[:, :pairs]
        # With h odd, the last unit has no partner: its V row stays zero.
        self.gate.fill_(1.0)

    def query_extras(
        self, hidden_states: torch.Tensor, rotate: Callable[[torch.Tensor], torch.Tensor] | None
    ) -> QanaQueryParts:
        """Slice the widened query. ``hidden_states``: (batch, seq, hidden)."""
        h, d, heads = self.config.h, self.geometry.head_dim, self.geometry.num_heads
        batch, seq = hidden_states.shape[:2]
        rows = self.query_extension(hidden_states).view(batch, seq, heads, self.rows_per_head).transpose(1, 2)
        U = rows[..., : h * d].reshape(batch, heads, seq, h, d).transpose(2, 3)
        V = rows[..., h * d : h * d + h]
        b = rows[..., h * d + h : h * d + 2 * h]
        c = rows[..., h * d + 2 * h :]
        if rotate is not None:
            # Row-wise RoPE: each of the h rows is rotated like a query at its own position.
            U = rotate(U.reshape(batch, heads * h, seq, d)).view(batch, heads, h, seq, d)
        return QanaQueryParts(U, V, b, c)

    def scores(self, query, key, extras: QanaQueryParts, scaling: float) -> torch.Tensor:
        """(batch, heads, q, d) x (batch, heads, k, d) -> (batch, heads, q, k) logits; see module doc."""
        dot = torch.matmul(query, key.transpose(-1, -2)) * scaling
        hidden = torch.einsum("bnlqd,bnkd->bnqkl", extras.U, key) + extras.b.unsqueeze(-2)
        mlp = torch.einsum("bnqkl,bnql->bnqk", self.act(hidden), extras.V) + extras.c
        return dot + self.gate.view(1, -1, 1, 1) * mlp

    def fused_unsupported_reason(self) -> str | None:
        return None

    def fused_inputs(self, query, key, extras: QanaQueryParts):
        """The query-network term: the query slices U, V, b, c and the gate (the kernels read the keys)."""
        from ..ops.triton import FusedInputs

        if extras is None:
            raise ValueError("QANA needs its query slices (extras): call scorer.query_extras first.")
        U, V, b, c = extras
        return FusedInputs("qana", (U, V, b, c, self.gate), self.config.activation, U.shape[2])
