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

Options for the paper's ablations (§6.2), see ``docs/experiments.md``:

* ``skip=False``: the score is ``alpha * (sum_l V_il act(...) + c_i)`` alone, no dot-product path. Not
  function-preserving (a from-scratch option): the h units are drawn independently, not in pairs.
* ``rope="none"``: U is not rotated (the RoPE ablation); the skip path keeps the model's RoPE.
* ``key_dim=r``: queries s and keys of width r < D_K (a from-scratch option, Llama attention): the patch
  replaces the query and key projections by narrower ones, so the KV cache holds r-wide keys; U is h x r.
* ``u_rank=r``: U_i = A_i B, a shared per-head basis B (r x D_K, a parameter) mixed by an h x r matrix A_i that
  the query supplies, so the widened query carries h*r instead of h*D_K extra rows per head. With row-wise
  RoPE the basis rows are rotated at the query position: ``U~_il . k~_j = sum_m A_ilm (B~_im . k~_j)``, r
  QK-sized products and a small mix instead of h products. Function-preserving like the default (A's rows in
  mirrored pairs); B itself gets its first gradient on the second step, like alpha.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ..ops.grouped import group_heads, grouped_matmul
from ..ops.terms import QUERY_NETWORK, FusedInputs
from .base import ACTIVATIONS, AttentionGeometry, HeadLayout, MLPScorerConfig, Scorer, attention_head_dim, option

ROPE_MODES = ("rowwise", "none")


@dataclass
class QanaConfig(MLPScorerConfig):
    """QANA options: ``h`` hidden units per query network, ``activation``, ``init``, ``impl``, and the paper's
    ablations ``skip``, ``rope``, ``key_dim``, ``u_rank`` (each field's metadata has its meaning)."""

    scorer_name = "qana"

    skip: bool = option(
        True,
        "keep the dot-product skip path s.k (true); false scores with the query network alone, which is not "
        "function-preserving (for training from scratch; it warns)",
    )
    rope: str = option(
        "rowwise",
        "on RoPE models, rowwise rotates every row of U at the query position (the score depends on j - i only); "
        "none leaves U unrotated (the RoPE ablation)",
        choices=ROPE_MODES,
    )
    key_dim: int | None = option(
        None,
        "width r of queries s and keys, below the head dimension: the query and key projections are replaced by "
        "narrower new ones and the KV cache holds r-wide keys (Llama attention; for training from scratch, it "
        "warns); None keeps the model's width",
        minimum=2,
        nullable=True,
    )
    u_rank: int | None = option(
        None,
        "low-rank query network: U = A B with a shared per-head basis B (u_rank x key width) and an h x u_rank "
        "mix A from the query, instead of h full rows; function-preserving; None: full rows",
        minimum=1,
        nullable=True,
    )

    def validate(self) -> None:
        super().validate()
        if self.key_dim is not None and self.key_dim % 2:
            raise ValueError(
                f"key_dim={self.key_dim} must be even: RoPE turns key dimensions in pairs. Use {self.key_dim + 1} "
                f"or {self.key_dim - 1}."
            )
        if not self.skip and self.init == "zero":
            raise ValueError(
                "skip=False with init='zero' scores every key 0 forever (no skip path, and no gradient reaches "
                "the zero query network). Use init='default'."
            )

    @property
    def has_gates(self) -> bool:
        return True

    @property
    def narrow_key_dim(self) -> int | None:
        return self.key_dim

    def from_scratch_reason(self) -> str | None:
        if not self.skip:
            return "skip=False drops the dot-product path"
        if self.key_dim is not None:
            return f"key_dim={self.key_dim} replaces the query and key projections by new, narrower ones"
        return None


class QanaQueryParts(NamedTuple):
    """The query-network slices of every query, each (batch, heads, ...)."""

    # (batch, heads, h, q_len, key_dim), row-wise RoPE already applied; under u_rank the mix A,
    # (batch, heads, h, q_len, u_rank)
    U: torch.Tensor
    V: torch.Tensor  # (batch, heads, q_len, h)
    b: torch.Tensor  # (batch, heads, q_len, h)
    c: torch.Tensor  # (batch, heads, q_len, 1)
    # u_rank only: the basis rows at each query position, (batch or 1, heads, u_rank, q_len or 1, key_dim)
    basis: torch.Tensor | None = None

    def query_block(self, start: int, end: int) -> QanaQueryParts:
        """The slices of queries ``start:end``."""
        basis = self.basis
        if basis is not None and basis.shape[3] > 1:
            basis = basis[:, :, :, start:end]
        return QanaQueryParts(
            self.U[:, :, :, start:end],
            self.V[:, :, start:end],
            self.b[:, :, start:end],
            self.c[:, :, start:end],
            basis,
        )

    def query_rows(self, positions: torch.Tensor) -> QanaQueryParts:
        """The slices of queries ``positions`` of a batch of one, one query per row of a new batch: row r holds
        query ``positions[r]`` (a packed call's decoding requests scored as a padded batch)."""
        U = self.U[0][:, :, positions].permute(2, 0, 1, 3)[:, :, :, None]  # (rows, heads, h, 1, width)
        V, b, c = (part[0][:, positions].transpose(0, 1)[:, :, None] for part in (self.V, self.b, self.c))
        basis = self.basis
        if basis is not None and basis.shape[3] > 1:
            basis = basis[0][:, :, positions].permute(2, 0, 1, 3)[:, :, :, None]
        return QanaQueryParts(U, V, b, c, basis)


