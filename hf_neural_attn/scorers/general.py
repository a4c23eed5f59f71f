"""Luong's "general" (bilinear) score: ``score(q, k) = q^T W k``, scaled as the model scales q . k.

Each head has its own (head_dim, head_dim) matrix W, initialised to the identity, so the patched model
computes exactly the pretrained dot product at init, and every entry of W gets a gradient at once
(dS/dW = q k^T): no gate and no mirrored pairs are needed.

Computed as (q W) . k: one extra (head_dim x head_dim) product per query, then the ordinary score.
On RoPE models q and k arrive rotated; a trained W that does not commute with the rotations makes the
score depend on absolute positions as well as on j - i (see ``docs/scorers.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops.grouped import grouped_matmul
from .base import AttentionGeometry, HeadLayout, Scorer, ScorerConfig


@dataclass
class GeneralConfig(ScorerConfig):
    """Luong general-score options: only ``impl``; W starts at the identity."""

    scorer_name = "general"


class GeneralScorer(Scorer):
    name = "general"
    config_class = GeneralConfig

    def __init__(self, config: GeneralConfig, geometry: AttentionGeometry):
        super().__init__(config, geometry)
        self.bilinear = nn.Parameter(
            torch.empty(
                geometry.num_heads, geometry.head_dim, geometry.head_dim, dtype=geometry.dtype, device=geometry.device
            )
        )
        self.init_parameters()

    def head_layout(self) -> dict[str, HeadLayout]:
        """One (head_dim, head_dim) matrix per head, the heads first."""
        return {"bilinear": HeadLayout.PER_HEAD}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.bilinear.copy_(torch.eye(self.geometry.head_dim).expand_as(self.bilinear))

    def scores(self, query, key, extras, scaling: float) -> torch.Tensor:
        """(batch, heads, q, d) x (batch, kv_heads, k, d) -> (batch, heads, q, k): (q W) . k * scaling."""
        return grouped_matmul(torch.matmul(query, self.bilinear), key.transpose(-1, -2)) * scaling
