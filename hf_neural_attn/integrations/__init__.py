"""What hf_neural_attn adds to other libraries that load it from the outside: each subpackage serves patched models
in one such library, through that library's own extension points.

* :mod:`hf_neural_attn.integrations.vllm`: vLLM, as a ``vllm.general_plugins`` entry point.
"""
