"""The compute paths (``impl`` choices): which run where, forcing the blockwise path, which a patched model runs."""

from __future__ import annotations

from torch import nn

from hf_neural_attn.ops.choices import IMPL_OPTIONS
from hf_neural_attn.scorers import SCORERS, Scorer

# --- Compute paths -----------------------------------------------------------------------------------------------

IMPLS = IMPL_OPTIONS  # every public impl choice
# The choices that run on any machine: "triton" needs CUDA or Triton's CPU interpreter (the ``interpreter``
# fixture of conftest.py; tests/ops/test_triton.py).
PORTABLE_IMPLS = tuple(impl for impl in IMPLS if impl != "triton")
# The portable choices that name one path; the first is "reference", the oracle the others are compared with.
PATH_IMPLS = tuple(impl for impl in PORTABLE_IMPLS if impl != "auto")


def always_blockwise(monkeypatch) -> None:
    """``impl="auto"`` materialises no score tensor while ``monkeypatch`` lasts: every scorer's threshold
    (``Scorer.reference_max_scores``) is 0, so each call of a softmax scorer runs the blockwise (or chunked) path."""
    for scorer_type in SCORERS.values():
        monkeypatch.setattr(scorer_type, "reference_max_scores", 0)


def scorer_impls(model: nn.Module) -> set[str]:
    """The compute choices (``impl``) the scorers of a patched model run, PEFT's copies of them included."""
    return {module.config.impl for module in model.modules() if isinstance(module, Scorer)}
