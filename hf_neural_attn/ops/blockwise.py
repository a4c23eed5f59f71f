"""Blockwise attention for the pair-MLP score terms, in plain torch: the fused kernels' math, one query block
at a time, with a hand-written backward.

It serves the scorers that hand the fused kernels a :class:`~hf_neural_attn.ops.triton.FusedInputs` (QANA and
one-hidden-layer Neural Attention), on any device, and is what ``impl="chunked"`` runs for them. The generic
chunked path (:mod:`.chunked`) recomputes a block's scores through the scorer's own autograd graph; that costs
the scorer's layout (the h hidden units innermost, the output layer an (n·n, h) x (h, 1) product) and a second
evaluation of every pair activation in backward. Here:

* each hidden unit l is a (block, n) plane: QANA's ``U_l · kᵀ + b_l`` is one matmul per unit, Neural
  Attention's ``P_il + R_jl`` one broadcast add, and the output layer is a weighted sum of h planes;
* backward evaluates each pre-activation plane once and uses it both to rebuild the probabilities and for
  the gradients; the activation's derivative comes with its value (:data:`_ACTIVATIONS`);
* the softmax gradient uses ``rowsum(P ⊙ dP) = dO · O`` (one (n, d) product instead of a pass over the block);
* grouped-query attention reads each key/value head once for its group of query heads: queries are viewed
  as (batch, kv_heads, groups, ...) and keys broadcast over the groups, nothing is repeated;
* a purely causal call needs no mask tensor: each block masks its own diagonal.

Numerics match the reference path to fp32 rounding: scores and softmax statistics in fp32 (fp64 stays fp64),
the row maximum and normaliser saved rather than their log-sum-exp (see :mod:`.chunked`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .masks import apply_mask, block_mask, query_blocks

# name -> (activation, its backward: (grad, pre-activation, activation value) -> grad * derivative). The backward
# ops are aten's own fused ones (what autograd runs for these functions), one pass each over a plane.
_ACTIVATIONS: dict[str, tuple[Callable, Callable]] = {
    "gelu": (F.gelu, lambda grad, z, value: torch.ops.aten.gelu_backward(grad, z)),
    "relu": (F.relu, lambda grad, z, value: torch.ops.aten.threshold_backward(grad, z, 0)),
    "silu": (F.silu, lambda grad, z, value: torch.ops.aten.silu_backward(grad, z)),
    "tanh": (torch.tanh, lambda grad, z, value: torch.ops.aten.tanh_backward(grad, value)),
    "sigmoid": (torch.sigmoid, lambda grad, z, value: torch.ops.aten.sigmoid_backward(grad, value)),
}


def blockwise_unsupported_reason(activation: str | None) -> str | None:
    """Why this path cannot serve a fused term with hidden-layer ``activation``, or None."""
    if activation not in _ACTIVATIONS:
        return f"activation {activation!r} has no derivative here (known: {sorted(_ACTIVATIONS)})"
    return None


def blockwise_attention(
    inputs, query, key, value, attention_mask, *, scaling: float, is_causal: bool, block: int = 128
):
    """softmax(scores + mask) @ v, the scores given by ``inputs`` (a ``FusedInputs``), a query block at a time.

    Args:
        inputs: the scorer's fused term (``"qana"``: U, V, b, c, gate; ``"neural"``: P, R, w, gate), see
            :mod:`hf_neural_attn.ops.triton.fused`; gradients flow back through them to the scorer.
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing heads (not repeated).
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            (batch, heads, q_len, kv_len).
        is_causal: causal, queries aligned to the end of the keys. Keys after a block's last query are never
            scored; with ``attention_mask`` None the block masks its diagonal itself.
        block: queries per block (the chunked path passes its ``QUERY_BLOCK``).

    Returns:
        output (batch, heads, q_len, value_dim).
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads or value.shape[1] != kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of the key/value heads ({kv_heads}).")
    return _BlockwisePairAttention.apply(
        inputs.term, inputs.activation, float(scaling), bool(is_causal), int(block), attention_mask, query, key, value,
        *inputs.tensors,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ layout


def _grouped(tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, ...) -> (batch, kv_heads, groups, ...), a view."""
    return tensor.unflatten(1, (kv_heads, tensor.shape[1] // kv_heads))


def _grouped_mask(mask: torch.Tensor | None, kv_heads: int) -> torch.Tensor | None:
    """A (batch or 1, heads or 1, q or 1, kv) mask as (batch or 1, kv_heads or 1, groups or 1, q or 1, kv)."""
    if mask is None:
        return None
    if mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return _grouped(mask, kv_heads) if mask.shape[1] > 1 else mask.unsqueeze(1)


# ------------------------------------------------------------------------------------------------ the math


class _Term:
    """One call's pair-MLP term in the grouped layout, and the per-block pieces forward and backward share.

    A block's hidden layer is one tensor Z (batch, kv_heads, groups, h, block, kv_end): the h units are planes
    over (query, key), so every step is a matmul or an elementwise pass over contiguous key rows.
    """

    def __init__(self, term, activation, scaling, tensors, key, kv_heads, stats_dtype):
        self.term, self.scaling, self.stats_dtype = term, scaling, stats_dtype
        self.activate, self.activation_backward = _ACTIVATIONS[activation]
        self.key = key  # (batch, kv_heads, kv_len, d), kv heads not repeated
        self.kv_heads = kv_heads
        if term == "qana":
            U, V, b, c, gate = tensors
            self.U = _grouped(U, kv_heads)  # (batch, kv_heads, groups, h, q, d)
            # (batch, kv_heads, groups, h, q, 1): per query and unit
            # (contiguous: a plane's layout decides the layout, and the speed, of every pass over it)
            self.V, self.b = (_grouped(t, kv_heads).transpose(-1, -2).unsqueeze(-1).contiguous() for t in (V, b))
            self.c = _grouped(c, kv_heads)  # (batch, kv_heads, groups, q, 1)
            self.hidden = U.shape[2]
        else:
            P, R, w, gate = tensors
            # (batch, kv_heads, groups, h, q, 1) and (batch, kv_heads, 1, h, 1, kv_len), contiguous as above
            self.P = _grouped(P, kv_heads).transpose(-1, -2).unsqueeze(-1).contiguous()
            self.R = R.transpose(-1, -2).unsqueeze(2).unsqueeze(-2).contiguous()
            self.w = w
            self.hidden = P.shape[-1]
        self.gate = gate.view(kv_heads, -1, 1, 1) if gate is not None else None  # (kv_heads, groups, 1, 1)

    def query_units(self, rows) -> torch.Tensor:
        """QANA's U rows of a block as (batch, kv_heads, groups * h * block, d)."""
        U = self.U[..., rows, :]
        return U.reshape(U.shape[0], U.shape[1], -1, U.shape[-1])

    def pre_activation(self, rows, kv_end) -> torch.Tensor:
        """Z of a block: (batch, kv_heads, groups, h, block, kv_end), in the stats dtype."""
        if self.term == "qana":
            U = self.query_units(rows)
            z = (U @ self.key[..., :kv_end, :].transpose(-1, -2).to(U.dtype)).to(self.stats_dtype)
            z = z.view(*self.U.shape[:4], -1, kv_end)
            return z + self.b[..., rows, :].to(self.stats_dtype)
        P = self.P[..., rows, :].to(self.stats_dtype)
        return P + self.R[..., :kv_end].to(self.stats_dtype)

    def combine(self, activated, rows) -> torch.Tensor:
        """The MLP term (batch, kv_heads, groups, block, kv_end) from the activated units."""
        if self.term == "qana":
            return (activated * self.V[..., rows, :].to(self.stats_dtype)).sum(-3) + self.c[..., rows, :].to(
                self.stats_dtype
            )
        w = self.w.to(self.stats_dtype).view(1, -1)  # (1, h) @ (h, block * kv_end)
        return (w @ activated.flatten(-2)).view(*activated.shape[:-3], *activated.shape[-2:])

    def scores(self, query, rows, kv_end):
        """Logits of a block before the mask, its MLP term, Z and act(Z)."""
        z = self.pre_activation(rows, kv_end)
        activated = self.activate(z)
        mlp = self.combine(activated, rows)
        if self.gate is None:  # Neural Attention, replace form
            return self.scaling * mlp, mlp, z, activated
        dot = (query[..., rows, :] @ self.key[..., :kv_end, :].unsqueeze(2).transpose(-1, -2)).to(self.stats_dtype)
        return dot * self.scaling + self.gate.to(self.stats_dtype) * mlp, mlp, z, activated


def _sum_over_groups(blocks: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Σ over groups and rows of blocksᵀ @ other, as one matmul: blocks (batch, kv_heads, *G, block, n) and
    other (batch, kv_heads, *G, block, d) -> (batch, kv_heads, n, d)."""
    batch, kv_heads = blocks.shape[:2]
    return blocks.reshape(batch, kv_heads, -1, blocks.shape[-1]).transpose(-1, -2) @ other.reshape(
        batch, kv_heads, -1, other.shape[-1]
    )


class _BlockwisePairAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, term, activation, scaling, is_causal, block, mask, query, key, value, *tensors):
        q_len, kv_heads, kv_len = query.shape[2], key.shape[1], key.shape[2]
        stats_dtype = torch.promote_types(query.dtype, torch.float32)
        grouped_query = _grouped(query, kv_heads)
        grouped_value = value.unsqueeze(2)
        grouped_mask = _grouped_mask(mask, kv_heads)
        state = _Term(term, activation, scaling, tensors, key, kv_heads, stats_dtype)
        output = torch.empty(*grouped_query.shape[:-1], value.shape[-1], dtype=value.dtype, device=value.device)
        row_max = torch.empty(grouped_query.shape[:-1], dtype=stats_dtype, device=query.device)
        row_sum = torch.empty_like(row_max)
        for start, end, kv_end in query_blocks(q_len, kv_len, is_causal, block):
            rows = slice(start, end)
            scores = state.scores(grouped_query, rows, kv_end)[0]
            rows_mask = block_mask(grouped_mask, is_causal, start, end, kv_end, q_len, kv_len, query.device)
            scores = apply_mask(scores, rows_mask)
            block_max = scores.amax(dim=-1, keepdim=True)
            exps = torch.exp(scores - block_max)
            block_sum = exps.sum(dim=-1, keepdim=True)
            probs = (exps / block_sum).to(value.dtype)
            output[..., rows, :] = probs @ grouped_value[..., :kv_end, :]
            row_max[..., rows], row_sum[..., rows] = block_max.squeeze(-1), block_sum.squeeze(-1)
        ctx.meta = (term, activation, scaling, is_causal, block)
        ctx.save_for_backward(mask, query, key, value, output, row_max, row_sum, *tensors)
        return output.flatten(1, 2)

    @staticmethod
    def backward(ctx, grad_output):
        mask, query, key, value, output, row_max, row_sum, *tensors = ctx.saved_tensors
        term, activation, scaling, is_causal, block = ctx.meta
        q_len, kv_heads, kv_len = query.shape[2], key.shape[1], key.shape[2]
        stats_dtype = row_max.dtype
        grouped_query = _grouped(query, kv_heads)
        grouped_mask = _grouped_mask(mask, kv_heads)
        state = _Term(term, activation, scaling, tensors, key, kv_heads, stats_dtype)
        grad_output = _grouped(grad_output, kv_heads).to(stats_dtype)
        # rowsum(P * dP) per query row is dO . O: the softmax backward's correction, without a pass over P.
        correction = (grad_output * output.to(stats_dtype)).sum(-1, keepdim=True)
        key_f, value_f = key.to(stats_dtype), value.to(stats_dtype)
        query_f = grouped_query.to(stats_dtype)

        grad_query = torch.zeros_like(query_f)
        grad_key = torch.zeros_like(key_f)
        grad_value = torch.zeros_like(value_f)
        gated = state.gate is not None
        grad_gate = torch.zeros(state.gate.shape, dtype=stats_dtype, device=query.device) if gated else None
        if term == "qana":
            grad_U = torch.zeros(state.U.shape, dtype=stats_dtype, device=query.device)
            grad_V = torch.zeros(state.V.shape, dtype=stats_dtype, device=query.device)
            grad_b = torch.zeros_like(grad_V)
            grad_c = torch.zeros(state.c.shape, dtype=stats_dtype, device=query.device)
        else:
            grad_P = torch.zeros(state.P.shape, dtype=stats_dtype, device=query.device)
            grad_R = torch.zeros(state.R.shape, dtype=stats_dtype, device=query.device)
            grad_w = torch.zeros(state.hidden, dtype=stats_dtype, device=query.device)

        for start, end, kv_end in query_blocks(q_len, kv_len, is_causal, block):
            rows = slice(start, end)
            # Z is evaluated once per block, for the probabilities and for every gradient below.
            scores, mlp, z, activated = state.scores(grouped_query, rows, kv_end)
            rows_mask = block_mask(grouped_mask, is_causal, start, end, kv_end, q_len, kv_len, query.device)
            scores = apply_mask(scores, rows_mask)
            probs = torch.exp(scores - row_max[..., rows, None]) / row_sum[..., rows, None]
            del scores
            grad_block = grad_output[..., rows, :]
            grad_value[..., :kv_end, :] += _sum_over_groups(probs, grad_block)
            grad_probs = grad_block @ value_f[..., :kv_end, :].unsqueeze(2).transpose(-1, -2)
            grad_scores = probs * (grad_probs - correction[..., rows, :])
            del probs, grad_probs
            keys = key_f[..., :kv_end, :]
            if gated:
                grad_query[..., rows, :] += scaling * (grad_scores @ keys.unsqueeze(2))
                grad_key[..., :kv_end, :] += scaling * _sum_over_groups(grad_scores, query_f[..., rows, :])
                grad_gate += (grad_scores * mlp).sum(dim=(0, 3, 4))[..., None, None]
                grad_mlp = grad_scores * state.gate.to(stats_dtype)
            else:
                grad_mlp = grad_scores * scaling
            del grad_scores, mlp
            grad_mlp = grad_mlp.unsqueeze(-3)  # against the h unit planes
            if term == "qana":
                grad_c[..., rows, :] += grad_mlp.sum(-1).squeeze(-2).unsqueeze(-1)
                grad_V[..., rows, :] += (grad_mlp * activated).sum(-1, keepdim=True)
                grad_units = state.activation_backward(grad_mlp * state.V[..., rows, :].to(stats_dtype), z, activated)
                grad_b[..., rows, :] += grad_units.sum(-1, keepdim=True)
                flat_units = grad_units.flatten(2, 4)  # (batch, kv_heads, groups * h * block, kv_end)
                grad_U[..., rows, :] += (flat_units @ keys).view(grad_U[..., rows, :].shape)
                grad_key[..., :kv_end, :] += flat_units.transpose(-1, -2) @ state.query_units(rows).to(stats_dtype)
            else:
                w = state.w.to(stats_dtype).view(-1, 1, 1)
                grad_w += (activated * grad_mlp).sum(dim=(0, 1, 2, 4, 5))
                grad_units = state.activation_backward(grad_mlp * w, z, activated)
                grad_P[..., rows, :] += grad_units.sum(-1, keepdim=True)
                grad_R[..., :kv_end] += grad_units.sum(dim=(2, 4), keepdim=True)
            del z, activated, grad_units, grad_mlp

        needs = ctx.needs_input_grad
        grads = [
            grad_query.flatten(1, 2).to(query.dtype) if needs[6] else None,
            grad_key.to(key.dtype) if needs[7] else None,
            grad_value.to(value.dtype) if needs[8] else None,
        ]
        if term == "qana":
            U, V, b, c, gate = tensors
            term_grads = [
                grad_U.flatten(1, 2).to(U.dtype),
                grad_V.squeeze(-1).transpose(-1, -2).flatten(1, 2).to(V.dtype),
                grad_b.squeeze(-1).transpose(-1, -2).flatten(1, 2).to(b.dtype),
                grad_c.flatten(1, 2).to(c.dtype),
            ]
        else:
            P, R, w, gate = tensors
            term_grads = [
                grad_P.squeeze(-1).transpose(-1, -2).flatten(1, 2).to(P.dtype),
                grad_R.squeeze(-2).squeeze(2).transpose(-1, -2).to(R.dtype),
                grad_w.to(w.dtype),
            ]
        term_grads.append(grad_gate.reshape(-1).to(gate.dtype) if gated else None)
        # forward's arguments: term, activation, scaling, is_causal, block, mask, query, key, value, *tensors
        term_grads = [g if needs[9 + i] else None for i, g in enumerate(term_grads)]
        return (None, None, None, None, None, None, *grads, *term_grads)
