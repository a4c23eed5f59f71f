"""Scorer registry: adding a scorer is one module and one line here."""

from .additive import AdditiveConfig, AdditiveScorer
from .base import ACTIVATIONS, AttentionGeometry, HeadLayout, MLPScorerConfig, Scorer, ScorerConfig
from .exponential import HeaConfig, HeaScorer, NseaConfig, NseaScorer
from .general import GeneralConfig, GeneralScorer
from .neural import NeuralAttentionConfig, NeuralAttentionScorer
from .qana import QanaConfig, QanaScorer

SCORERS: dict[str, type[Scorer]] = {
    QanaScorer.name: QanaScorer,
    NeuralAttentionScorer.name: NeuralAttentionScorer,
    AdditiveScorer.name: AdditiveScorer,
    GeneralScorer.name: GeneralScorer,
    NseaScorer.name: NseaScorer,
    HeaScorer.name: HeaScorer,
}


def scorer_class(name: str) -> type[Scorer]:
    if name not in SCORERS:
        raise ValueError(f"Unknown scorer {name!r}. Available scorers: {sorted(SCORERS)}.")
    return SCORERS[name]


__all__ = [
    "ACTIVATIONS",
    "SCORERS",
    "AdditiveConfig",
    "AdditiveScorer",
    "AttentionGeometry",
    "GeneralConfig",
    "GeneralScorer",
    "HeaConfig",
    "HeaScorer",
    "HeadLayout",
    "MLPScorerConfig",
    "NeuralAttentionConfig",
    "NeuralAttentionScorer",
    "NseaConfig",
    "NseaScorer",
    "QanaConfig",
    "QanaScorer",
    "Scorer",
    "ScorerConfig",
    "scorer_class",
]
