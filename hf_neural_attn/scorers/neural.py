"""Neural Attention (DiGiugno & Mahmood, 2025).

A feed-forward network scores each (query, key) pair:

    q'_i = q_i W_q,  k'_j = k_j W_k                      (optional down-projection to d' = proj_dim)
    A_ij = w_a . act(W_h [q'_i ; k'_j] + b_h)            (Eq. 4; deeper MLPs stack more layers)

The concatenation is never built: W_h = [W_hq | W_hk], so the first layer is P_i + R_j with
P = q' W_hq^T and R = k' W_hk^T + b_h, computed once per query and once per key.

Two modes:
  * ``residual`` (default, for pretrained models): score = q.k * scaling + alpha * A. The last hidden
    layer starts as mirrored pairs of units with opposite output weights, so A cancels and outputs equal
    the pretrained model's, while w_a and the last layer get a gradient on the first backward.
  * ``replace`` (the paper's from-scratch form, Eq. 10): score = A * scaling, with random init (scaled as
    described in ``reset_parameters``). Not function-preserving. ``scale_mlp=False`` scores with A itself.

The paper's output bias b_a adds one constant to every score, which softmax removes; it could never
receive a gradient, so it is left out.

Shared across heads like the authors' code: one MLP (and one pair of projections) per layer.

**The authors' code** (github.com/awayfromzel/neural-attention-research, nlp_neural_attention/Models/
NeuralAttention.py) differs from the paper's equations in three ways, each an option here:
:meth:`NeuralAttentionConfig.authors_code` sets them all. Its down-projections have biases (``proj_bias``; Eq. 5-6
have none), its score is the MLP's output without the 1/sqrt(d) of Eq. 10 (``scale_mlp=False``), and its MLP is
``Linear(2d' -> d') ReLU Linear(d' -> d'/2) ReLU Linear(d'/2 -> 1)`` (``h = proj_dim``, ``depth=2``,
``activation="relu"``; Eq. 3-4 have one hidden layer).

**Relative input on RoPE models** (``pair_input="relative"``, the default there). q and k arrive rotated by the
model's RoPE, so P_i + R_j above depends on the absolute positions i and j: shifting every position changes the
scores. No first layer that adds a key term R_j can avoid that, and the model's KV cache holds only rotated keys.
The relative input therefore makes the first layer bilinear in the rotated pair, through products that RoPE
turns by the angle of j - i only. Per pair p of dimensions RoPE turns together (p and p + D/2 in Llama's
rotate-half layout, as a complex number z), unit l reads

    Z_ijl = sum_p Re( c_lp * z(q~_i)_p * conj z(k~_j)_p ) + b_l  =  (M_l q~_i) . k~_j + b_l

with learned complex weights c_lp (dimensions RoPE does not turn get a real weight each). M_l is a complex scaling
per pair, which commutes with every rotation, so Z_ijl is a function of q_i, k_j and j - i. Which dimensions pair
up comes from the family (``AttentionGeometry.rope_partner``; read off the model's own rotation). The dot product is
the case c = 1 (one unit, identity activation). The rest of the MLP is unchanged, and the skip path keeps the
model's RoPE. ``pair_input="concat"`` is the paper's input, [q'_i ; k'_j] of the rotated vectors.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..ops.grouped import group_heads, grouped_matmul
from ..ops.terms import PAIR_MLP, QUERY_NETWORK, FusedInputs
from .base import ACTIVATIONS, AttentionGeometry, HeadLayout, MLPScorerConfig, Scorer, attention_head_dim, option

MODES = ("residual", "replace")
PAIR_INPUTS = ("auto", "concat", "relative")


@dataclass
class NeuralAttentionConfig(MLPScorerConfig):
    """Neural Attention options (each field's metadata has its meaning and constraints)."""

    scorer_name = "neural"
    # Checkpoints written before pair_input existed scored the concatenated pair.
    record_defaults: ClassVar[dict[str, str]] = {"pair_input": "concat"}
    summary_options: ClassVar[tuple[tuple[str, str], ...]] = (("h", "h"), ("proj_dim", "d'"), ("mode", "mode"))

    proj_dim: int | None = option(
        None,
        "d', the width q and k are down-projected to before the MLP, at most the head dimension; "
        "None skips the projection (the paper's no-down-projection runs)",
        minimum=1,
        nullable=True,
    )
    mode: str = option(
        "residual",
        "residual keeps the dot product and adds a gated MLP term (function-preserving); replace scores with the "
        "MLP alone (the paper's from-scratch form)",
        choices=MODES,
    )
    depth: int = option(
        1, "hidden layers of the scoring MLP, widths h, h//2, h//4, ...; needs h >= 2**(depth-1)", minimum=1
    )
    proj_bias: bool = option(
        False,
        "give the down-projections to proj_dim a bias, as the authors' code does (false: none, as the paper's "
        "Eq. 5-6); needs proj_dim",
    )
    scale_mlp: bool = option(
        True,
        "mode='replace': multiply the MLP score by the model's dot-product scale 1/sqrt(D), as the paper's Eq. 10 "
        "does (true); false scores with the MLP output itself, as the authors' code does",
    )
    pair_input: str = option(
        "auto",
        "what the MLP's first layer reads: concat is the paper's [q'; k'] (on RoPE models the rotated vectors, so the "
        "score depends on absolute position); relative reads RoPE-commuting products of q and k, so the whole score "
        "depends on content and j - i only (RoPE models, without proj_dim); auto (default) is relative on RoPE "
        "models when proj_dim is not given, concat elsewhere",
        choices=PAIR_INPUTS,
    )

    def validate(self) -> None:
        super().validate()
        if self.h < 2 ** (self.depth - 1):
            raise ValueError(
                f"depth={self.depth} needs h >= {2 ** (self.depth - 1)}: the hidden widths halve from h={self.h} "
                f"({self.h}, {self.h // 2}, ...) and a width below 1 is not possible. Raise h or lower depth."
            )
        if self.pair_input == "relative" and self.proj_dim is not None:
            raise ValueError(
                f"pair_input='relative' reads the full rotated q and k (a down-projection would mix RoPE's frequency "
                f"pairs and bring absolute position back); proj_dim={self.proj_dim} applies to pair_input='concat'. "
                "Drop one of them."
            )
        if self.proj_bias and self.proj_dim is None:
            raise ValueError(
                "proj_bias=True gives the down-projections a bias, and proj_dim=None has no down-projection. Set "
                "proj_dim (the authors' code: 2) or drop proj_bias."
            )
        if not self.scale_mlp and self.mode != "replace":
            raise ValueError(
                f"scale_mlp=False applies to mode='replace' (the MLP score alone); in mode={self.mode!r} the MLP term "
                "is weighed by the learned per-head gate instead. Use mode='replace' or drop scale_mlp."
            )
        if self.mode == "replace" and self.init == "zero":
            raise ValueError(
                "init='zero' only applies to mode='residual'; mode='replace' trains the MLP from its "
                "default random init."
            )

    @classmethod
    def authors_code(cls, proj_dim: int = 2, **options) -> NeuralAttentionConfig:
        """The scorer of the authors' public code, function for function: q and k down-projected to
        d' = ``proj_dim`` by biased linear maps, scored by ``Linear(2d' -> d') ReLU Linear(d' -> d'/2) ReLU
        Linear(d'/2 -> 1)`` in place of the dot product, without 1/sqrt(d). Their last layer's bias is left out
        (softmax removes it). Their default d' is head_dim // 32, 2 at the paper's head dimension 64. Their models
        have it in the first layer only, trained from scratch: ``patch_model(model, config, layers=[0])``.

        ``options`` add or override options (``impl``, ``proj_bias``, ...). Source: DiGiugno & Mahmood,
        github.com/awayfromzel/neural-attention-research, nlp_neural_attention/Models/NeuralAttention.py.
        """
        if proj_dim is None or proj_dim < 2:
            raise ValueError(
                f"The authors' MLP has d'//2 units in its second hidden layer, none for proj_dim={proj_dim}. Use "
                "proj_dim >= 2."
            )
        authors = {"h": proj_dim, "depth": 2, "activation": "relu", "mode": "replace", "scale_mlp": False}
        return cls.from_options({"proj_dim": proj_dim, "proj_bias": True, **authors, **options})

    @property
    def has_gates(self) -> bool:
        return self.mode == "residual"

    def hidden_widths(self) -> list[int]:
        return [self.h // 2**i for i in range(self.depth)]  # validate() keeps every width >= 1

    def resolved(self, geometry: AttentionGeometry) -> NeuralAttentionConfig:
        return dataclasses.replace(self, pair_input=self.resolved_pair_input(geometry.rope_partner))

    def from_scratch_reason(self) -> str | None:
        if self.mode == "replace":
            return "mode='replace' scores with the MLP alone, without the dot product"
        return None

    def resolved_pair_input(self, rope_partner: tuple[int, ...] | None) -> str:
        """``pair_input`` for a module with this RoPE pairing (``AttentionGeometry.rope_partner``; None: no RoPE)."""
        if self.pair_input != "auto":
            return self.pair_input
        return "relative" if rope_partner is not None and self.proj_dim is None else "concat"


class NeuralAttentionScorer(Scorer):
    name = "neural"
    config_class = NeuralAttentionConfig
    # Neural Attention's reference form (a broadcast sum of its two halves, or on RoPE models one product of its
    # units) stays faster than its blockwise one up to larger calls than QANA's. The value sits between the sizes
    # where benchmarks/auto_threshold.py found the reference path faster and where it found the blockwise one
    # faster, with dropout on and off, batch 1 and 8, GPT-2 and Llama (docs/benchmarks.md, "The auto rule").
    reference_max_scores = 2**21

    @classmethod
    def check_module(cls, config: NeuralAttentionConfig, module: nn.Module) -> None:
        head_dim = attention_head_dim(module)
        if config.proj_dim is not None and head_dim is not None and config.proj_dim > head_dim:
            raise ValueError(
                f"proj_dim={config.proj_dim} is larger than the head dimension {head_dim} of "
                f"{type(module).__name__}: the down-projection would widen q and k. Use proj_dim <= {head_dim}."
            )

    def __init__(self, config: NeuralAttentionConfig, geometry: AttentionGeometry):
        super().__init__(config, geometry)
        self.act = ACTIVATIONS[config.activation]
        factory = {"dtype": geometry.dtype, "device": geometry.device}
        d = geometry.head_dim
        widths = config.hidden_widths()
        self.pair_input = config.resolved_pair_input(geometry.rope_partner)
        if self.pair_input == "relative" and geometry.rope_partner is None:
            raise ValueError(
                "pair_input='relative' reads products of q and k that RoPE turns by j - i; this attention has no RoPE "
                "(or one hf_neural_attn cannot describe), so there is no relative position to keep. Use "
                "pair_input='concat' (or 'auto')."
            )
        self.query_down = self.key_down = self.pair_query = self.pair_key = None
        if self.pair_input == "relative":
            partner = geometry.rope_partner
            first = [dim for dim in range(d) if partner[dim] > dim]
            # The pairs (first[p], second[p]), then the dimensions RoPE leaves alone; ``order`` undoes the grouping.
            self.pairs = (first, [partner[dim] for dim in first], [dim for dim in range(d) if partner[dim] == dim])
            grouped = [dim for part in self.pairs for dim in part]
            order = sorted(range(d), key=grouped.__getitem__)
            self.order = order if order != list(range(d)) else None  # None: Llama's layout needs no reordering
            # Per unit: the real parts of c (one per pair), their imaginary parts, then one real weight per
            # dimension RoPE leaves alone; the bias b_l. See the module doc.
            self.pair_weight = nn.Parameter(torch.empty(widths[0], d, **factory))
            self.pair_bias = nn.Parameter(torch.empty(widths[0], **factory))
        else:
            self.register_parameter("pair_weight", None)
            self.register_parameter("pair_bias", None)
            if config.proj_dim is not None:
                self.query_down = nn.Linear(d, config.proj_dim, bias=config.proj_bias, **factory)
                self.key_down = nn.Linear(d, config.proj_dim, bias=config.proj_bias, **factory)
                d = config.proj_dim
            # W_h split into its query and key halves; the key half carries b_h.
            self.pair_query = nn.Linear(d, widths[0], bias=False, **factory)
            self.pair_key = nn.Linear(d, widths[0], bias=True, **factory)
        self.deeper = nn.ModuleList(nn.Linear(a, b, **factory) for a, b in itertools.pairwise(widths))
        self.output = nn.Linear(widths[-1], 1, bias=False, **factory)  # w_a
        if config.has_gates:
            self.gate = nn.Parameter(torch.empty(geometry.num_heads, **factory))
        else:
            self.register_parameter("gate", None)
        self.init_parameters()

    def head_layout(self) -> dict[str, HeadLayout]:
        """The MLP and the projections serve every head (shared, as in the authors' code); the gates are per head."""
        return {
            name: HeadLayout.PER_HEAD if name == "gate" else HeadLayout.SHARED for name, _ in self.named_parameters()
        }

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        # The first map that reads q and k is drawn so its outputs have unit scale. PyTorch's default
        # ignores the input scale: on a model whose q, k entries are small, P_i + R_j would sit in the
        # activation's linear range, where the pair MLP collapses to a query constant (which softmax
        # drops) plus a key bias. A typical q entry is estimated from the pretrained W_Q's scale,
        # assuming the unit-scale normalised hidden states that attention blocks read.
        q_scale = self.geometry.query_weight_std * self.geometry.hidden_size**0.5
        if self.pair_weight is not None:
            # Z = sum over d products of two entries of scale q_scale: unit scale with weights at
            # 1 / (q_scale^2 sqrt(d)).
            scale = 1.0 / (max(q_scale, 1e-6) ** 2 * self.geometry.head_dim**0.5)
            nn.init.normal_(self.pair_weight, 0.0, scale)
            nn.init.zeros_(self.pair_bias)
        elif q_scale > 0:
            for layer in (
                (self.query_down, self.key_down)
                if self.query_down is not None
                else (
                    self.pair_query,
                    self.pair_key,
                )
            ):
                nn.init.normal_(layer.weight, 0.0, 1.0 / (q_scale * layer.in_features**0.5))
        if self.config.mode == "replace":
            return
        if self.config.init == "zero":
            self.output.weight.zero_()
            self.gate.zero_()
            return
        # Mirrored pairs on the last hidden layer: duplicate the rows that produce it, give the copies
        # opposite output weights. Each pair's terms cancel (outputs unchanged, to rounding) while the
        # output weights and the last layer's rows get a gradient on the first backward.
        if len(self.deeper):
            producers = [(self.deeper[-1].weight, self.deeper[-1].bias)]
        elif self.pair_weight is not None:
            producers = [(self.pair_weight, self.pair_bias)]
        else:
            producers = [(self.pair_query.weight, None), (self.pair_key.weight, self.pair_key.bias)]
        pairs = self.output.in_features // 2
        output = self.output.weight[0]
        for weight, bias in producers:
            weight[pairs : 2 * pairs] = weight[:pairs]
            if bias is not None:
                bias[pairs : 2 * pairs] = bias[:pairs]
        output[pairs : 2 * pairs] = -output[:pairs]
        output[2 * pairs :] = 0.0  # an odd last unit has no partner
        self.gate.fill_(1.0)

    def relative_units(self, query: torch.Tensor) -> torch.Tensor:
        """M_l q~_i for every unit l: (batch, heads, q, d) -> (batch, heads, h, q, d). Z_ijl is then this row
        dotted with k~_j (plus b_l), see the module doc."""
        n = len(self.pairs[0])
        real, imag, rest = self.pair_weight[:, :n], self.pair_weight[:, n : 2 * n], self.pair_weight[:, 2 * n :]
        # c * z with z = x1 + i x2: (a x1 - b x2) + i (a x2 + b x1), per pair (x1, x2) = (q_first, q_second).
        x1, x2, tail = (query[..., dims].unsqueeze(2) for dims in self.pairs)
        real, imag, rest = (w[None, None, :, None, :] for w in (real, imag, rest))
        parts = torch.cat([real * x1 - imag * x2, real * x2 + imag * x1, rest * tail], dim=-1)
        return parts[..., self.order] if self.order is not None else parts

    def pair_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """A_ij for (batch, heads, q, d) queries and (batch, kv_heads, k, d) keys -> (batch, heads, q, k); the
        hidden layers are (batch, kv_heads, g, q, units, k), each query head against its group's kv head: each
        query row's unit planes side by side, so every layer is a left product on the units and nothing is
        reordered."""
        kv_heads = key.shape[1]
        if self.pair_weight is not None:
            units = group_heads(self.relative_units(query), kv_heads)  # (batch, kv_heads, g, h, q, d)
            batch, _, groups, h, q_len, width = units.shape
            rows = units.transpose(3, 4).reshape(batch, kv_heads, groups * q_len * h, width)
            hidden = (rows @ key.transpose(-1, -2)).view(batch, kv_heads, groups, q_len, h, -1)
            hidden = self.act(hidden + self.pair_bias[:, None])
        else:
            if self.query_down is not None:
                query, key = self.query_down(query), self.key_down(key)
            per_query = group_heads(self.pair_query(query), kv_heads).unsqueeze(-1)  # (batch, kv_heads, g, q, h, 1)
            # (batch, kv_heads, 1, 1, h, k), contiguous: the sum below then comes out in the planes layout (a
            # transposed view would lead it to another memory order, and its backward off the vectorised path).
            per_key = self.pair_key(key).transpose(-1, -2).contiguous()[:, :, None, None]
            hidden = self.act(per_query + per_key)
        if self.deeper:
            # Deeper layers act on the units of every row: each weight times the row's (units, k) planes. (A matmul
            # of the 2-D weight against the batched planes would transpose them into a copy first.)
            shape = hidden.shape
            planes = hidden.reshape(-1, shape[-2], shape[-1])
            for layer in self.deeper:
                weight = layer.weight.expand(planes.shape[0], -1, -1)
                planes = self.act(torch.baddbmm(layer.bias[:, None], weight, planes))
            hidden = planes.view(*shape[:-2], *planes.shape[-2:])
        # The output layer w_a: a weighted sum of the unit planes (one pass, and one in backward).
        return (hidden * self.output.weight[0, :, None]).sum(-2).flatten(1, 2)

    def scores(self, query, key, extras, scaling: float) -> torch.Tensor:
        mlp = self.pair_scores(query, key)
        if self.gate is None:
            return mlp * scaling if self.config.scale_mlp else mlp
        dot = grouped_matmul(query, key.transpose(-1, -2)) * scaling
        return dot + self.gate.view(1, -1, 1, 1) * mlp

    def fused_unsupported_reason(self) -> str | None:
        if self.config.depth != 1:
            return f"the fused Neural Attention term has one hidden layer, this scorer has depth={self.config.depth}"
        if self.pair_weight is not None and self.gate is None:
            return (
                "relative-input Neural Attention in replace mode has no fused form (the fused query-network term is "
                "gated)"
            )
        return None

    def fused_inputs(self, query, key, extras):
        """The pair-MLP term: the first layer's query half P (batch, heads, q_len, h) and key half
        R (batch, kv_heads, kv_len, h), b_h included in R, the output weights w_a and the gate (None in
        replace mode). ``key`` is not repeated for grouped-query attention, so R costs kv_heads, not heads,
        projections."""
        if self.pair_weight is not None:
            # Relative input: the query-network term (QANA's) with U = M q~, V = w and b the same for every query,
            # c = 0.
            units = self.relative_units(query)
            batch, heads, q_len, h = *query.shape[:3], self.config.h
            per_query = (batch, heads, q_len, h)
            V = self.output.weight[0].expand(per_query).contiguous()
            b = self.pair_bias.expand(per_query).contiguous()
            c = query.new_zeros(batch, heads, q_len, 1)
            return FusedInputs(QUERY_NETWORK, (units, V, b, c, self.gate), self.config.activation, h)
        if self.query_down is not None:
            query, key = self.query_down(query), self.key_down(key)
        tensors = (self.pair_query(query), self.pair_key(key), self.output.weight[0], self.gate)
        return FusedInputs(PAIR_MLP, tensors, self.config.activation, self.config.h, self.config.scale_mlp)
