"""The fused pair-MLP score terms: what a scorer with a fused form hands the compute paths that run one.

Two paths compute a term without the scorer's own autograd graph: the blockwise path (:mod:`.blockwise`, plain
torch, any device) and the Triton kernels (:mod:`.triton`). Both take a :class:`FusedInputs`, which a scorer
builds in ``Scorer.fused_inputs``; neither sees the scorer. This module is that contract and nothing else, so the
kernels and the torch paths can both import it.

The terms, by ``FusedInputs.term``:

* ``"qana"`` (query network, QANA's MLP; also Neural Attention's relative form): per query i the tensors
  U (batch, heads, h, q_len, head_dim), V, b (batch, heads, q_len, h), c (batch, heads, q_len, 1) and the gate
  (heads,); the term is ``gate * (sum_l V_il act(U_il . k_j + b_il) + c_i)``.
* ``"neural"`` (pair MLP on concatenated inputs): the first layer split into its query and key halves,
  P (batch, heads, q_len, h) and R (batch, kv_heads, kv_len, h), the output weights w (h,) and the gate (heads,),
  or None for the replace form ``scaling * mlp`` (no dot product; ``mlp`` alone when ``replace_scaled`` is False);
  the term is ``gate * sum_l w_l act(P_il + R_jl)``.

Keys may have fewer heads than queries (grouped-query attention): head ``i`` reads key/value head ``i // groups``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TERMS = ("qana", "neural")


@dataclass(frozen=True)
class FusedInputs:
    """What a scorer hands the fused paths for one call.

    Attributes:
        term: the score term added to (or, for ``"neural"`` without a gate, used instead of) the scaled dot
            product: ``"qana"`` or ``"neural"``; see the module doc for its tensors.
        tensors: the term's tensors, in the order the module doc lists them.
        activation: the hidden layer's nonlinearity (a key of ``hf_neural_attn.scorers.ACTIVATIONS``).
        hidden: the number of hidden units h.
        replace_scaled: for the replace form (``"neural"``, gate None), whether its scores are the MLP times the
            call's scaling (True, the paper's Eq. 10) or the MLP itself (False, the Neural Attention authors' code).
    """

    term: str
    tensors: tuple[torch.Tensor | None, ...]
    activation: str
    hidden: int
    replace_scaled: bool = True

    def __post_init__(self) -> None:
        if not self.replace_scaled and (self.term != "neural" or self.tensors[-1] is not None):
            raise ValueError(
                "replace_scaled=False describes the replace form (term 'neural' without a gate); a term with a dot "
                "product keeps the call's scaling on it."
            )

    def term_scaling(self, scaling: float) -> float:
        """The scaling to run this term with, for a call whose model scales its dot product by ``scaling``: that
        scaling, or 1 for an unscaled replace form (it has no dot product, so 1 leaves its MLP as it is)."""
        return scaling if self.replace_scaled else 1.0
