"""Scorer registry: adding a scorer is one module and one line here."""

from .base import ACTIVATIONS, AttentionGeometry, Scorer, ScorerConfig
from .neural import NeuralAttentionConfig, NeuralAttentionScorer
from .qana import QanaConfig, QanaScorer

SCORERS: dict[str, type[Scorer]] = {
    QanaScorer.name: QanaScorer,
    NeuralAttentionScorer.name: NeuralAttentionScorer,
}


def scorer_class(name: str) -> type[Scorer]:
    if name not in SCORERS:
        raise ValueError(f"Unknown scorer {name!r}. Available scorers: {sorted(SCORERS)}.")
    return SCORERS[name]


__all__ = [
    "ACTIVATIONS",
    "AttentionGeometry",
    "NeuralAttentionConfig",
    "NeuralAttentionScorer",
    "QanaConfig",
    "QanaScorer",
    "SCORERS",
    "Scorer",
    "ScorerConfig",
    "scorer_class",
]
