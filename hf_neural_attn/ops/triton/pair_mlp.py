"""The pair-MLP score term of the fused kernels (``KIND`` 1 and 2; the Neural Attention scorer with one
hidden layer hands it its inputs).

The first layer is split into a query half P (one row per query) and a key half R (one row per key, its
bias included), both computed by torch before the kernels run; the kernels compute, for query i and key j,

    mlp_ij = sum_m w_m act(P_im + R_jm)

and add it to the scaled dot product through a per-head gate (``KIND == 1``, residual) or use it alone,
scaled (``KIND == 2``, replace; the torch side passes ``scaling = 1`` for an unscaled one). Gradients: dP and
the partial sums of dw (query-block backward kernel), dR (key-block kernel). The shared kernels in
:mod:`.common` call these helpers.

Importing this module needs ``triton``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .utils import activation


@triton.jit
def mlp_term(pq, rk, wo, ACT: tl.constexpr):
    """mlp (BLOCK_M, BLOCK_N) of one tile from P (BLOCK_M, HID_PAD) and R (BLOCK_N, HID_PAD), with the
    hidden activations ``act`` and their derivatives ``dact``, each (BLOCK_M, HID_PAD, BLOCK_N)."""
    hidden = pq[:, :, None] + tl.trans(rk)[None, :, :]
    act, dact = activation(hidden, ACT)
    mlp = tl.sum(act * wo[None, :, None], axis=1)
    return mlp, act, dact


@triton.jit
def mlp_grad(ds, gate, scaling, KIND: tl.constexpr):
    """Gradient of the tile's mlp term from that of its scores: ``gate * ds`` (residual) or
    ``scaling * ds`` (replace)."""
    dmlp = ds * scaling
    if KIND == 1:
        dmlp = ds * gate
    return dmlp


@triton.jit
def accumulate_query_grads(dwo, dpq, ds, act, dact, wo, gate, scaling, KIND: tl.constexpr):
    """Adds one key tile's share to dw (HID_PAD,) and dP (BLOCK_M, HID_PAD)."""
    dmlp = mlp_grad(ds, gate, scaling, KIND)
    dwo += tl.sum(tl.sum(dmlp[:, None, :] * act, 2), 0)
    dpq += tl.sum(dmlp[:, None, :] * wo[None, :, None] * dact, 2)
    return dwo, dpq


@triton.jit
def accumulate_key_grad(drk, ds, dact, wo, gate, scaling, KIND: tl.constexpr):
    """Adds one query tile's share to dR (BLOCK_N, HID_PAD)."""
    dmlp = mlp_grad(ds, gate, scaling, KIND)
    drk += tl.trans(tl.sum(dmlp[:, None, :] * wo[None, :, None] * dact, 0))
    return drk
