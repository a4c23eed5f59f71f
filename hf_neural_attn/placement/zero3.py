"""DeepSpeed ZeRO-3: patching and loading a model whose parameters are partitioned across processes.

A model built under ``deepspeed.zero.Init`` (accelerate's ``zero3_init_flag: true``, transformers'
``from_pretrained`` with an ``HfDeepSpeedConfig`` alive) keeps on each process only its slice of every
parameter; ``parameter.data`` is empty and DeepSpeed gathers the whole tensor around each module's forward.
The patch needs three things from that world, all here so that nothing else imports DeepSpeed:

* reading the pretrained weights the scorer's init depends on (the query weights' std, dtype, device):
  :func:`partitioned_weights_gathered`;
* giving the new modules (scorers, QANA's narrow key projections) partitioned parameters like their neighbours,
  drawn on rank 0 and broadcast, so every process holds slices of one init: :func:`partition_like`;
* making DeepSpeed gather the scorer's parameters where they are read. DeepSpeed gathers a module's own
  parameters around its own forward, and the scorer's are read outside any call of the scorer module: in the
  forward pre-hook that computes QANA's query slices (which runs before DeepSpeed's hooks on the attention
  module, registered later) and in the attention function. :func:`register_scorer_parameters` declares them
  external parameters of the module that *calls* the attention module (the decoder layer), gathered for its
  whole forward and again for its backward.

DeepSpeed is never imported by this module: a partitioned parameter can only exist once the caller imported it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .base import Placement
from .quantized import logical_shape


def is_partitioned(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is a DeepSpeed ZeRO-3 parameter (DeepSpeed gives them an id)."""
    return hasattr(parameter, "ds_id")


def _zero():
    """DeepSpeed's ZeRO-3 module (``Init``, ``GatheredParameters``, the external-parameter registry). Loaded whenever
    a partitioned parameter exists: only it makes them."""
    return sys.modules["deepspeed.runtime.zero.partition_parameters"]


def full_shape(parameter: torch.Tensor) -> torch.Size:
    """The shape of ``parameter``'s whole tensor, the same on every process: what every question about a parameter's
    size asks (is it new, resized, a matrix; how many elements). A DeepSpeed ZeRO-3 partitioned parameter's own
    ``shape`` is its empty local placeholder's, ``(0,)``; its whole shape is ``ds_shape``. FSDP2's sharded
    parameters (DTensors), weights offloaded by accelerate and meta tensors report their whole shape themselves.
    (FSDP1 flattens the parameters it wraps: ask before it wraps the model, as the recipes do.) A bitsandbytes 4-bit
    weight's own shape is its packed storage's, ``(numel / 2, 1)``: its whole shape is the weight's
    (:func:`.quantized.logical_shape`)."""
    return torch.Size(parameter.ds_shape) if is_partitioned(parameter) else logical_shape(parameter)


@contextlib.contextmanager
def partitioned_weights_gathered(
    parameters: Iterable[torch.Tensor], *, modifier_rank: int | None = None
) -> Iterator[None]:
    """Within the block, the partitioned ones among ``parameters`` hold their whole tensors on every process.

    ``modifier_rank=None`` reads; ``modifier_rank=0`` lets rank 0 write, and its values are partitioned to every
    process at the end of the block (DeepSpeed's ``GatheredParameters``). Without partitioned parameters the block
    runs as it is. Collective when there are: every process of the job must enter it.
    """
    partitioned = [parameter for parameter in parameters if is_partitioned(parameter)]
    if not partitioned:
        yield
        return
    with _zero().GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def partition_like(reference: nn.Module, new_modules: Iterable[nn.Module]) -> None:
    """Partition the parameters of ``new_modules`` (built whole, already initialised) as those of
    ``reference`` are, if they are. Rank 0's values are broadcast first, so all processes share one init.
    Collective: every process of the job must call it, as every process calls ``patch_model``."""
    reference_parameter = next((p for p in reference.parameters() if is_partitioned(p)), None)
    if reference_parameter is None:
        return
    from transformers.integrations.deepspeed import deepspeed_config

    zero = _zero()
    for module in new_modules:
        # ``module=`` converts a module built outside the Init context as if built inside it; the config (the
        # run's HfDeepSpeedConfig, when there is one) places the shards (offload_param) as the base's were.
        zero.Init(
            module=module,
            config_dict_or_path=deepspeed_config(),
            data_parallel_group=getattr(reference_parameter, "ds_process_group", None),
        )


def _caller(model: nn.Module, attention_module: nn.Module) -> nn.Module:
    """The module whose forward calls ``attention_module``: its parent (the model itself has none)."""
    for parent in model.modules():
        if any(child is attention_module for child in parent.children()):
            return parent
    return attention_module


def register_scorer_parameters(model: nn.Module, attention_module: nn.Module, scorer: nn.Module) -> None:
    """Have DeepSpeed gather ``scorer``'s partitioned parameters, wherever the patch reads them, for the forward and
    backward of the module calling ``attention_module`` in ``model``."""
    parameters = [parameter for parameter in scorer.parameters() if is_partitioned(parameter)]
    if parameters:
        caller = _caller(model, attention_module)
        for parameter in parameters:
            _zero().register_external_parameter(caller, parameter)


def unregister_scorer_parameters(model: nn.Module, attention_module: nn.Module, scorer: nn.Module) -> None:
    """Undo :func:`register_scorer_parameters` (``unpatch_model``)."""
    parameters = [parameter for parameter in scorer.parameters() if is_partitioned(parameter)]
    if parameters:
        caller = _caller(model, attention_module)
        for parameter in parameters:
            _zero().unregister_external_parameter(caller, parameter)


class ZeroThreePartitioning(Placement):
    """DeepSpeed ZeRO-3: the module's weights gathered while read; the new modules partitioned like their
    neighbours when planned; the scorer's parameters gathered with its caller's forward once patched."""

    name = "DeepSpeed ZeRO-3"

    def weights_readable(self, module):
        return partitioned_weights_gathered(module.parameters())

    def plan_layer(self, model, module, scorer, new_modules):
        partition_like(module, new_modules)

    def apply_layer(self, model, module, scorer, added, planned):
        register_scorer_parameters(model, module, scorer)

    def remove_layer(self, model, module, scorer):
        unregister_scorer_parameters(model, module, scorer)


PLACEMENT = ZeroThreePartitioning()
