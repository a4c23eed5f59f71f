"""The names of the compute choices, the values of the scorers' ``impl`` option, in a module of their own beneath
the dispatcher that resolves them (:func:`hf_neural_attn.ops.dispatch.resolve_impl`): the scorer configs list them as
the option's choices without importing the dispatcher."""

from __future__ import annotations

# A path choice, or "auto": the dispatcher's per-call rule (see hf_neural_attn.ops.dispatch.resolve_impl).
IMPL_OPTIONS = ("auto", "reference", "chunked", "triton")
# What a model runs when nobody chose: patch_model, from_pretrained and set_impl without impl.
DEFAULT_IMPL = "auto"
