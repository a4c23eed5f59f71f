"""The table of scorer cases, SCORER_CASES: every scorer and mode with what it should do, which
tests/scorers/test_scorer_contracts.py runs every common contract on; FUSED_SCORERS, the scorers with a fused form."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from hf_neural_attn.scorers import scorer_class

from .models import CORE_FAMILIES, family_names, rows_where
from .references import geometry, randomise

# --- The table of scorer cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScorerCase:
    """One way of patching a model, and what docs/scorers.md says it should do. A new scorer (or a new mode of
    one) is one row of SCORER_CASES; tests/scorers/test_scorer_contracts.py then runs every common contract on it."""

    name: str
    options: dict = field(default_factory=dict)
    preserving: bool = True  # outputs equal the unpatched model's at init
    # Parameter names (last dotted component before .weight/.bias, e.g. "gate", "query_down") whose first
    # gradient is zero by construction and that move from the second step (docs/scorers.md, "Our init").
    waits: tuple[str, ...] = ()
    parameters: bool = True  # the scorer adds parameters to the model
    chunked: bool = True  # impl="chunked" applies
    families: tuple[str, ...] = CORE_FAMILIES  # the FAMILY_CASES it can patch

    @property
    def id(self) -> str:
        return "-".join([self.name, *(f"{key}={value}" for key, value in self.options.items())])

    @property
    def family(self) -> str:
        """The one family the costlier contracts (backward, chunked, checkpoint) run on."""
        return "gpt2" if "gpt2" in self.families else self.families[0]

    @property
    def fused(self) -> bool:
        """Whether the scorer has a fused form with these options (``Scorer.fused_unsupported_reason`` is None), so
        that the blockwise path and the Triton kernels serve it. Asked of the scorer itself, built on the float64
        test geometry (no RoPE; on a RoPE model Neural Attention's replace mode has none)."""
        scorer_type = scorer_class(self.name)
        scorer = scorer_type(scorer_type.config_class.from_options(self.options), geometry())
        return scorer.fused_unsupported_reason() is None


SCORER_CASES = [
    ScorerCase("qana", {}, waits=("gate",)),
    ScorerCase("neural", {}, waits=("gate",)),
    ScorerCase("neural", {"proj_dim": 2}, waits=("gate", "query_down", "key_down")),
    ScorerCase("neural", {"mode": "replace"}, preserving=False),
    ScorerCase("additive", {}, waits=("gate",)),
    ScorerCase("additive", {"mode": "replace"}, preserving=False),
    ScorerCase("general", {}),
    # No parameters and no softmax: for training from scratch. NSEA mixes every query into each key's weight,
    # so it refuses causal models.
    ScorerCase(
        "nsea",
        {"mode": "replace"},
        preserving=False,
        parameters=False,
        chunked=False,
        families=tuple(family_names(core=True, causal=False)),
    ),
    ScorerCase("hea", {"mode": "replace"}, preserving=False, parameters=False, chunked=False),
]


# The scorers with a fused form, each once, in SCORER_CASES' order: the tests that run scorers by name (paths,
# kernels, whole models) run these.
FUSED_SCORERS = tuple(dict.fromkeys(case.name for case in SCORER_CASES if case.fused))


def scorer_cases(with_family: bool = False, **where):
    """pytest params of SCORER_CASES rows whose attributes equal ``where``; with_family: one param per (row,
    family) the row can patch."""
    rows = rows_where(SCORER_CASES, **where)
    if not with_family:
        return [pytest.param(case, id=case.id) for case in rows]
    return [pytest.param(case, family, id=f"{case.id}-{family}") for case in rows for family in case.families]


def random_fused_scorer(
    name: str, heads: int, kv_heads: int, *, hidden_size: int, head_dim: int, dtype=torch.float32, **options
):
    """A scorer with a fused form (QANA or one-layer Neural Attention, ``options`` its config) for attention of
    ``heads`` query heads over ``kv_heads`` key heads, every parameter drawn at std 0.5 (far from init, where the
    gates are 0 and the score term vanishes), in ``dtype``."""
    geo = geometry(
        hidden_size=hidden_size, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32
    )
    scorer_type = scorer_class(name)
    scorer = scorer_type(scorer_type.config_class.from_options(options), geo)
    randomise(scorer, std=0.5)
    return scorer.to(dtype)
