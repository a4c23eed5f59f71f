"""The ways a model's weights may be held, as one list, and the phases a patch calls them through.

``PLACEMENTS`` lists them (each one :class:`~hf_neural_attn.placement.base.Placement`, in the module that knows it:
accelerate's offloading, DeepSpeed ZeRO-3, quantized bases, tensor parallelism); the functions below run one phase
of every placement in turn, so that the patch (``patch_plan.py``, ``patching.py``, ``attention.py``) names none of
them. ``placement/base.py`` says what each phase is for. Adding a placement is one module and one line here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .parallel import tensor
from .placement import offload, quantized, zero3
from .placement.base import Placement

# In the order their blocks nest (the first outermost) and their steps run.
PLACEMENTS: tuple[Placement, ...] = (offload.PLACEMENT, zero3.PLACEMENT, quantized.PLACEMENT, tensor.PLACEMENT)


def _taking_part(phase: str) -> tuple[Placement, ...]:
    """The placements that override ``phase`` (the others' block does nothing): the run phase opens its blocks on
    every attention call, so the ones with nothing to do are left out once, here."""
    return tuple(
        placement for placement in PLACEMENTS if getattr(type(placement), phase) is not getattr(Placement, phase)
    )


_READERS = _taking_part("weights_readable")
_RUNNERS = _taking_part("scorer_in_place")


@contextlib.contextmanager
def _every_block(enter: Callable[[Placement], contextlib.AbstractContextManager], placements: tuple[Placement, ...]):
    """Within the block, ``enter(placement)``'s block of each of ``placements``, the first outermost. Nested by recursion,
    not an ``ExitStack``: torch.compile (``fullgraph=True``) traces nested with-blocks, and not the bound exit methods
    an ``ExitStack`` keeps; the run phase is traced on every attention call."""
    if not placements:
        yield
        return
    with enter(placements[0]), _every_block(enter, placements[1:]):
        yield


def weights_readable(module: nn.Module) -> contextlib.AbstractContextManager:
    """Read phase: within the block, ``module``'s weights are readable tensors, however they are held."""
    return _every_block(lambda placement: placement.weights_readable(module), _READERS)


def scorer_dtype(model: nn.Module) -> torch.dtype | None:
    """Plan phase: the dtype scorers on ``model`` are built in, where a placement decides it (None: the weights')."""
    return next((dtype for placement in PLACEMENTS if (dtype := placement.scorer_dtype(model)) is not None), None)


def plan_layer(model: nn.Module, module: nn.Module, scorer: nn.Module, added: Iterable[nn.Module]) -> Mapping[str, Any]:
    """Plan phase for attention ``module`` and its ``scorer`` (``added``: the other new modules): every placement's
    checks (``ValueError`` refuses the patch) and what each keeps for :func:`apply_layer`, by placement name."""
    new_modules = [scorer, *added]
    return MappingProxyType(
        {placement.name: placement.plan_layer(model, module, scorer, new_modules) for placement in PLACEMENTS}
    )


def apply_layer(
    model: nn.Module, module: nn.Module, scorer: nn.Module, added: dict[str, nn.Module], planned: Mapping[str, Any]
) -> None:
    """Apply phase: ``scorer`` and ``added`` (by attribute name) are in ``module`` now; ``planned``:
    :func:`plan_layer`'s answer for it."""
    for placement in PLACEMENTS:
        placement.apply_layer(model, module, scorer, added, planned[placement.name])


def apply_model(model: nn.Module) -> None:
    """Apply phase, once every layer of ``model`` is patched."""
    for placement in PLACEMENTS:
        placement.apply_model(model)


def scorer_in_place(scorer: nn.Module) -> contextlib.AbstractContextManager:
    """Run phase: within the block, ``scorer``'s parameters read as the compute paths need them."""
    return _every_block(lambda placement: placement.scorer_in_place(scorer), _RUNNERS)


def heads_held(scorer: nn.Module, local_heads: int) -> tuple[int, int] | None:
    """Run phase: where this process's ``local_heads`` heads of ``scorer`` lie among all, (first head, number of
    heads), when a placement spreads them over processes; None when this process computes every head."""
    return next((held for placement in PLACEMENTS if (held := placement.heads_held(scorer, local_heads))), None)


def remove_layer(model: nn.Module, module: nn.Module, scorer: nn.Module) -> None:
    """Remove phase: ``scorer`` is about to leave attention ``module``."""
    for placement in PLACEMENTS:
        placement.remove_layer(model, module, scorer)


def remove_model(model: nn.Module) -> None:
    """Remove phase, once every scorer has left ``model``."""
    for placement in PLACEMENTS:
        placement.remove_model(model)