class QanaScorer(Scorer):
    name = "qana"
    config_class = QanaConfig
    needs_hidden_states = True
    # QANA's blockwise form overtakes the reference path early. The value sits between the sizes where
    # benchmarks/auto_threshold.py found the reference path faster and where it found the blockwise one faster, with
    # dropout on and off, batch 1 and 8, GPT-2 and Llama (docs/benchmarks.md, "The auto rule").
    reference_max_scores = 2**19

    def __init__(self, config: QanaConfig, geometry: AttentionGeometry):
        if config.key_dim is not None:
            # The family narrowed the queries s and the keys (families.base.ModelFamily.narrow_keys): the query
            # network scores r-wide keys.
            geometry = dataclasses.replace(geometry, head_dim=config.key_dim)
        super().__init__(config, geometry)
        self.act = ACTIVATIONS[config.activation]
        h, d, heads = config.h, geometry.head_dim, geometry.num_heads
        # Per head: the U rows (h*D_K, or the h*r mix under u_rank), then h for V, h for b, 1 for c.
        self.u_width = config.u_rank if config.u_rank is not None else d
        self.rows_per_head = h * self.u_width + 2 * h + 1
        factory = {"dtype": geometry.dtype, "device": geometry.device}
        self.query_extension = nn.Linear(
            geometry.hidden_size, heads * self.rows_per_head, bias=geometry.query_bias, **factory
        )
        if config.u_rank is not None:
            self.basis = nn.Parameter(torch.empty(heads, config.u_rank, d, **factory))
        else:
            self.register_parameter("basis", None)
        self.gate = nn.Parameter(torch.empty(heads, **factory))
        self.init_parameters()

    @classmethod
    def check_module(cls, config: QanaConfig, module: nn.Module) -> None:
        head_dim = attention_head_dim(module)
        if config.key_dim is not None and head_dim is not None and config.key_dim >= head_dim:
            raise ValueError(
                f"key_dim={config.key_dim} is not below the head dimension {head_dim} of {type(module).__name__}: "
                "key_dim narrows the keys. Use a smaller key_dim, or None for the full width."
            )
        width = config.key_dim or head_dim
        if config.u_rank is not None and width is not None and config.u_rank >= width:
            raise ValueError(
                f"u_rank={config.u_rank} is not below the key width {width} of {type(module).__name__}: a basis that "
                f"wide is no cheaper than full U rows. Use u_rank < {width}, or None for full rows."
            )

    def head_layout(self) -> dict[str, HeadLayout]:
        """Everything is per head: the widened query's rows come head by head, as do the gates and the bases."""
        return {name: HeadLayout.PER_HEAD for name, _ in self.named_parameters()}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Mirrored pairs of hidden units: the same U (and b) rows, opposite V rows; see module doc."""
        h, d, heads, width = self.config.h, self.geometry.head_dim, self.geometry.num_heads, self.u_width
        weight = self.query_extension.weight.view(heads, self.rows_per_head, -1)
        weight.zero_()
        if self.query_extension.bias is not None:
            self.query_extension.bias.zero_()
        if self.basis is not None:
            # Rows of unit expected norm: a mix A of entries at scale sigma gives U entries at scale sigma.
            self.basis.normal_(0.0, width**-0.5)
        if self.config.init == "zero":
            self.gate.zero_()
            return
        U = weight[:, : h * width].view(heads, h, width, -1)
        V = weight[:, h * width : h * width + h]
        # U rows at the scale of the pretrained W_Q rows times 1/sqrt(D_K): U~ . k~ then has the magnitude
        # of the model's own scaled scores, inside the activation's nonlinear range. V rows at the scale
        # of W_Q rows, so V has the magnitude of a query entry.
        U.normal_(0.0, self.geometry.query_weight_std * d**-0.5)
        if not self.config.skip:
            # No skip path to preserve: every unit is its own (a from-scratch option).
            V.normal_(0.0, self.geometry.query_weight_std)
            self.gate.fill_(1.0)
            return
        pairs = h // 2
        V[:, :pairs].normal_(0.0, self.geometry.query_weight_std)
        U[:, pairs : 2 * pairs] = U[:, :pairs]
        V[:, pairs : 2 * pairs] = -V[:, :pairs]
        # With h odd, the last unit has no partner: its V row stays zero.
        self.gate.fill_(1.0)

    def query_extras(
        self, hidden_states: torch.Tensor, rotate: Callable[[torch.Tensor], torch.Tensor] | None
    ) -> QanaQueryParts:
        """Slice the widened query. ``hidden_states``: (batch, seq, hidden).

        The heads are counted from the rows the query extension returns: under tensor parallelism it returns the rows
        of this process's heads only (``parallel.tensor``)."""
        h, d, width = self.config.h, self.geometry.head_dim, self.u_width
        batch, seq = hidden_states.shape[:2]
        rows = self.query_extension(hidden_states)
        heads = rows.shape[-1] // self.rows_per_head
        rows = rows.view(batch, seq, heads, self.rows_per_head).transpose(1, 2)
        # One split rather than four slices: in backward, each slice would zero-fill a gradient the size of rows.
        U, V, b, c = rows.split([h * width, h, h, 1], dim=-1)
        U = U.reshape(batch, heads, seq, h, width).transpose(2, 3)
        if self.config.rope == "none":
            rotate = None
        basis = None
        if self.basis is not None:
            r = self.config.u_rank
            basis = self.basis[None, :, :, None, :]  # (1, heads, r, 1, d): the same at every position
            if rotate is not None:
                # Row-wise RoPE on U_i = A_i B is RoPE on each basis row at the query position.
                rows_at = basis.expand(batch, heads, r, seq, d).reshape(batch, heads * r, seq, d)
                basis = rotate(rows_at).view(batch, heads, r, seq, d)
        elif rotate is not None:
            # Row-wise RoPE: each of the h rows is rotated like a query at its own position.
            U = rotate(U.reshape(batch, heads * h, seq, d)).view(batch, heads, h, seq, d)
        return QanaQueryParts(U, V, b, c, basis)

    def scores(self, query, key, extras: QanaQueryParts, scaling: float) -> torch.Tensor:
        """(batch, heads, q, d) x (batch, kv_heads, k, d) -> (batch, heads, q, k) logits; see module doc. The
        hidden layer is (batch, kv_heads, groups, q, h, k), each query head against its group's kv head."""
        kv_heads = key.shape[1]
        U, V, b, c = (group_heads(t, kv_heads) for t in extras[:4])
        batch, _, groups, h, q_len, width = U.shape
        if extras.basis is None:
            # Each query's h unit rows side by side, (q, h) rows against the keys: one matmul per kv head, whose
            # (…, q, h, k) result needs no reordering (an einsum to (…, q, k, h) copied it).
            rows = U.transpose(3, 4).reshape(batch, kv_heads, groups * q_len * h, width)
            hidden = (rows @ key.transpose(-1, -2)).view(batch, kv_heads, groups, q_len, h, -1)
        else:
            # (B~_im . k~_j) for the r basis rows, then the mix A_i: r QK-sized products, not h.
            projected = torch.einsum("bmgrqd,bmkd->bmgqrk", group_heads(extras.basis, kv_heads), key)
            hidden = torch.einsum("bmgqrk,bmglqr->bmgqlk", projected, U)
        hidden = hidden + b.unsqueeze(-1)
        # The output layer per query row: (1, h) times the row's (h, k) activations.
        mlp = (V.unsqueeze(-2) @ self.act(hidden)).squeeze(-2) + c
        gated = self.gate.view(1, -1, 1, 1) * mlp.flatten(1, 2)
        if not self.config.skip:
            return gated
        return grouped_matmul(query, key.transpose(-1, -2)) * scaling + gated

    def dot_product_view(self) -> QanaScorer:
        """The skip path s.k alone: the query-network term off (its gate a constant 0), every other parameter this
        scorer's own (see :meth:`Scorer.dot_product_view`)."""
        view = self.shared_copy()
        view.config = dataclasses.replace(self.config, skip=True)
        view.gate = nn.Parameter(torch.zeros_like(self.gate), requires_grad=False)
        return view

    def fused_unsupported_reason(self) -> str | None:
        if not self.config.skip:
            return "QANA with skip=False has no fused form (the fused term always adds the dot product)"
        if self.config.u_rank is not None:
            return "QANA with u_rank has its own low-rank form, which the fused paths do not compute"
        return None

    def fused_inputs(self, query, key, extras: QanaQueryParts):
        """The query-network term: the query slices U, V, b, c and the gate (the kernels read the keys)."""
        if extras is None:
            raise ValueError("QANA needs its query slices (extras): call scorer.query_extras first.")
        U, V, b, c, _ = extras  # no basis: fused_unsupported_reason() refuses u_rank
        return FusedInputs(QUERY_NETWORK, (U, V, b, c, self.gate), self.config.activation, U.shape[2])
