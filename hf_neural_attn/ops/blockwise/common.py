"""What every fused term's blockwise form shares: the activations' in-place ops, the call's reusable buffers, and
the assembly of a block's logits from the term's hidden layer.

A term (``query_network.py``, ``pair_mlp.py``, one file each, named as :data:`hf_neural_attn.ops.terms.TERMS`
names them) subclasses :class:`BlockwiseTerm` and supplies what differs between terms: its tensors in the grouped
layout, the pre-activations Z of a block, and the gradients of its own tensors. The autograd function and its
loops over query blocks (:mod:`hf_neural_attn.ops.blockwise`) see only this class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ..grouped import group_heads

# name -> (activation in place, activation into a given tensor, its backward: (grad, pre-activation, activation
# value) -> grad * derivative, written into grad). The backward ops are aten's own fused ones (what autograd runs
# for these functions), one pass each over a plane. None of them allocates: see BlockwiseTerm.buffer.
ACTIVATIONS: dict[str, tuple[Callable, Callable, Callable]] = {
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


class BlockwiseTerm(ABC):
    """One call's fused term in the grouped, row-major layout, and the per-block pieces forward and backward
    share. ``B`` below stands for (batch, kv_heads, groups) and ``G`` for the groups axis alone.

    A block's logits are ``dot + Σ_l weight_il · act(Z_ilj)``: ``dot`` the scaled dot product (None for a term
    without a gate, the pair MLP's replace form), ``weight`` the output layer's per-row unit weights
    (:attr:`unit_weights`).

    A subclass takes ``(activation, scaling, tensors, query, key, stats_dtype)``, ``tensors`` the term's
    (:class:`~hf_neural_attn.ops.terms.FusedInputs` order), and sets, after this class's ``__init__``:
    :attr:`hidden` (h), :attr:`gate` ((kv_heads, groups, 1, 1), or None: no dot product) and
    :attr:`unit_weights` ((B, q, h) in the stats dtype); and implements :meth:`hidden_planes`,
    :meth:`begin_backward`, :meth:`add_unit_grads` and :meth:`tensor_grads`.
    """

    hidden: int
    gate: torch.Tensor | None
    unit_weights: torch.Tensor

    def __init__(self, activation, scaling, query, key, stats_dtype):
        kv_heads = key.shape[1]
        self.stats_dtype = stats_dtype
        self.activate_, self.activate_into, self.activation_backward = ACTIVATIONS[activation]
        self.buffers: dict[str, torch.Tensor] = {}
        self.key = key  # (batch, kv_heads, kv_len, d), kv heads not repeated
        # The dot product's query side, scaled once: (B, q, d).
        self.scaled_query = group_heads(query, kv_heads) * scaling

    # --- what each term supplies

    @abstractmethod
    def hidden_planes(self, rows: slice, kv_end: int) -> torch.Tensor:
        """Z of the block of query ``rows`` against keys ``:kv_end``, (B, block, h, kv_end), in the call's buffer
        "z" (:meth:`buffer`), in the stats dtype and contiguous."""

    @abstractmethod
    def begin_backward(self) -> None:
        """Allocate what backward accumulates the term's gradients in, before the first block."""

    @abstractmethod
    def add_unit_grads(self, rows: slice, kv_end: int, grad_units: torch.Tensor, grad_key: torch.Tensor) -> None:
        """Take one block's dZ (``grad_units``, shaped like Z) into the term's gradients, and the term's share of
        the keys' gradient into ``grad_key`` (batch, kv_heads, kv_len, d) in place."""

    @abstractmethod
    def tensor_grads(self, grad_weights: torch.Tensor, tensors: tuple) -> list[torch.Tensor | None]:
        """After the last block: the gradients of ``tensors`` (the term's, in :class:`~..terms.FusedInputs`
        order, each in its own dtype), given ``grad_weights`` (B, q, h), the gradient of :attr:`unit_weights`."""

    # --- shared

    def zeros(self, shape) -> torch.Tensor:
        """A gradient that several blocks add to (indexed by keys, or by the term's shared weights)."""
        return torch.zeros(shape, dtype=self.stats_dtype, device=self.key.device)

    def per_row(self, shape) -> torch.Tensor:
        """A gradient indexed by query rows: every row belongs to exactly one block, which writes its rows once."""
        return torch.empty(shape, dtype=self.stats_dtype, device=self.key.device)

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
        (B, block, kv_end) or None (no gate), both in the stats dtype and contiguous."""
        z = self.hidden_planes(rows, kv_end)
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
