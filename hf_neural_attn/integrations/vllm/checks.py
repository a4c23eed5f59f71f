"""What the vLLM plugin cannot serve, refused before anything is built, with errors that name hf_neural_attn and say
what works. :func:`check_parallelism` runs where vLLM checks its parallel config (the process the user started);
:func:`check_servable` again where the model is built (each worker), :func:`check_head_size` once vLLM has chosen its
attention backend, :func:`check_weights_loadable` once the transformers model is built (on the meta device)."""

from __future__ import annotations

import re

from torch import nn

from ...compat.internals import keys_ignored_on_load
from ...record import PatchRecord


def check_parallelism(model: str, parallel_config) -> None:
    """Refuse tensor and pipeline parallelism: the plugin does not shard the scorers."""
    tensor, pipeline = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    if tensor > 1 or pipeline > 1:
        raise ValueError(
            f"hf_neural_attn cannot serve {model} with tensor_parallel_size={tensor} and "
            f"pipeline_parallel_size={pipeline} in vLLM: the plugin does not shard the attention scorers. Serve it "
            "with tensor_parallel_size=1 and pipeline_parallel_size=1, and scale out with data_parallel_size (one "
            "whole model per replica)."
        )


def check_servable(vllm_config) -> None:
    """Everything the plugin checks of a vLLM config for a patched model. Raises ``ValueError``."""
    model = vllm_config.model_config.model
    check_parallelism(model, vllm_config.parallel_config)
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise ValueError(
            f"hf_neural_attn cannot serve {model} with kv_cache_dtype={cache_dtype!r} in vLLM: the scorers read their "
            "keys back from the cache in the model's dtype. Leave kv_cache_dtype at 'auto'."
        )
    window = getattr(vllm_config.model_config.hf_text_config, "sliding_window", None)
    if window:
        raise ValueError(
            f"hf_neural_attn cannot serve {model} in vLLM: its layers attend within a sliding window of {window}, "
            "and vLLM frees the cache blocks that fall out of a window, which the plugin would read back. Serve it "
            "with transformers (python -m hf_neural_attn.serve PATH, continuous batching included)."
        )
    record = PatchRecord.of(vllm_config.model_config.hf_config)
    if record is not None:
        # Imported here: the checks of a config without a record need no model code.
        from ... import narrow_keys

        narrow_keys.refuse_vllm(model, narrow_keys.recorded_width(record))


def check_head_size(model: str, head_size: int, backend) -> None:
    """Refuse a head size the attention backend vLLM chose does not take: vLLM builds each step's attention metadata
    for that backend, scored layers included, and its kernels fail only at the first request."""
    supported = backend.get_supported_head_sizes()
    if supported and head_size not in supported:
        raise ValueError(
            f"hf_neural_attn cannot serve {model} in vLLM: its attention heads are {head_size} wide, and vLLM's "
            f"{backend.get_name()} attention backend takes head sizes {', '.join(map(str, supported))}. Serve it with "
            "transformers (python -m hf_neural_attn.serve PATH), or on a backend that takes its head size."
        )


def check_weights_loadable(model: str, module: nn.Module) -> None:
    """Refuse a model whose own weights vLLM's Transformers backend would drop at load.

    The backend skips every checkpoint key that one of the model's ignored-on-load patterns matches anywhere
    (``re.search``); GPT-2's ``"attn.bias"`` (its old causal-mask buffer) also matches every ``c_attn.bias``, and vLLM
    then fails at load with "Following weights were not initialized from checkpoint". ``module`` is the transformers
    model (``TransformersForCausalLM.model``); its parameter names are the checkpoint's keys below the base prefix."""
    patterns = [re.compile(pattern) for pattern in keys_ignored_on_load(module)]
    dropped = [name for name, _ in module.named_parameters() if any(pattern.search(name) for pattern in patterns)]
    if dropped:
        model_type = getattr(module.config, "model_type", type(module).__name__)
        raise ValueError(
            f"hf_neural_attn cannot serve {model} (model type {model_type!r}) in vLLM: vLLM's Transformers modeling "
            f"backend skips the checkpoint keys matching {model_type}'s ignored-on-load patterns, which are also its "
            f"weights {', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''}. Serve it with transformers: "
            f"python -m hf_neural_attn.serve {model}."
        )
