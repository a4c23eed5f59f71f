"""The fused pair-MLP score terms: what a scorer with a fused form hands the compute paths that run one.

Two paths compute a term without the scorer's own autograd graph: the blockwise path (:mod:`.blockwise`, plain
torch, any device) and the Triton kernels (:mod:`.triton`). Both take a :class:`FusedInputs`, which a scorer
builds in ``Scorer.fused_inputs``; neither sees the scorer. This module is that contract and nothing else, so the
kernels and the torch paths can both import it. Each path keeps one file per term (``blockwise/<term>.py``,
``triton/<term>.py``), named as the term is here; :data:`TERMS` is the one list of them.

The terms, by ``FusedInputs.term``, named by what they compute:

* :data:`QUERY_NETWORK` (each query carries its own hidden units, scored against the keys): per query i the
  tensors U (batch, heads, h, q_len, head_dim), V, b (batch, heads, q_len, h), c (batch, heads, q_len, 1) and the
  gate (heads,); the term is ``gate * (sum_l V_il act(U_il . k_j + b_il) + c_i)``.
* :data:`PAIR_MLP` (an MLP on the query and key of each pair, its first layer split into the two halves):
  P (batch, heads, q_len, h) and R (batch, kv_heads, kv_len, h), the output weights w (h,) and the gate (heads,),
  or None for the replace form ``scaling * mlp`` (no dot product; ``mlp`` alone when ``replace_scaled`` is False);
  the term is ``gate * sum_l w_l act(P_il + R_jl)``.

Keys may have fewer heads than queries (grouped-query attention): head ``i`` reads key/value head ``i // groups``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUERY_NETWORK = "query_network"
PAIR_MLP = "pair_mlp"
# Every fused term, by the name FusedInputs.term takes: adding one is a name here and a file in each path.
TERMS = (QUERY_NETWORK, PAIR_MLP)


@dataclass(frozen=True)
class FusedInputs:
    """What a scorer hands the fused paths for one call.

    Attributes:
        term: the score term added to (or, for :data:`PAIR_MLP` without a gate, used instead of) the scaled dot
            product: one of :data:`TERMS`; see the module doc for its tensors.
        tensors: the term's tensors, in the order the module doc lists them.
        activation: the hidden layer's nonlinearity (a key of ``hf_neural_attn.scorers.ACTIVATIONS``).
        hidden: the number of hidden units h.
        replace_scaled: for the replace form (:data:`PAIR_MLP`, gate None), whether its scores are the MLP times
            the call's scaling (True, the paper's Eq. 10) or the MLP itself (False, the Neural Attention authors'
            code).
    """

    term: str
    tensors: tuple[torch.Tensor | None, ...]
    activation: str
    hidden: int
    replace_scaled: bool = True

    def __post_init__(self) -> None:
        if self.term not in TERMS:
            raise ValueError(f"no fused score term {self.term!r}: the fused paths compute {list(TERMS)}")
        if not self.replace_scaled and (self.term != PAIR_MLP or self.tensors[-1] is not None):
            raise ValueError(
                f"replace_scaled=False describes the replace form (term {PAIR_MLP!r} without a gate); a term with a "
                "dot product keeps the call's scaling on it."
            )

    def term_scaling(self, scaling: float) -> float:
        """The scaling to run this term with, for a call whose model scales its dot product by ``scaling``: that
        scaling, or 1 for an unscaled replace form (it has no dot product, so 1 leaves its MLP as it is)."""
        return scaling if self.replace_scaled else 1.0
