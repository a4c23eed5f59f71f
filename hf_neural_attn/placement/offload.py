"""accelerate's offloading: a module whose weights accelerate keeps elsewhere (CPU memory, disk) and loads for each
of its calls. Patching reads the query weights and the attention function reads the scorer's outside any call of
the modules that hold them, so both load them here for that moment, as accelerate's hooks would
(:func:`offloaded_weights_loaded`). DeepSpeed ZeRO-3's partitioned weights, the other kind not in memory, are
:mod:`.zero3`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ..compat.internals import accelerate_hook
from .base import Placement


def _offloading_hooks(hook) -> list:
    """The hooks inside accelerate hook ``hook`` that keep a module's tensors elsewhere (an ``AlignDevicesHook``
    with ``offload=True`` and its ``weights_map``); ``SequentialHook`` is looked into."""
    if hasattr(hook, "hooks"):
        return [inner for part in hook.hooks for inner in _offloading_hooks(part)]
    return [hook] if getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None else []


@contextlib.contextmanager
def offloaded_weights_loaded(module: nn.Module) -> Iterator[None]:
    """Within the block, the tensors accelerate offloaded from ``module`` and its submodules are loaded on their
    execution device, as they are while the module runs; afterwards they go back to meta.

    accelerate offloads a module's weights (``cpu_offload``, ``disk_offload``, ``dispatch_model``, and
    transformers' ``from_pretrained(device_map=..., offload_folder=...)``) by leaving meta tensors in it and
    an ``AlignDevicesHook`` that fills them from its ``weights_map`` just for each call of the module. Patching
    reads the query weights (their std, dtype and device), so it loads them the same way for that moment.
    Only hooks that offload are driven; others (a plain device alignment, ``cpu_offload_with_hook``'s hook,
    which would move the whole model) are left alone.
    """
    loaded = []
    try:
        for part in module.modules():
            for hook in _offloading_hooks(accelerate_hook(part)):
                hook.pre_forward(part)
                loaded.append((hook, part))
        yield
    finally:
        for hook, part in reversed(loaded):
            hook.post_forward(part, None)


class AccelerateOffload(Placement):
    """accelerate's offloading: a module's weights are loaded for the moment the patch reads them, and a scorer's
    for each call that reads its parameters (a model patched, then dispatched with offloading)."""

    name = "accelerate offload"

    def weights_readable(self, module):
        return offloaded_weights_loaded(module)

    def scorer_in_place(self, scorer):
        return offloaded_weights_loaded(scorer)


PLACEMENT = AccelerateOffload()
