"""The query-network term on the blockwise path (:data:`hf_neural_attn.ops.terms.QUERY_NETWORK`): each query row
i carries h unit rows U_il, output weights V_il, biases b_il and a shift c_i, and Z_ilj = U_il . k_j + b_il.

Laid out for few passes (see :mod:`hf_neural_attn.ops.blockwise` for what every term shares):

* the pre-activations, bias included, are one matmul: the bias is a last column of the query's unit rows
  against a column of ones appended to the keys, and in backward the same product returns its gradient;
* ``c`` adds the same number to every logit of a query row, which the softmax cancels: it is never added, and
  its gradient is exactly zero.
"""

from __future__ import annotations

import torch

from ..grouped import group_heads
from .common import BlockwiseTerm


class QueryNetworkTerm(BlockwiseTerm):
    """The query-network term of one call: tensors U, V, b, c, gate (:mod:`hf_neural_attn.ops.terms`)."""

    def __init__(self, activation, scaling, tensors, query, key, stats_dtype):
        super().__init__(activation, scaling, query, key, stats_dtype)
        kv_heads = key.shape[1]
        U, V, b, _, gate = tensors  # c: see the module doc
        self.hidden = U.shape[2]
        # Unit rows [U_il, b_il] (B, q, h, d + 1) against keys [k_j, 1] (batch, kv_heads, kv_len, d + 1).
        units = group_heads(U, kv_heads).transpose(3, 4)
        self.unit_rows = torch.cat([units, group_heads(b, kv_heads).unsqueeze(-1).to(units.dtype)], -1)
        self.rows_keys = torch.cat([key, key.new_ones(*key.shape[:-1], 1)], -1).to(units.dtype)
        self.gate = gate.view(kv_heads, -1, 1, 1)  # (kv_heads, groups, 1, 1), one per query head
        # (B, q, h): V times the gate, per query row and unit.
        self.unit_weights = (group_heads(V, kv_heads) * self.gate).to(stats_dtype)

    def hidden_planes(self, rows, kv_end):
        unit_rows = self.unit_rows[..., rows, :, :]
        batch, kv_heads = unit_rows.shape[:2]
        flat = unit_rows.reshape(batch, kv_heads, -1, unit_rows.shape[-1])  # (batch, kv_heads, G*block*h, d+1)
        keys = self.rows_keys[..., :kv_end, :].transpose(-1, -2)
        z = self.buffer("z", (*flat.shape[:-1], kv_end), self.stats_dtype)
        if flat.dtype == z.dtype:
            torch.matmul(flat, keys, out=z)
        else:
            z.copy_(flat @ keys)
        # The dot product is a matmul of its own: sharing the units' would leave Z's planes strided, and the
        # elementwise passes over strided planes are slower than the saved call.
        return z.view(*unit_rows.shape[:-1], kv_end)

    def begin_backward(self):
        self.grad_unit_rows = self.per_row(self.unit_rows.shape)  # (B, q, h, d + 1)
        self.keys_with_ones = self.rows_keys.to(self.stats_dtype)
        self.units = self.unit_rows[..., :-1].to(self.stats_dtype).contiguous()  # (B, q, h, d), row-major

    def add_unit_grads(self, rows, kv_end, grad_units, grad_key):
        flat_units = grad_units.flatten(2, 4)  # (batch, kv_heads, G*block*h, kv_end)
        rows_shape = self.grad_unit_rows[..., rows, :, :].shape
        self.grad_unit_rows[..., rows, :, :] = (flat_units @ self.keys_with_ones[..., :kv_end, :]).view(rows_shape)
        grad_key[..., :kv_end, :] += flat_units.transpose(-1, -2) @ self.units[..., rows, :, :].flatten(2, 4)

    def tensor_grads(self, grad_weights, tensors):
        U, V, b, _, gate = tensors
        grouped_V = group_heads(V, self.key.shape[1]).to(self.stats_dtype)
        return [
            self.grad_unit_rows[..., :-1].transpose(3, 4).flatten(1, 2).to(U.dtype),
            (grad_weights * self.gate).flatten(1, 2).to(V.dtype),
            self.grad_unit_rows[..., -1].flatten(1, 2).to(b.dtype),
            # c shifts every logit of its query row alike, which the softmax cancels: its gradient is zero
            # (None: autograd's zero, without allocating one).
            None,
            (grad_weights * grouped_V).sum(dim=(0, 3, 4)).reshape(-1).to(gate.dtype),
        ]
