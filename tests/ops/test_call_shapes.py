"""The call-shape table (``ops.call_shapes.CALL_SHAPES``) and the one function that tells a call's shape
(``attention.call_shape``): each shape names a function that exists, and calls are told as the table says."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers.models import tiny_model

import hf_neural_attn
from hf_neural_attn import attention
from hf_neural_attn.ops.call_shapes import CALL_SHAPES, CONTEXT, ORDINARY, PACKED, PADDED, PAGED
from hf_neural_attn.record import SCORER_ATTR


def test_every_shape_is_told_by_one_function_that_exists():
    assert set(CALL_SHAPES) == {PAGED, PACKED, CONTEXT, ORDINARY, PADDED}
    for name, shape in CALL_SHAPES.items():
        module_name, _, function = shape.told_by.rpartition(".")
        assert callable(getattr(importlib.import_module(module_name), function)), name
    told_by_the_call = {name for name, shape in CALL_SHAPES.items() if shape.told_by.endswith("attention.call_shape")}
    assert told_by_the_call == {PAGED, PACKED, CONTEXT, ORDINARY}  # padded: the dispatcher's, as its path decides


def test_calls_are_told_as_the_table_says(monkeypatch):
    model = hf_neural_attn.patch_model(tiny_model("llama"), "qana", h=2)
    module = next(m for m in model.modules() if hasattr(m, SCORER_ATTR))
    lengths = torch.tensor([0, 3, 5])
    assert attention.call_shape(module, {}, None) == ORDINARY
    assert attention.call_shape(module, {"cu_seq_lens_q": lengths, "cu_seq_lens_k": lengths}, None) == PACKED
    assert attention.call_shape(module, {"cu_seq_lens_q": lengths}, None) == ORDINARY  # no key spans: not packed
    # A base whose keys stay in an engine's paged cache (vLLM's registers itself): the call is that engine's.
    model.set_attn_implementation("sdpa")
    monkeypatch.setitem(attention.PAGED_BASES, "sdpa", lambda *args, **kwargs: None)
    assert attention.call_shape(module, {"cu_seq_lens_q": lengths, "cu_seq_lens_k": lengths}, None) == PAGED


def test_a_packed_call_under_context_parallelism_is_refused():
    shards = object()  # what context_parallel_shards returns while torch's block is open
    lengths = torch.tensor([0, 3, 5])
    with pytest.raises(ValueError, match="cannot score a packed call"):
        attention.keys_call_shape({"cu_seq_lens_q": lengths, "cu_seq_lens_k": lengths}, shards)
    assert attention.keys_call_shape({}, shards) == CONTEXT
    assert attention.keys_call_shape({}, None) == ORDINARY
