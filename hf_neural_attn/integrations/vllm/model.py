"""The model class vLLM builds for a patched checkpoint: its Transformers modeling backend, with the scorers.

vLLM's backend builds the transformers model from the checkpoint's config (patched: the library builds the scorers
with it, :mod:`hf_neural_attn.patched_config`), replaces its layers by vLLM's (linear, embedding, norm, fused QKV),
gives each attention module a vLLM ``Attention`` layer for the paged cache, and loads the weights. What differs for
a patched model:

* the patch is checked against what vLLM was asked for before anything is built (:mod:`.checks`);
* vLLM compiles it as it compiles unpatched models, the scored layers' attention an opaque operator in the graph
  (:data:`.paged.SCORED_ATTENTION_OP`); the scorers' linear layers run on vLLM's CPU matrix product;
* while vLLM decides which modules dispatch to its attention, the config reads its base implementation (``"vllm"``,
  which the backend set), and the scorers are set aside, so that vLLM leaves their layers as the library built them
  (vLLM's linear layers return tuples, and the scorers read their own weights);
* at run time the config reads ``"hf_neural_attn"`` again, so the modules call the library's attention function,
  which serves them from vLLM's paged cache (:mod:`.paged`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from vllm.config import CUDAGraphMode
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.models.transformers import TransformersForCausalLM
from vllm.platforms import current_platform

from ...patched_config import base_implementation_visible
from ...record import SCORER_ATTR
from .checks import check_head_size, check_servable, check_weights_loadable
from .paged import SCORED_ATTENTION_OP, VLLM_LAYER_ATTR, register_scored_modules


class PatchedTransformersForCausalLM(TransformersForCausalLM):
    """vLLM's ``TransformersForCausalLM`` for a patched checkpoint (registered as ``HfNeuralAttnForCausalLM``)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        check_servable(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def _decorate_for_torch_compile(self) -> None:
        # Compiled as vLLM compiles an unpatched model: the scored layers' attention is one opaque operator in the
        # graph (integrations/vllm/paged.py). Where vLLM compiles piecewise (its GPU default) the graph is split at
        # it, as at vLLM's own attention, and no CUDA graph holds it: it reads the step's request counts on the host,
        # which a graph captured once could not replay, so whole-model CUDA graphs become piecewise ones.
        super()._decorate_for_torch_compile()
        compilation = self.vllm_config.compilation_config
        if compilation.splitting_ops and SCORED_ATTENTION_OP not in compilation.splitting_ops:
            compilation.splitting_ops.append(SCORED_ATTENTION_OP)
        if compilation.cudagraph_mode.has_full_cudagraphs():
            compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE

    def recursive_replace(self) -> None:
        check_weights_loadable(self.model_config.model, self.model)
        configs = {id(config): config for config in _configs_of(self.model)}
        with contextlib.ExitStack() as stack:
            for config in configs.values():
                stack.enter_context(base_implementation_visible(config))
            stack.enter_context(_scorers_set_aside(self.model))
            super().recursive_replace()

    def load_weights(self, weights) -> set[str]:
        loaded = super().load_weights(weights)
        if current_platform.is_cpu():
            for module in self.model.modules():
                scorer = module._modules.get(SCORER_ATTR)
                if scorer is not None:
                    _linears_on_vllm_gemm(scorer)
        return loaded

    def _create_attention_instances(self, prefix: str = "") -> None:
        super()._create_attention_instances(prefix)
        register_scored_modules(self.model)
        for module in self.model.modules():
            layer = getattr(module, VLLM_LAYER_ATTR, None)
            if getattr(layer, "attn_backend", None) is not None:
                check_head_size(self.model_config.model, layer.head_size, layer.attn_backend)


def _linears_on_vllm_gemm(scorer: nn.Module) -> None:
    """The scorer's linear layers compute with vLLM's CPU matrix product (oneDNN with prepacked weights, what vLLM's own
    linear layers run on a CPU) once their weights are loaded: torch's ``F.linear`` took twice its time for QANA's
    widened query at SmolLM-135M's shape, 39 % of a layer's weights (docs/serving.md). The layers keep their weights,
    which the scorers' other paths read; serving changes none."""
    for linear in scorer.modules():
        if type(linear) is nn.Linear:
            dispatch_cpu_unquantized_gemm(linear, remove_weight=False)
            linear.forward = functools.partial(_vllm_gemm, linear)


def _vllm_gemm(linear: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    return linear.cpu_linear(inputs, linear.weight, linear.bias)


def _configs_of(model: nn.Module) -> Iterator:
    """The config objects the modules of ``model`` hold (a patched model holds a private copy of vLLM's config)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            yield config


@contextlib.contextmanager
def _scorers_set_aside(model: nn.Module) -> Iterator[None]:
    """Within the block, the patched attention modules hold no scorer submodule; they get it back on leaving."""
    held = [(module, module._modules.pop(SCORER_ATTR)) for module in model.modules() if SCORER_ATTR in module._modules]
    try:
        yield
    finally:
        for module, scorer in held:
            module._modules[SCORER_ATTR] = scorer
