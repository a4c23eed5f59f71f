"""The pair-MLP term on the blockwise path (:data:`hf_neural_attn.ops.terms.PAIR_MLP`): the first layer split into
a query half P_i and a key half R_j, so Z_ilj = P_il + R_jl; output weights w_l shared by every row, and a per-head
gate, or none (the replace form: the scaled MLP alone, no dot product).

See :mod:`hf_neural_attn.ops.blockwise` for the layout every term shares.
"""

from __future__ import annotations

import torch

from ..grouped import group_heads
from .common import BlockwiseTerm


class PairMLPTerm(BlockwiseTerm):
    """The pair-MLP term of one call: tensors P, R, w, gate (:mod:`hf_neural_attn.ops.terms`)."""

    def __init__(self, activation, scaling, tensors, query, key, stats_dtype):
        super().__init__(activation, scaling, query, key, stats_dtype)
        kv_heads = key.shape[1]
        P, R, w, gate = tensors
        self.scaling = scaling
        self.hidden = P.shape[-1]
        self.P = group_heads(P, kv_heads).unsqueeze(-1).to(stats_dtype)  # (B, q, h, 1)
        # (batch, kv_heads, 1, 1, h, kv_len): against every query row of the group
        self.R = R.transpose(-1, -2)[:, :, None, None].to(stats_dtype).contiguous()
        self.gate = gate.view(kv_heads, -1, 1, 1) if gate is not None else None
        # Gated: dot + gate * w . act(Z); replace form: scaling * w . act(Z).
        head_weights = w * (self.gate if self.gate is not None else scaling)  # (kv_heads, groups, 1, h) or (h,)
        self.unit_weights = head_weights.to(stats_dtype).expand(*self.scaled_query.shape[:-1], self.hidden)

    def hidden_planes(self, rows, kv_end):
        P, R = self.P[..., rows, :, :], self.R[..., :kv_end]
        return torch.add(P, R, out=self.buffer("z", (*P.shape[:-1], kv_end), self.stats_dtype))

    def begin_backward(self):
        self.grad_P, self.grad_R = self.per_row(self.P.shape), self.zeros(self.R.shape)

    def add_unit_grads(self, rows, kv_end, grad_units, grad_key):
        # The keys reach Z through R only: R's gradient carries their share, and grad_key takes none here.
        self.grad_P[..., rows, :, :] = grad_units.sum(-1, keepdim=True)
        self.grad_R[..., :kv_end] += grad_units.sum(dim=(2, 3), keepdim=True)

    def tensor_grads(self, grad_weights, tensors):
        P, R, w, gate = tensors
        per_head_unit = grad_weights.sum(dim=(0, 3))  # (kv_heads, groups, h)
        if self.gate is not None:
            grad_w = (per_head_unit * self.gate[..., 0]).sum(dim=(0, 1))
            grad_gate = (per_head_unit * w.to(self.stats_dtype)).sum(-1).reshape(-1).to(gate.dtype)
        else:
            grad_w, grad_gate = per_head_unit.sum(dim=(0, 1)) * self.scaling, None
        return [
            self.grad_P.squeeze(-1).flatten(1, 2).to(P.dtype),
            self.grad_R[:, :, 0, 0].transpose(-1, -2).to(R.dtype),
            grad_w.to(w.dtype),
            grad_gate,
        ]
