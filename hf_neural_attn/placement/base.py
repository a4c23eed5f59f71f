"""What a way of holding weights does in a patch, phase by phase: the one interface the patch calls them through.

A model's weights may be offloaded by accelerate, partitioned by DeepSpeed ZeRO-3, quantized by bitsandbytes or
torchao, or sharded by tensor parallelism. Each of those is one :class:`Placement` (in the module that knows it), and
``hf_neural_attn.placements.PLACEMENTS`` lists them; the patch (``patch_plan.py``, ``patching.py``, ``attention.py``)
calls the phases of every placement in turn and names none. A phase a placement has nothing to do in is the base
class's, which does nothing: adding a placement is one module with one subclass, and one line in ``PLACEMENTS``.

The phases, in the order a patch meets them:

* **read**: :meth:`~Placement.weights_readable`, a block within which a module's weights can be read as tensors (the
  patch reads the query weights' std, dtype and device to build a scorer);
* **plan**: :meth:`~Placement.scorer_dtype` (the dtype to build scorers in, where the weights' own says nothing) and
  :meth:`~Placement.plan_layer` (checks for one attention module and its new modules, which may refuse; what it
  returns is kept in the plan for the apply phase). The model does not change;
* **apply**: :meth:`~Placement.apply_layer` (the new modules are in the attention module) and
  :meth:`~Placement.apply_model` (after every layer), which cannot fail on user input;
* **run**: :meth:`~Placement.scorer_in_place`, a block within which a scorer's parameters read as the compute paths
  read them (they read parameters without calling the scorer as a module, so no module hook runs for them), and
  :meth:`~Placement.heads_held` (which of the heads this process computes, where they are spread over processes);
* **remove**: :meth:`~Placement.remove_layer` and :meth:`~Placement.remove_model` (``unpatch_model``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn


class Placement:
    """One way a model's weights are held; every phase does nothing unless a subclass says otherwise."""

    name: ClassVar[str]

    def weights_readable(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Read phase: within the block, ``module``'s weights (its own and its submodules') are readable tensors."""
        return contextlib.nullcontext()

    def scorer_dtype(self, model: nn.Module) -> torch.dtype | None:
        """Plan phase: the dtype scorers on ``model`` are built in, where its weights' own dtype is not the one its
        activations run in; None to leave the choice to the weights."""
        return None

    def plan_layer(self, model: nn.Module, module: nn.Module, scorer: nn.Module, new_modules: Iterable[nn.Module]):
        """Plan phase, for attention ``module`` of ``model`` and its ``scorer`` (built, not added; ``new_modules``:
        the scorer and any other module the patch adds to it): check and prepare them, raising ``ValueError`` to
        refuse the patch. Returns what :meth:`apply_layer` needs of it (None: nothing)."""
        return None

    def apply_layer(
        self, model: nn.Module, module: nn.Module, scorer: nn.Module, added: dict[str, nn.Module], planned: Any
    ) -> None:
        """Apply phase: ``scorer`` is ``module``'s now, and ``added`` the other modules the patch put in it (by
        attribute name); ``planned`` is what :meth:`plan_layer` returned."""

    def apply_model(self, model: nn.Module) -> None:
        """Apply phase, once every layer is patched."""

    def scorer_in_place(self, scorer: nn.Module) -> contextlib.AbstractContextManager:
        """Run phase: within the block, ``scorer``'s parameters read as the compute paths need them."""
        return contextlib.nullcontext()

    def heads_held(self, scorer: nn.Module, local_heads: int) -> tuple[int, int] | None:
        """Run phase: where this process's ``local_heads`` heads of ``scorer`` lie among all, (first head, number of
        heads), for a placement that spreads the heads over processes; None otherwise."""
        return None

    def remove_layer(self, model: nn.Module, module: nn.Module, scorer: nn.Module) -> None:
        """Remove phase: ``scorer`` is about to leave attention ``module``."""

    def remove_model(self, model: nn.Module) -> None:
        """Remove phase, once every scorer has left ``model``."""
