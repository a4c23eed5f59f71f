"""Scorers on their own in float64: the test geometry, literal RoPE, the whole scorer path as a module, gradcheck, and
comparisons of outputs and gradients against a reference."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from hf_neural_attn.ops.dispatch import scored_attention
from hf_neural_attn.scorers import AttentionGeometry

# --- Tolerances the contracts share -----------------------------------------------------------------------------

# fp32: a function-preserving patch computes the original's dot product with a different kernel (explicit matmul +
# softmax instead of SDPA), so logits agree to rounding, far below this bound.
EXACT = 1e-5
# Two processes (DeepSpeed, FSDP) sum their gradients in another order than one process: trained weights and saved
# states agree with one process's at rounding level. SGD keeps it there (Adam would turn the rounding noise of
# gradients that are zero in exact arithmetic, QANA's c rows, into lr-sized steps).
DISTRIBUTED_TOL = {"rtol": 1e-5, "atol": 1e-6}

# --- Scorers on their own, in float64 ----------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, D = 6, 2, 1, 4
F64 = torch.float64

# The activations the literal references write out, by the name the scorer configs take.
ACTIVATIONS = {"gelu": F.gelu, "tanh": torch.tanh, "relu": F.relu}


def geometry(**overrides) -> AttentionGeometry:
    values = dict(
        hidden_size=HIDDEN,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=D,
        query_bias=True,
        query_weight_std=0.5,
        dtype=F64,
        device=torch.device("cpu"),
    )
    values.update(overrides)
    return AttentionGeometry(**values)


def randomise(module, seed=0, std=0.7) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=F64) * std)


def rope_vector(vector, position, base=10000.0):
    """RoPE of one D-vector at one position, rotate-half convention (as Llama), written out."""
    half = vector.shape[-1] // 2
    out = torch.empty_like(vector)
    for m in range(half):
        angle = position * base ** (-2 * m / vector.shape[-1])
        x1, x2 = vector[m], vector[m + half]
        out[m] = x1 * math.cos(angle) - x2 * math.sin(angle)
        out[m + half] = x2 * math.cos(angle) + x1 * math.sin(angle)
    return out


def rope_rows(x, positions):
    """The library-side rotation: (batch, n, seq, D) rotated at ``positions`` (seq,), vectorised."""
    half = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=F64) * 2 / x.shape[-1])
    angles = positions.to(F64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated_half * sin


def qana_case(batch: int = 2, q_len: int = 3, k_len: int = 5):
    """Hidden states (batch, q_len, HIDDEN), the model's own query projection W_s (HEADS * D, HIDDEN) and b_s,
    keys (batch, HEADS, k_len, D), and the query and key positions (float64, from the global RNG)."""
    hidden = torch.randn(batch, q_len, HIDDEN, dtype=F64)
    w_s, b_s = torch.randn(HEADS * D, HIDDEN, dtype=F64), torch.randn(HEADS * D, dtype=F64)
    keys = torch.randn(batch, HEADS, k_len, D, dtype=F64)
    return hidden, w_s, b_s, keys, torch.arange(2, 2 + q_len), torch.arange(k_len)


class AttentionUnderTest(nn.Module):
    """Hidden states and q, k, v in, attention output out: the whole scorer path, as a module."""

    def __init__(self, scorer, mask, positions):
        super().__init__()
        self.scorer, self.mask, self.positions = scorer, mask, positions

    def forward(self, hidden, query, key, value):
        extras = self.scorer.query_extras(hidden, lambda x: rope_rows(x, self.positions))
        return scored_attention(self.scorer, query, key, value, self.mask, scaling=D**-0.5, extras=extras)[0]


def causal_gradcheck(scorer, seq: int, seed: int = 0) -> bool:
    """float64 gradcheck of the whole scorer path under a causal mask, with respect to the hidden states,
    q, k, v and every scorer parameter."""
    mask = torch.zeros(1, 1, seq, seq, dtype=F64)
    mask[..., ~torch.ones(seq, seq, dtype=torch.bool).tril()] = torch.finfo(F64).min
    module = AttentionUnderTest(scorer, mask, torch.arange(seq))
    names = [name for name, _ in module.named_parameters()]

    def attention(hidden, query, key, value, *parameters):
        return functional_call(module, dict(zip(names, parameters)), (hidden, query, key, value))

    generator = torch.Generator().manual_seed(seed)
    inputs = (
        torch.randn(1, seq, HIDDEN, dtype=F64, generator=generator).requires_grad_(),
        *(torch.randn(1, HEADS, seq, D, dtype=F64, generator=generator).requires_grad_() for _ in range(3)),
        *(p.detach().clone().requires_grad_() for p in module.parameters()),
    )
    return torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-7)


def assert_same_outputs_and_grads(result, expected, atol: float) -> None:
    """``result`` and ``expected``, each (output, [gradient or None, ...]), agree: the output to ``atol``, each
    gradient to ``atol`` times its reference's largest magnitude (at least 1), None where the reference is None."""
    (output, grads), (ref_output, ref_grads) = result, expected
    torch.testing.assert_close(output, ref_output, rtol=0, atol=atol)
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads, strict=True)):
        assert (grad is None) == (ref_grad is None), index
        if grad is not None:
            scale = max(1.0, ref_grad.abs().max().item())
            torch.testing.assert_close(
                grad, ref_grad, rtol=0, atol=atol * scale, msg=lambda m, i=index: f"tensor {i}: {m}"
            )


def negligible(grad: torch.Tensor, reference: torch.Tensor) -> bool:
    """Zero up to fp32 rounding, relative to a gradient that is really there."""
    return bool(grad.abs().max() <= 1e-4 * reference.abs().max())
