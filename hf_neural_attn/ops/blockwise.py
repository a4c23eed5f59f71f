"""Blockwise attention for the pair-MLP score terms, in plain torch: the fused kernels' math, one query block
at a time, with a hand-written backward.

It serves the scorers that hand the fused paths a :class:`~hf_neural_attn.ops.terms.FusedInputs` (QANA and
one-hidden-layer Neural Attention), on any device, and is what ``impl="chunked"`` runs for them. The generic
chunked path (:mod:`.chunked`) recomputes a block's scores through the scorer's own autograd graph; that costs
the scorer's layout and a second evaluation of every pair activation in backward.

On a CPU this path is bound by its matrix products and by the elementwise passes over the block's h
hidden-unit planes (each the size of the block's score matrix), so it is laid out to make few passes:

* a block's hidden layer is Z (batch, kv_heads, groups, block, h, kv_end), contiguous: each query row's h unit
  planes are adjacent, so the output layer (row i's own weights times its (h, kv_end) planes) is one batched
  matrix-vector product that also adds the dot product, and the softmax passes read and write one plane;
* QANA's pre-activations, bias included, are one matmul: the bias is a last column of the query's unit rows
  against a column of ones appended to the keys, and in backward the same product returns its gradient;
* QANA's ``c`` adds the same number to every logit of a query row, which the softmax cancels: it is never
  added, and its gradient is exactly zero;
* backward evaluates each pre-activation plane once and uses it both to rebuild the probabilities and for
  the gradients; dZ is one product ``dS · weight`` with the activation's derivative applied in place
  (:data:`_ACTIVATIONS`);
* the softmax gradient uses ``rowsum(P ⊙ dP) = dO · O`` (one (n, d) product instead of a pass over the block),
  and forward normalises the (block, d) output rather than the (block, kv_end) weights;
* grouped-query attention reads each key/value head once for its group of query heads: queries are viewed
  as (batch, kv_heads, groups, ...) and keys broadcast over the groups, nothing is repeated;
* a purely causal call needs no mask tensor: each block masks the (block, block) corner where its queries
  meet their own keys, the only part of it the causal mask hides.

Blocks are :data:`QUERY_BLOCK` query rows: larger blocks make every pass over the unit planes bigger, smaller ones
make more calls (the sizes measured are in docs/benchmarks.md).

Numerics match the reference path to fp32 rounding: scores and softmax statistics in fp32 (fp64 stays fp64),
the row maximum and normaliser saved rather than their log-sum-exp (see :mod:`.chunked`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .dropout import AttentionDropout
from .grouped import group_heads, grouped_transposed_matmul
from .masks import apply_mask, block_mask, query_blocks
from .terms import FusedInputs

# Query rows per block, with every head at once: the fastest block size of those measured on a CPU
# (docs/benchmarks.md, "block size").
QUERY_BLOCK = 64

# name -> (activation in place, activation into a given tensor, its backward: (grad, pre-activation, activation
# value) -> grad * derivative, written into grad). The backward ops are aten's own fused ones (what autograd runs
# for these functions), one pass each over a plane. None of them allocates: see _Term.buffer.
_ACTIVATIONS: dict[str, tuple[Callable, Callable, Callable]] = {
    "gelu": (
        torch.ops.aten.gelu_,
        lambda z, out: torch.ops.aten.gelu.out(z, out=out),
        lambda grad, z, value: torch.ops.aten.gelu_backward.grad_input(grad, z, grad_input=grad),
    ),
    "relu": (
        torch.relu_,
        lambda z, out: torch.clamp_min(z, 0, out=out),
        lambda grad, z, value: torch.ops.aten.threshold_backward.grad_input(grad, z, 0, grad_input=grad),
    ),
    "silu": (
        torch.ops.aten.silu_,
        lambda z, out: torch.ops.aten.silu.out(z, out=out),
        lambda grad, z, value: torch.ops.aten.silu_backward.grad_input(grad, z, grad_input=grad),
    ),
    "tanh": (
        torch.tanh_,
        lambda z, out: torch.tanh(z, out=out),
        lambda grad, z, value: torch.ops.aten.tanh_backward.grad_input(grad, value, grad_input=grad),
    ),
    "sigmoid": (
        torch.sigmoid_,
        lambda z, out: torch.sigmoid(z, out=out),
        lambda grad, z, value: torch.ops.aten.sigmoid_backward.grad_input(grad, value, grad_input=grad),
    ),
}


def blockwise_unsupported_reason(activation: str | None) -> str | None:
    """Why this path cannot serve a fused term with hidden-layer ``activation``, or None."""
    if activation not in _ACTIVATIONS:
        return f"activation {activation!r} has no derivative here (known: {sorted(_ACTIVATIONS)})"
    return None


def blockwise_attention(
    inputs: FusedInputs,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float,
    is_causal: bool,
    dropout: AttentionDropout | None = None,
    block: int | None = None,
    rows_seeing_all: tuple[int, ...] = (),
) -> torch.Tensor:
    """softmax(scores + mask) @ v, the scores given by ``inputs``' term, a query block at a time.

    Args:
        inputs: the scorer's fused term (``"qana"``: U, V, b, c, gate; ``"neural"``: P, R, w, gate), see
            :mod:`hf_neural_attn.ops.terms`; gradients flow back through them to the scorer.
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim), kv_heads dividing heads (not repeated).
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            (batch, heads, q_len, kv_len).
        is_causal: causal, queries aligned to the end of the keys. Keys after a block's last query are never
            scored; with ``attention_mask`` None the block masks its diagonal itself.
        dropout: the call's attention dropout (:class:`.dropout.AttentionDropout`), or None; each block's mask is
            regenerated in backward.
        block: queries per block; default :data:`QUERY_BLOCK`.
        rows_seeing_all: query rows an additive mask hides every key from; their blocks score every key
            (:func:`.masks.query_blocks`).

    Returns:
        output (batch, heads, q_len, value_dim).
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads or value.shape[1] != kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of the key/value heads ({kv_heads}).")
    block = QUERY_BLOCK if block is None else block
    scaling = inputs.term_scaling(scaling)
    return _BlockwisePairAttention.apply(
        inputs.term, inputs.activation, float(scaling), (bool(is_causal), tuple(rows_seeing_all)), int(block), dropout,
        attention_mask, query, key, value, *inputs.tensors,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ layout


def _grouped_mask(mask: torch.Tensor | None, kv_heads: int) -> torch.Tensor | None:
    """A (batch or 1, heads or 1, q or 1, kv) mask as (batch or 1, kv_heads or 1, groups or 1, q or 1, kv)."""
    if mask is None:
        return None
    if mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return group_heads(mask, kv_heads) if mask.shape[1] > 1 else mask.unsqueeze(1)


class _BlockMasker:
    """Masks a block's logits (B, block, kv_end) in place, like :func:`.masks.apply_mask` (blocked logits at the
    dtype's minimum), for one call's mask and blocks."""

    def __init__(self, mask, kv_heads, is_causal, q_len, kv_len, block, device):
        self.mask = _grouped_mask(mask, kv_heads)
        self.is_causal, self.q_len, self.kv_len = is_causal, q_len, kv_len
        # With no mask tensor and is_causal, only the columns from a block's first query position on can be
        # hidden: the (block, block) corner where its queries meet their own keys, the same triangle for
        # every block (queries aligned to the end of the keys, so kv_len >= q_len).
        self.corner = None
        if mask is None and is_causal and kv_len >= q_len:
            self.corner = torch.ones(block, block, dtype=torch.bool, device=device).triu_(1)

    def __call__(self, scores, start, end, kv_end) -> None:
        if self.corner is not None:
            first = start + self.kv_len - self.q_len
            lowest = torch.finfo(scores.dtype).min  # as apply_mask blocks a logit
            scores[..., first:kv_end].masked_fill_(self.corner[: end - start, : kv_end - first], lowest)
            return
        rows_mask = block_mask(self.mask, self.is_causal, start, end, kv_end, self.q_len, self.kv_len, scores.device)
        apply_mask(scores, rows_mask, inplace=True)


# ------------------------------------------------------------------------------------------------ the math


class _Term:
    """One call's pair-MLP term in the grouped, row-major layout, and the per-block pieces forward and backward
    share. ``B`` below stands for (batch, kv_heads, groups) and ``G`` for the groups axis alone.

    A block's logits are ``dot + Σ_l weight_il · act(Z_ilj)``: ``dot`` the scaled dot product (None in Neural
    Attention's replace form), ``weight`` the output layer's per-row unit weights (:attr:`unit_weights`).
    """

    def __init__(self, term, activation, scaling, tensors, query, key, stats_dtype):
        kv_heads = key.shape[1]
        self.term, self.stats_dtype = term, stats_dtype
        self.activate_, self.activate_into, self.activation_backward = _ACTIVATIONS[activation]
        self.buffers: dict[str, torch.Tensor] = {}
        self.key = key  # (batch, kv_heads, kv_len, d), kv heads not repeated
        # The dot product's query side, scaled once: (B, q, d).
        self.scaled_query = group_heads(query, kv_heads) * scaling
        if term == "qana":
            U, V, b, _, gate = tensors  # c: see the module doc
            self.hidden = U.shape[2]
            # Unit rows [U_il, b_il] (B, q, h, d + 1) against keys [k_j, 1] (batch, kv_heads, kv_len, d + 1).
            units = group_heads(U, kv_heads).transpose(3, 4)
            self.unit_rows = torch.cat([units, group_heads(b, kv_heads).unsqueeze(-1).to(units.dtype)], -1)
            self.rows_keys = torch.cat([key, key.new_ones(*key.shape[:-1], 1)], -1).to(units.dtype)
            self.gate = gate.view(kv_heads, -1, 1, 1)  # (kv_heads, groups, 1, 1), one per query head
            # (B, q, h): V times the gate, per query row and unit.
            self.unit_weights = (group_heads(V, kv_heads) * self.gate).to(stats_dtype)
        else:
            P, R, w, gate = tensors
            self.hidden = P.shape[-1]
            self.P = group_heads(P, kv_heads).unsqueeze(-1).to(stats_dtype)  # (B, q, h, 1)
            # (batch, kv_heads, 1, 1, h, kv_len): against every query row of the group
            self.R = R.transpose(-1, -2)[:, :, None, None].to(stats_dtype).contiguous()
            self.gate = gate.view(kv_heads, -1, 1, 1) if gate is not None else None
            # Gated: dot + gate * w . act(Z); replace form: scaling * w . act(Z).
            head_weights = w * (self.gate if self.gate is not None else scaling)  # (kv_heads, groups, 1, h) or (h,)
            self.unit_weights = head_weights.to(stats_dtype).expand(*self.scaled_query.shape[:-1], self.hidden)

    def buffer(self, name: str, shape, dtype) -> torch.Tensor:
        """A contiguous (…, kv_end) tensor that every block of the call reuses, sized at first use for the widest
        block (all kv_len keys). Blocks widen under a causal mask, so fresh tensors would each be larger than any
        freed before; on a CPU their pages are then faulted in anew every block, which measured as much as the
        elementwise pass over them."""
        size = torch.Size(shape).numel()
        store = self.buffers.get(name)
        if store is None or store.numel() < size:
            widest = size // shape[-1] * self.key.shape[-2]
            store = self.buffers[name] = torch.empty(max(size, widest), dtype=dtype, device=self.key.device)
        return store[:size].view(shape)

    def pre_activation(self, rows, kv_end) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Z of a block (B, block, h, kv_end), in the call's buffer "z", and its scaled dot product
        (B, block, kv_end) or None (replace form), both in the stats dtype and contiguous."""
        if self.term == "qana":
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
            z = z.view(*unit_rows.shape[:-1], kv_end)
        else:
            P, R = self.P[..., rows, :, :], self.R[..., :kv_end]
            z = torch.add(P, R, out=self.buffer("z", (*P.shape[:-1], kv_end), self.stats_dtype))
        if self.gate is None:
            return z, None
        keys = self.key[..., :kv_end, :].unsqueeze(2).transpose(-1, -2).to(self.scaled_query.dtype)
        return z, (self.scaled_query[..., rows, :] @ keys).to(self.stats_dtype)

    def scores(self, rows, kv_end, keep_z: bool = True):
        """Logits of a block before the mask (B, block, kv_end), with Z and act(Z) (Z None without ``keep_z``:
        the activation then overwrites it)."""
        z, dot = self.pre_activation(rows, kv_end)
        activated = self.activate_into(z, self.buffer("activated", z.shape, z.dtype)) if keep_z else self.activate_(z)
        # The output layer, per query row: (1, h) weights times the row's (h, kv_end) activated planes.
        flat_weights = self.unit_weights[..., rows, :].reshape(-1, 1, self.hidden)
        flat_activated = activated.view(-1, self.hidden, kv_end)
        if dot is None:
            scores = torch.bmm(flat_weights, flat_activated)
        else:
            scores = torch.baddbmm(dot.view(-1, 1, kv_end), flat_weights, flat_activated)
        return scores.view(*activated.shape[:-2], kv_end), z if keep_z else None, activated


def _grouped_streams(dropout: AttentionDropout, query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The dropout streams (``batch * heads + head``) of query heads grouped as (batch, kv_heads, groups, 1, 1)."""
    return group_heads(dropout.streams(query.shape[0], query.shape[1], query.device), kv_heads)


def _sum_over_groups(blocks: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Σ over groups and rows of blocksᵀ @ other: blocks (B, block, n) and other (B, block, d) ->
    (batch, kv_heads, n, d)."""
    return grouped_transposed_matmul(blocks.flatten(1, 2), other.flatten(1, 2), blocks.shape[1])


class _BlockwisePairAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, term, activation, scaling, causality, block, dropout, mask, query, key, value, *tensors):
        is_causal, rows_seeing_all = causality
        q_len, kv_heads, kv_len = query.shape[2], key.shape[1], key.shape[2]
        stats_dtype = torch.promote_types(query.dtype, torch.float32)
        grouped_value = value.unsqueeze(2)
        mask_block = _BlockMasker(mask, kv_heads, is_causal, q_len, kv_len, block, query.device)
        state = _Term(term, activation, scaling, tensors, query, key, stats_dtype)
        shape = state.scaled_query.shape[:-1]  # (B, q)
        output = torch.empty(*shape, value.shape[-1], dtype=value.dtype, device=value.device)
        row_max = torch.empty(shape, dtype=stats_dtype, device=query.device)
        row_sum = torch.empty_like(row_max)
        streams = _grouped_streams(dropout, query, kv_heads) if dropout is not None else None
        for start, end, kv_end in query_blocks(q_len, kv_len, is_causal, block, rows_seeing_all):
            rows = slice(start, end)
            scores = state.scores(rows, kv_end, keep_z=False)[0]
            mask_block(scores, start, end, kv_end)
            block_max = scores.amax(dim=-1, keepdim=True)
            exps = scores.sub_(block_max).exp_()
            block_sum = exps.sum(dim=-1, keepdim=True)
            if dropout is not None:  # after the normaliser is taken: dropout acts on the probabilities
                exps.mul_(dropout.factors(streams, start, end, kv_end, exps.dtype))
            # Normalise the (block, d) output rather than the (block, kv_end) weights.
            output[..., rows, :] = (exps.to(value.dtype) @ grouped_value[..., :kv_end, :]) / block_sum
            row_max[..., rows], row_sum[..., rows] = block_max.squeeze(-1), block_sum.squeeze(-1)
        ctx.meta = (term, activation, scaling, causality, block, dropout)
        ctx.save_for_backward(mask, query, key, value, output, row_max, row_sum, *tensors)
        return output.flatten(1, 2)

    @staticmethod
    def backward(ctx, grad_output):
        mask, query, key, value, output, row_max, row_sum, *tensors = ctx.saved_tensors
        term, activation, scaling, (is_causal, rows_seeing_all), block, dropout = ctx.meta
        q_len, kv_heads, kv_len = query.shape[2], key.shape[1], key.shape[2]
        stats_dtype = row_max.dtype
        mask_block = _BlockMasker(mask, kv_heads, is_causal, q_len, kv_len, block, query.device)
        state = _Term(term, activation, scaling, tensors, query, key, stats_dtype)
        grad_output = group_heads(grad_output, kv_heads).to(stats_dtype)
        # rowsum(P * dP) per query row is dO . O: the softmax backward's correction, without a pass over P. With
        # dropout, O is the dropped output and dP carries the dropout factors, and it still holds.
        streams = _grouped_streams(dropout, query, kv_heads) if dropout is not None else None
        correction = (grad_output * output.to(stats_dtype)).sum(-1, keepdim=True)
        key_f, value_f = key.to(stats_dtype), value.to(stats_dtype)
        scaled_query = state.scaled_query.to(stats_dtype)
        gated = state.gate is not None

        def zeros(shape):
            return torch.zeros(shape, dtype=stats_dtype, device=query.device)

        def per_row(shape):  # every query row belongs to exactly one block, which writes its rows once
            return torch.empty(shape, dtype=stats_dtype, device=query.device)

        grad_key, grad_value = zeros(key_f.shape), zeros(value_f.shape)
        grad_query = per_row(scaled_query.shape) if gated else zeros(scaled_query.shape)
        grad_weights = per_row(state.unit_weights.shape)  # (B, q, h)
        if term == "qana":
            grad_unit_rows = per_row(state.unit_rows.shape)  # (B, q, h, d + 1)
            rows_keys = state.rows_keys.to(stats_dtype)
            units = state.unit_rows[..., :-1].to(stats_dtype).contiguous()  # (B, q, h, d), row-major
        else:
            grad_P, grad_R = per_row(state.P.shape), zeros(state.R.shape)

        for start, end, kv_end in query_blocks(q_len, kv_len, is_causal, block, rows_seeing_all):
            rows = slice(start, end)
            # Z is evaluated once per block, for the probabilities and for every gradient below.
            scores, z, activated = state.scores(rows, kv_end)
            mask_block(scores, start, end, kv_end)
            probs = scores.sub_(row_max[..., rows, None]).exp_().div_(row_sum[..., rows, None])
            grad_block = grad_output[..., rows, :]
            grad_probs = grad_block @ value_f[..., :kv_end, :].unsqueeze(2).transpose(-1, -2)
            if dropout is None:
                grad_value[..., :kv_end, :] += _sum_over_groups(probs, grad_block)
            else:  # the forward's mask, regenerated: O = (P * F) V, F the dropout factors
                factors = dropout.factors(streams, start, end, kv_end, stats_dtype)
                grad_value[..., :kv_end, :] += _sum_over_groups(probs * factors, grad_block)
                grad_probs.mul_(factors)
                del factors
            grad_scores = grad_probs.sub_(correction[..., rows, :]).mul_(probs)  # (B, block, kv_end)
            del probs, scores
            keys = key_f[..., :kv_end, :]
            if gated:  # the dot product's gradients (scaled_query already carries the scaling)
                grad_query[..., rows, :] = grad_scores @ keys.unsqueeze(2)
                grad_key[..., :kv_end, :] += _sum_over_groups(grad_scores, scaled_query[..., rows, :])
            # Σ_j dS_ij act(Z)_ilj per query row: a (1, kv_end) x (kv_end, h) product per row.
            flat_activated = activated.view(-1, state.hidden, kv_end).transpose(1, 2)
            row_shape = grad_weights[..., rows, :].shape
            grad_weights[..., rows, :] = torch.bmm(grad_scores.view(-1, 1, kv_end), flat_activated).view(row_shape)
            grad_scores = grad_scores.unsqueeze(-2)  # against the h unit planes
            weights = state.unit_weights[..., rows, :, None].to(stats_dtype)  # (B, block, h, 1)
            # dZ = act'(Z) * weight * dS: one contiguous product, then the derivative in place (faster than
            # the derivative against a broadcast dS).
            grad_units = torch.mul(grad_scores, weights, out=state.buffer("grad_units", z.shape, stats_dtype))
            grad_units = state.activation_backward(grad_units, z, activated)
            del z, activated, grad_scores
            if term == "qana":
                flat_units = grad_units.flatten(2, 4)  # (batch, kv_heads, G*block*h, kv_end)
                rows_shape = grad_unit_rows[..., rows, :, :].shape
                grad_unit_rows[..., rows, :, :] = (flat_units @ rows_keys[..., :kv_end, :]).view(rows_shape)
                grad_key[..., :kv_end, :] += flat_units.transpose(-1, -2) @ units[..., rows, :, :].flatten(2, 4)
            else:
                grad_P[..., rows, :, :] = grad_units.sum(-1, keepdim=True)
                grad_R[..., :kv_end] += grad_units.sum(dim=(2, 3), keepdim=True)
            del grad_units

        needs = ctx.needs_input_grad
        grads = [
            (grad_query * scaling).flatten(1, 2).to(query.dtype) if needs[7] else None,
            grad_key.to(key.dtype) if needs[8] else None,
            grad_value.to(value.dtype) if needs[9] else None,
        ]
        if term == "qana":
            U, V, b, _, gate = tensors
            grouped_V = group_heads(V, kv_heads).to(stats_dtype)
            term_grads = [
                grad_unit_rows[..., :-1].transpose(3, 4).flatten(1, 2).to(U.dtype),
                (grad_weights * state.gate).flatten(1, 2).to(V.dtype),
                grad_unit_rows[..., -1].flatten(1, 2).to(b.dtype),
                # c shifts every logit of its query row alike, which the softmax cancels: its gradient is zero
                # (None: autograd's zero, without allocating one).
                None,
                (grad_weights * grouped_V).sum(dim=(0, 3, 4)).reshape(-1).to(gate.dtype),
            ]
        else:
            P, R, w, gate = tensors
            per_head_unit = grad_weights.sum(dim=(0, 3))  # (kv_heads, groups, h)
            if gated:
                grad_w = (per_head_unit * state.gate[..., 0]).sum(dim=(0, 1))
                grad_gate = (per_head_unit * w.to(stats_dtype)).sum(-1).reshape(-1).to(gate.dtype)
            else:
                grad_w, grad_gate = per_head_unit.sum(dim=(0, 1)) * scaling, None
            term_grads = [
                grad_P.squeeze(-1).flatten(1, 2).to(P.dtype),
                grad_R[:, :, 0, 0].transpose(-1, -2).to(R.dtype),
                grad_w.to(w.dtype),
                grad_gate,
            ]
        # forward's arguments: term, activation, scaling, causality, block, dropout, mask, query, key, value, *tensors
        term_grads = [g if needs[10 + i] else None for i, g in enumerate(term_grads)]
        return (None, None, None, None, None, None, None, *grads, *term_grads)
